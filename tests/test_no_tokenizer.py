"""Models without a tokenizer (issue 15, class 6), as vLLM's ``skip_tokenizer_init``: token ids in,
token ids out, no text; a request that needs text fails alone.

The judges are outside the project: transformers' own greedy ``generate`` (and its logits) on a
tiny random Llama checkpoint saved with no tokenizer files, its EOS from ``config.json``; and
llama2.c's greedy reference of stories260K, decoded with the real tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hf_fixtures as H
import numpy as np
import pytest
from conftest import STORIES_CLI_FLAGS

from jaxinfer.cli import main as cli
from jaxinfer.errors import CheckpointError, RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling.sampler import SamplingParams
from jaxinfer.tokenizers.ids_only import NoTokenizerWarning, config_special_ids

SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
STORIES = SHARED / "models" / "stories260K"
needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} is absent")

NEW = 12  # tokens generated per request
# One engine shape for the LLM and the CLI runs, that of test_chat_and_sampling_vs_transformers'
# engine on the same tiny Llama, so they all share their compiled steps.
ENGINE = dict(max_model_len=128, max_num_seqs=8)
CLI_ENGINE = ["--max-model-len", "128", "--max-num-seqs", "8", "--no-progress"]
STORIES_ENGINE = STORIES_CLI_FLAGS  # test_cli's
LOGPROB_ATOL = 1e-4  # f32 against transformers f32 (logits agree to max_rel 1e-4, test_hf_parity)


def _hf_generate(model, prompt: list[int], **kw):
    import torch

    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            pad_token_id=0,
            **kw,
        )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Llama saved by transformers with no tokenizer files, whose config's EOS is a
    token its greedy continuation of ``prompt`` emits part-way; with transformers' references.

    Returns dict: path, prompt (list[int]), eos, ref (NEW greedy ids, EOS ignored), ref_logits
    (f32[NEW, V] transformers' logits of each step), ref_eos (greedy ids stopping at EOS)."""
    path = str(tmp_path_factory.mktemp("no_tok") / "llama")
    H.build_checkpoint("llama2", path)
    prompt = H.sample_tokens(seed=1)[0, : H.PROMPT_LEN].tolist()
    model = H.hf_model(path)  # generation_config.eos_token_id = None: exactly NEW tokens
    out = _hf_generate(model, prompt, output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt) :].tolist()
    logits = np.stack([x[0].float().numpy() for x in out.logits])
    assert len(ref) == NEW and len(set(ref)) >= 6, "degenerate continuation"
    # EOS: the first token that appears at step >= 3 and not before (so EOS cuts the output).
    k = next(i for i in range(3, NEW - 1) if ref[i] not in ref[:i] and ref[i] > 2)
    eos = ref[k]
    for name in ("config.json", "generation_config.json"):
        f = Path(path) / name
        c = json.loads(f.read_text())
        c["eos_token_id"] = eos
        f.write_text(json.dumps(c))
    assert not any("token" in n for n in os.listdir(path)), os.listdir(path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert model.generation_config.eos_token_id == eos
    ref_eos = _hf_generate(model, prompt)[0, len(prompt) :].tolist()
    assert ref_eos == ref[: k + 1]  # transformers stopped at the config's EOS, included
    return dict(path=path, prompt=prompt, eos=eos, ref=ref, ref_logits=logits, ref_eos=ref_eos)


@pytest.fixture(scope="module")
def llm(ckpt):
    with pytest.warns(NoTokenizerWarning, match=r"no tokenizer found.*EOS id\(s\) \[\d+\]"):
        llm = LLM(ckpt["path"], **ENGINE)
    assert llm.tokenizer is None
    return llm


def test_greedy_token_ids_and_logprobs_match_transformers(ckpt, llm):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    dict_out, list_out = llm.generate([{"prompt_token_ids": ckpt["prompt"]}, ckpt["prompt"]], sp)
    for out in (dict_out, list_out):
        assert out.error is None, out.error
        assert out.token_ids == ckpt["ref"]
        assert out.text is None and out.finish_reason == "length"
        logits = ckpt["ref_logits"].astype(np.float64)
        m = logits.max(-1, keepdims=True)
        ref_lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        got = np.array([lp.logprob for lp in out.logprobs])
        np.testing.assert_allclose(got, ref_lp[np.arange(NEW), ckpt["ref"]], atol=LOGPROB_ATOL)
        top2 = [[i for i, _ in lp.top] for lp in out.logprobs]
        assert top2 == np.argsort(-logits, -1)[:, :2].tolist()
    streamed = list(
        llm.generate_stream([ckpt["prompt"]], SamplingParams(temperature=0.0, max_tokens=3))
    )
    assert streamed and all(o.text is None and o.delta_text is None for o in streamed)
    assert streamed[-1].token_ids == ckpt["ref"][:3]


def test_eos_from_the_config_stops_like_transformers(ckpt, llm):
    out = llm.generate(
        [{"prompt_token_ids": ckpt["prompt"]}], SamplingParams(temperature=0.0, max_tokens=NEW)
    )[0]
    assert out.token_ids == ckpt["ref_eos"] and out.token_ids[-1] == ckpt["eos"]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_requests_that_need_text_fail_alone(ckpt, llm):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = [
        "Once upon a time",
        {"prompt": "hi"},
        ckpt["prompt"],
        {"messages": [{"role": "user", "content": "hi"}]},
        ckpt["prompt"],
    ]
    params = [sp, sp, SamplingParams(temperature=0.0, stop=["a"]), sp, sp]
    outs = llm.generate(prompts, params)
    for i, what in [
        (0, "a text prompt"),
        (1, "a text prompt"),
        (2, "a stop string (stop)"),
        (3, "a chat ('messages') request"),
    ]:
        assert outs[i].finish_reason == "error", i
        assert outs[i].error.startswith(what + " needs a tokenizer"), outs[i].error
        assert "runs without one" in outs[i].error and "prompt_token_ids" in outs[i].error
    assert outs[4].error is None and outs[4].token_ids == ckpt["ref"]
    with pytest.raises(RequestError, match="chat\\(\\) needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_cli_token_id_records_without_tokenizer(ckpt, tmp_path, capsys):
    p = ckpt["prompt"]
    records = [
        {
            "id": "ids",
            "prompt_token_ids": p,
            "temperature": 0,
            "max_tokens": NEW,
            "ignore_eos": True,
        },
        {"id": "text", "prompt": "Once upon a time"},
        {"id": "stop", "prompt_token_ids": p, "stop": ["x"]},
        {"id": "eos", "prompt_token_ids": p, "temperature": 0, "max_tokens": NEW},
    ]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.warns(NoTokenizerWarning):
        rc = cli.main(
            [
                "generate",
                "--model",
                ckpt["path"],
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                *CLI_ENGINE,
            ]
        )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completed"] == 2 and summary["errors"] == 2
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert got["ids"]["token_ids"] == ckpt["ref"] and "text" not in got["ids"]
    assert got["eos"]["token_ids"] == ckpt["ref_eos"] and "text" not in got["eos"]
    assert got["eos"]["finish_reason"] == "stop"
    for rid in ("text", "stop"):
        assert got[rid]["finish_reason"] == "error"
        assert "needs a tokenizer" in got[rid]["error"], got[rid]
        assert "prompt_token_ids" in got[rid]["error"]


@needs_stories
def test_cli_skip_tokenizer_init_reproduces_llama2c_reference(tmp_path, capsys):
    """stories260K with its tokenizer beside it, skipped: the README's ids of "Once upon a time"
    give ids that the real tokenizer decodes to llama2.c's greedy output."""
    from jaxinfer.tokenizers import load_tokenizer

    case = next(
        c
        for c in json.loads((STORIES / "greedy_reference.json").read_text())
        if c["prompt"] == "Once upon a time"
    )
    ids = [1, 403, 407, 261, 378]  # README: BOS = 1; encode("Once upon a time")
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "id": "a",
                "prompt_token_ids": ids,
                "temperature": 0,
                "max_tokens": case["max_steps"] - 4,
            }
        )
        + "\n"
        + json.dumps({"id": "b", "prompt": "Once upon a time"})
        + "\n"
    )
    rc = cli.main(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--skip-tokenizer-init",
            *STORIES_ENGINE,
        ]
    )
    assert rc == 0
    capsys.readouterr()
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    a, b = got["a"], got["b"]
    assert "text" not in a and b["finish_reason"] == "error" and "tokenizer" in b["error"]
    tok = load_tokenizer(STORIES / "tok512.model")
    assert tok.decode(ids[1:] + a["token_ids"]) == case["expected"]


