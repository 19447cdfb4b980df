"""Mixture-of-experts families against transformers on tiny random checkpoints
(``moe_fixtures``: Mixtral, Qwen2-MoE with a gated shared expert and a dense middle layer,
Qwen3-MoE with a dense first layer, OLMoE with its whole-projection q/k norm).

Through the paged engine (``LLM``): three prompts of 13, 6 and 19 tokens in one batch, KV pages of
8 tokens and an 8-token step budget, so prompts are prefilled in chunks beside decoding rows
(mixed prefill/decode steps); greedy tokens must equal transformers' greedy ``generate``, the
logprob of every prompt position (``prompt_logprobs``) and of every generated token must equal
``log_softmax`` of transformers' f32 logits within 1e-4 (the f32 tolerance of
``test_family_engine_parity``). The cache-less forward is checked on a 2 x 24 batch at
``test_hf_parity``'s f32 bound (max_rel 1e-4); a prompt sharing two KV pages with an earlier one
reads them from the prefix cache and still decodes transformers' tokens; and a checkpoint
rewritten in transformers 5's fused expert layout loads to the same weights. bfloat16 logits are
held to ``test_hf_parity``'s bf16 bounds, and n-gram speculative decoding (drafts accepted) gives
transformers' greedy tokens.
"""

from __future__ import annotations

import dataclasses

import hf_fixtures as H
import jax.numpy as jnp
import moe_fixtures as M
import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.loaders.hf import load_hf
from jaxinfer.models.dense import dense_logits
from jaxinfer.sampling.sampler import SamplingParams

FAMILIES = list(M.CASES)
F32_MAX_REL = 1e-4  # as test_hf_parity
LOGPROB_ATOL = 1e-4  # as test_family_engine_parity
PROMPT_LENS = (13, 6, 19)
NEW = 10
ENGINE = dict(
    max_model_len=32,
    page_size=8,
    max_num_seqs=3,
    max_num_batched_tokens=8,
    compilation_cache=False,
    skip_tokenizer_init=True,
)


def _prompts() -> list[list[int]]:
    ids = H.random_ids(sum(PROMPT_LENS), seed=7)
    out, at = [], 0
    for n in PROMPT_LENS:
        out.append(ids[at : at + n])
        at += n
    return out


_BUILT: dict[str, tuple] = {}


def _family(name: str, tmp_path_factory) -> tuple:
    """(name, checkpoint path, transformers f32 model), built once per family in this module."""
    if name not in _BUILT:
        path = M.build_checkpoint(name, str(tmp_path_factory.mktemp("moe") / name))
        _BUILT[name] = (name, path, H.hf_model(path, "float32"))
    return _BUILT[name]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint path, transformers f32 model), built once per family."""
    return _family(request.param, tmp_path_factory)


def test_forward_logits_equal_transformers(family, tmp_path):
    name, path, model = family
    tokens = H.sample_tokens()
    ref = H.hf_logits(model, tokens)
    cfg, params = load_hf(path)
    assert cfg.is_moe and cfg.model_type == name
    got = np.asarray(dense_logits(params, cfg, jnp.asarray(tokens)))
    err = H.errors(got, ref)
    assert np.abs(ref).max() > 1.0 and ref.std() > 0.3
    assert err["max_rel"] <= F32_MAX_REL, (name, err)
    # the same model stored with fused experts (transformers 5's in-memory layout)
    cfg_f, params_f = load_hf(M.fused_copy(path, str(tmp_path / "fused")))
    assert cfg_f == cfg
    np.testing.assert_array_equal(
        np.asarray(dense_logits(params_f, cfg_f, jnp.asarray(tokens))), got
    )


BF16_VS_HF_ERROR = 2.0  # as test_hf_parity: x transformers' own bf16 max error
BF16_RMS_RATIO = 1.25


def test_forward_logits_bf16(family):
    """bfloat16 weights, against transformers in bfloat16, at test_hf_parity's bounds (stated
    against transformers' own bf16 error on the same model and tokens)."""
    name, path, model = family
    tokens = H.sample_tokens()
    ref32 = H.hf_logits(model, tokens)
    ref16 = H.hf_logits(H.hf_model(path, "bfloat16"), tokens)
    got16, _, params = H.jax_logits(path, "bfloat16", tokens)
    assert params.layers.expert_down.dtype == jnp.bfloat16
    err, e_hf, e_jax = H.errors(got16, ref16, ref32), H.errors(ref16, ref32), H.errors(got16, ref32)
    assert err["max_rel"] <= BF16_VS_HF_ERROR * e_hf["max_rel"], (name, err, e_hf)
    assert e_jax["rms_rel"] <= BF16_RMS_RATIO * e_hf["rms_rel"], (name, e_jax, e_hf)


