"""Speculative decoding from models saved on disk, judged by llama2.c's greedy outputs of
stories260K (issue 16): ``jaxinfer quantize`` writes int8 weights (numpy scales, bit for bit what
quantizing in memory gives), ``jaxinfer train-draft-heads`` writes a heads directory, and
``jaxinfer generate --model INT8_DIR --speculative heads --draft-heads HEADS_DIR`` reproduces
llama2.c's text; ``draft_model=PATH`` loads another trained llama2.c model (aidreams260K) as the
draft, and greedy output is still llama2.c's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cli import main as cli
from jaxinfer.sampling.sampler import SamplingParams
from tests.conftest import STORIES, stories_reference

# XLA computes max|w| / 127 as a product with the reciprocal: within one float32 ulp of numpy's.
F32_EPS = float(np.finfo(np.float32).eps)

BOS = 1
AIDREAMS = STORIES.parent / "aidreams260K" / "aidreams260K.bin"
# One engine shape for every stories260K engine below (pages of 64 tokens: one block-table bucket).
# Layers under lax.scan (unroll_layers=False, the CPU default unrolls them): each speculative round
# compiles ~2x faster, and what is checked here, the models and heads read from disk reproducing
# llama2.c's text, does not depend on the layers' form (the unrolled form with speculative rounds:
# test_speculative's tiny greedy tests).
STORY_ENGINE = dict(
    max_model_len=256, page_size=64, max_num_seqs=4, compilation_cache=False, unroll_layers=False
)


@pytest.fixture(scope="module")
def reference():
    """llama2.c's two 64-step greedy cases as requests (prompt ids with BOS, run.c's step count,
    stop on BOS) and a check that outputs reproduce run.c's text. (Equal lengths: the rows finish
    together, so no batch-1 decode shape is compiled.)"""
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(STORIES / "tok512.model", vocab_size=512)
    cases = [c for c in stories_reference() if c["max_steps"] == 64]
    assert len(cases) == 2
    prompts = [tok.encode(c["prompt"]) for c in cases]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=c["max_steps"] - (len(p) - 1), stop_token_ids=[BOS]
        )
        for c, p in zip(cases, prompts, strict=True)
    ]

    def check(token_ids, what):
        for c, p, ids in zip(cases, prompts, token_ids, strict=True):
            text = tok.decode(p + list(ids), skip_special_tokens=True)
            assert text == c["expected"], (what, c["prompt"], text)

    return prompts, params, check


def test_quantize_and_train_draft_heads_then_generate_from_both_directories(
    tmp_path, capsys, reference
):
    """The README's workflow on stories260K: ``jaxinfer quantize`` writes int8 weights (numpy
    scales, bit for bit what quantizing in memory gives); a few steps of ``jaxinfer
    train-draft-heads`` write a heads directory; ``jaxinfer generate --model DIR --speculative
    heads --draft-heads HEADS`` loads both and its greedy output is llama2.c's (int8 keeps the
    reference text on these cases, README: agreement 1.0; greedy speculative == greedy)."""
    from jaxinfer.loaders import load
    from jaxinfer.quant import QTensor, quantize

    prompts, params, check = reference
    qdir = tmp_path / "int8"
    assert cli.main(["quantize", "--model", str(STORIES), "--out", str(qdir)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantized_bytes"] < summary["float_bytes"] / 2
    float_params = load(STORIES).params
    saved = load(qdir)
    w = np.asarray(float_params.layers.w_gate)  # [L, D, F]
    q = saved.params.layers.w_gate  # values [L, F, D]
    assert isinstance(q, QTensor) and q.values.dtype == jnp.int8
    scales = np.abs(w).max(axis=1) / np.float32(127)
    np.testing.assert_allclose(np.asarray(q.scales), scales, rtol=F32_EPS, atol=0)  # 1 ulp
    np.testing.assert_array_equal(
        np.asarray(q.values), np.round(np.swapaxes(w, 1, 2) / scales[..., None])
    )
    mem = quantize(float_params, "int8")
    assert jax.tree.structure(mem) == jax.tree.structure(saved.params)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(mem), jax.tree.leaves(saved.params), strict=True)
    )

    heads = tmp_path / "heads"
    rc = cli.main(
        [
            "train-draft-heads",
            "--model",
            str(STORIES),
            "--out",
            str(heads),
            "--num-heads",
            "2",
            "--num-sequences",
            "8",
            "--gen-tokens",
            "16",
            "--steps",
            "3",
            "--batch-size",
            "32",
            "--held-out",
            "0.25",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and len(summary["held_out_top1_agreement"]) == 2
    assert (heads / "heads").is_dir() and (heads / "meta.json").is_file()
    assert (heads / "loss.png").stat().st_size > 0

    recs = tmp_path / "p.jsonl"
    lines = [
        {
            "id": str(i),
            "prompt_token_ids": p,
            "max_tokens": params[i].max_tokens,
            "stop_token_ids": [BOS],
        }
        for i, p in enumerate(prompts)
    ]
    recs.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "generate",
            "--model",
            str(qdir),
            "--prompts",
            str(recs),
            "--out",
            str(out),
            "--max-model-len",
            "256",
            "--page-size",
            "64",
            "--max-num-seqs",
            "4",
            "--no-progress",
            "--temperature",
            "0",
            "--speculative",
            "heads",
            "--draft-heads",
            str(heads),
            "--num-speculative-tokens",
            "2",
            "--no-unroll-layers",  # as STORY_ENGINE
        ]
    )
    assert rc == 0, capsys.readouterr().err
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    check([got[str(i)]["token_ids"] for i in range(len(prompts))], "int8 dir + heads dir")
    assert all(r["metrics"]["spec_rounds"] > 0 for r in got.values())


def test_draft_model_from_a_checkpoint_path(reference):
    """``draft_model=PATH``: aidreams260K (another trained llama2.c model with 512 ids; 4 layers,
    4 heads of 16 dims to the target's 5 layers, 8 heads of 8) drafts for stories260K. Most
    drafts are rejected, and greedy output is still llama2.c's."""
    from jaxinfer.llm import LLM

    prompts, params, check = reference
    llm = LLM(
        STORIES,
        speculative="draft-model",
        draft_model=str(AIDREAMS),
        num_speculative_tokens=2,
        **STORY_ENGINE,
    )
    dcfg = llm.engine.speculative.draft_cfg
    assert (dcfg.num_layers, dcfg.num_heads, dcfg.head_dim) == (4, 4, 16)
    outs = llm.generate(prompts, params)
    check([o.token_ids for o in outs], "draft model from a path")
    assert all(o.metrics.spec_rounds > 0 and o.metrics.acceptance_rate < 0.9 for o in outs)