@needs_stories
def test_llama2c_checkpoint_alone_stops_on_bos_and_eos(tmp_path):
    """A llama2.c .bin with no tokenizer beside it loads with a warning and stops on the
    format's BOS = 1 and EOS = 2 (stories260K README; llama2.c run.c)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "stories260K.bin").symlink_to(STORIES / "stories260K.bin")
    with pytest.warns(NoTokenizerWarning, match=r"no tokenizer found.*EOS id\(s\) \[2\]"):
        llm = LLM(d, max_model_len=64, max_num_seqs=1, compilation_cache=False)
    assert llm.tokenizer is None and llm.engine.stop_ids == {1, 2}


def test_config_special_ids_and_argument_checks(tmp_path):
    from jaxinfer.models.config import ModelConfig

    cfg = ModelConfig("llama", 100, 8, 16, 1, 2, 2, 4)
    (tmp_path / "config.json").write_text(
        json.dumps({"eos_token_id": [7, 9], "bos_token_id": 5, "text_config": {"eos_token_id": 11}})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert config_special_ids(cfg, tmp_path) == (5, (9, 7, 11))
    for bad, why in [
        ("2", "must be an integer"),
        (True, "must be an integer"),
        ([1, 100], "outside the vocabulary"),
    ]:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(CheckpointError, match=f"generation_config.json: eos_token_id.*{why}"):
            config_special_ids(cfg, tmp_path)
    with pytest.raises(ValueError, match="contradict"):
        LLM(tmp_path, tokenizer="x", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init must be True or False"):
        LLM(tmp_path, skip_tokenizer_init="yes")