def test_engine_greedy_and_logprobs_equal_transformers(family):
    import torch

    name, path, model = family
    prompts = _prompts()
    ref_ids, ref_lp = [], []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p], dtype=torch.long),
                attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
        seq = out[0].tolist()
        ref_ids.append(seq[len(p) :])
        ref_lp.append(H.log_softmax(H.hf_logits(model, [seq])[0]))  # f64[S, V]
    for ids in ref_ids:
        assert len(set(ids)) >= 4, (name, ids)  # a varied continuation

    llm = LLM(path, **ENGINE)
    cfg = llm.engine.cfg
    assert cfg.is_moe and min(PROMPT_LENS) < ENGINE["max_num_batched_tokens"] < max(PROMPT_LENS)
    sp = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    outs = llm.generate(prompts, sp)
    for i, (out, p, want, lp) in enumerate(zip(outs, prompts, ref_ids, ref_lp, strict=True)):
        assert out.error is None, (name, out.error)
        assert out.token_ids == want, (name, i)
        got_prompt = [e.logprob for e in out.prompt_logprobs[1:]]
        np.testing.assert_allclose(
            got_prompt,
            lp[np.arange(len(p) - 1), p[1:]],
            rtol=0,
            atol=LOGPROB_ATOL,
            err_msg=f"{name} prompt {i}",
        )
        got_new = [e.logprob for e in out.logprobs]
        pos = np.arange(len(p) - 1, len(p) - 1 + NEW)
        np.testing.assert_allclose(
            got_new, lp[pos, want], rtol=0, atol=LOGPROB_ATOL, err_msg=f"{name} output {i}"
        )

    # Prefix caching (on by default): a prompt sharing the longest prompt's first two full pages
    # reads their KV from the cache, and its greedy tokens still equal transformers'. It asks for
    # the logprobs of its last 2 prompt tokens only (prompt_logprobs_from, as LLM.score does:
    # positions before 16 have no logits to give), so the cached pages are read and its steps are
    # shapes compiled above (no new compilation).
    shared = prompts[2][:16] + H.random_ids(3, seed=8)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([shared], dtype=torch.long),
            attention_mask=torch.ones((1, len(shared)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            pad_token_id=0,
        )[0, len(shared) :].tolist()
    lp = H.log_softmax(H.hf_logits(model, [shared + ref])[0])
    (out,) = llm.generate([shared], dataclasses.replace(sp, prompt_logprobs_from=len(shared) - 2))
    assert out.metrics.num_cached_tokens == 16, out.metrics
    assert out.token_ids == ref, name
    assert out.prompt_logprobs[-3] is None
    pos = np.arange(len(shared) - 3, len(shared) - 1)
    np.testing.assert_allclose(
        [e.logprob for e in out.prompt_logprobs[-2:]],
        lp[pos, shared[-2:]],
        rtol=0,
        atol=LOGPROB_ATOL,
        err_msg=f"{name} cached prompt",
    )
    pos = np.arange(len(shared) - 1, len(shared) - 1 + NEW)
    np.testing.assert_allclose(
        [e.logprob for e in out.logprobs], lp[pos, ref], rtol=0, atol=LOGPROB_ATOL, err_msg=name
    )


def _generate(model, prompt: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_speculative_ngram_equals_transformers(tmp_path_factory):
    """n-gram speculative decoding on an MoE model (Qwen3-MoE, dense and sparse layers): the
    verify rounds run k + 1 tokens a row through the experts; greedy tokens equal transformers'.
    Prompts repeat a phrase so the drafter proposes tokens. Steps of 8 tokens and more run the
    layer scan (``scan_layers_from_tokens``), where a mixed model picks each layer's MLP with
    ``lax.cond``."""
    _, path, model = _family("qwen3_moe", tmp_path_factory)  # the family tests' checkpoint
    a, b = H.random_ids(5, seed=9), H.random_ids(4, seed=10)
    prompts = [a + a + a[:3], b + b + b + b[:2]]
    # steps of >= 8 tokens (the prefill chunks) run the layers as a scan picking each layer's
    # buffers (lax.switch) and its MLP with lax.cond; shorter ones unrolled
    llm = LLM(
        path, speculative="ngram", num_speculative_tokens=3, scan_layers_from_tokens=8, **ENGINE
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for out, p in zip(outs, prompts, strict=True):
        assert out.error is None and out.token_ids == _generate(model, p)
    assert any(o.metrics.acceptance_rate is not None for o in outs)  # rounds ran with drafts
