"""``SamplingParams.n`` (vLLM's parallel sampling, `jaxinfer.engine.parallel_sampling`) on
stories260K.

Judges from outside the code under test: the llama2.c greedy reference (greedy_reference.json)
for every greedy completion, and separate n = 1 requests with seeds seed + i (vLLM v1's
``ParentRequest._get_child_sampling_params``) for seeded completions: n = 1 requests are the
engine path already checked against llama2.c and transformers. Engine sizes are test_cli's and
test_resume_partial's (max_model_len 256, 8 rows), so the compiled steps are shared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
from conftest import STORIES
from test_engine import reference_requests

from jaxinfer.cli import main as cli
from jaxinfer.cli import partial as partial_mod
from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.parallel_sampling import child_params
from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import RequestError
from jaxinfer.outputs import RequestOutput, TokenLogprob
from jaxinfer.sampling.params import MAX_N, SamplingParams

PROMPT = "Once upon a time"
DOT = 426  # stories260K's "." token
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--no-progress"]
# Seed 14, n = 2 at temperature 0.8 ending at ".": completion 1 stops at token 11, completion 0
# at token 25 (checked below), so an interruption in between sees one finished, one running.
PAIR = {"prompt": PROMPT, "temperature": 0.8, "max_tokens": 40, "stop_token_ids": [DOT]}


@pytest.fixture(scope="module")
def llm():
    from jaxinfer.llm import LLM

    return LLM(STORIES, max_model_len=256, max_num_seqs=8)


def _fields(x) -> tuple:
    return (x.text, x.token_ids, x.finish_reason, x.stop_reason)


# ----------------------------------------------------------------------------- params


def test_bad_n_is_refused_naming_the_field():
    for bad in (0, -1, MAX_N + 1, 2**70, True, 2.0, "2", None):
        with pytest.raises(RequestError, match=r"\bn\b"):
            SamplingParams(n=bad)
    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(RequestError, match=r"n must be in \[1, 128\]"):
        SamplingParams.from_dict({"n": 0})


def test_child_params_seed_plus_index():
    sp = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=5)
    kids = child_params(sp)
    assert [k.seed for k in kids] == [7, 8, 9] and {k.n for k in kids} == {1}
    assert all(dataclasses.replace(k, seed=sp.seed, n=3) == sp for k in kids)
    # -1 would mean "no seed": the child keeps the same low 32 bits instead.
    assert [k.seed for k in child_params(SamplingParams(seed=-2, n=3))] == [-2, 2**32 - 1, 0]
    assert [k.seed for k in child_params(SamplingParams(n=2))] == [None, None]
    assert child_params(SamplingParams(n=1, seed=3)) == [SamplingParams(seed=3)]


def test_n1_output_is_one_completion_mirroring_the_top_level():
    lps = [TokenLogprob(5, -0.25, [(5, -0.25)]), TokenLogprob(6, -1.5, [(6, -1.5)])]
    out = RequestOutput(
        "r",
        "p",
        [1, 2],
        text="ab",
        token_ids=[5, 6],
        finish_reason="length",
        stop_reason=None,
        logprobs=lps,
        delta_text="b",
    )
    (c,) = out.outputs
    assert (c.index, c.text, c.token_ids, c.finish_reason, c.logprobs, c.delta_text) == (
        0,
        "ab",
        [5, 6],
        "length",
        lps,
        "b",
    )
    assert c.cumulative_logprob == -1.75  # vLLM: the sum of the sampled tokens' logprobs
    assert RequestOutput("r", None, [1]).outputs[0].cumulative_logprob is None


def test_parent_output_record_and_metrics_from_children():
    """A parent fed hand-made child outputs: the record holds both completions with their
    logprobs, usage counts the prompt once, and the metrics follow the documented rules
    (expected values worked out by hand)."""
    from jaxinfer.engine.parallel_sampling import ParentRequest
    from jaxinfer.outputs import RequestMetrics

    lp = [TokenLogprob(7, -0.5, [(7, -0.5)])]
    parent = ParentRequest("p", "hi", [1, 2, 3], 2)
    kids = [
        RequestOutput(
            "1_p",
            "hi",
            [1, 2, 3],
            text="b",
            token_ids=[7],
            finish_reason="length",
            logprobs=lp,
            delta_text="b",
            metrics=RequestMetrics(
                ttft_s=0.2,
                tpot_s=0.0,
                e2e_s=0.2,
                prompt_tokens=3,
                completion_tokens=1,
                num_cached_tokens=0,
                spec_rounds=1,
                acceptance_rate=0.5,
                mean_accepted_tokens=1.0,
            ),
        ),
        RequestOutput(
            "0_p",
            "hi",
            [1, 2, 3],
            text="aa",
            token_ids=[7, 7],
            finish_reason="stop",
            stop_reason=7,
            logprobs=lp * 2,
            delta_text="a",
            metrics=RequestMetrics(
                ttft_s=0.1,
                tpot_s=0.3,
                e2e_s=0.4,
                prompt_tokens=3,
                completion_tokens=2,
                num_cached_tokens=2,
                num_preemptions=1,
                spec_rounds=3,
                acceptance_rate=0.25,
                mean_accepted_tokens=0.5,
            ),
        ),
    ]
    first, _ = parent.on_child(1, kids[0])
    assert [o.outputs[0].index for o in first] == [1] and not first[0].finished
    outs, abort = parent.on_child(0, kids[1])
    assert abort == [] and [o.finished for o in outs] == [False, True]
    final = outs[-1]
    assert (final.text, final.finish_reason, final.stop_reason) == ("aa", "stop", 7)
    assert final.outputs[0].cumulative_logprob == -1.0
    m = final.metrics
    assert (m.ttft_s, m.e2e_s, m.tpot_s) == (0.1, 0.4, 0.15)
    assert (m.prompt_tokens, m.completion_tokens, m.num_cached_tokens, m.num_preemptions) == (
        3,
        3,
        0,
        1,
    )
    assert m.spec_rounds == 4 and m.acceptance_rate == (0.5 * 1 + 0.25 * 3) / 4
    assert m.mean_accepted_tokens == (1.0 * 1 + 0.5 * 3) / 4
    rec = final.to_record()
    assert rec["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}
    lp_rec = {"token_id": 7, "logprob": -0.5, "top": [(7, -0.5)]}
    assert rec["outputs"] == [
        {
            "index": 0,
            "text": "aa",
            "token_ids": [7, 7],
            "finish_reason": "stop",
            "stop_reason": 7,
            "logprobs": [lp_rec] * 2,
        },
        {
            "index": 1,
            "text": "b",
            "token_ids": [7],
            "finish_reason": "length",
            "stop_reason": None,
            "logprobs": [lp_rec],
        },
    ]


# ----------------------------------------------------------------------------- engine


def test_greedy_n3_every_completion_is_the_llama2c_reference(llm):
    # The two 64-step cases, one request each: 3 rows, the shapes of test_cli's greedy batch
    # (all three cases with n = 3 at once cost 8 more compilations).
    refs = reference_requests(llm.tokenizer)[1:]
    for ids, sp, expected in refs:
        (out,) = llm.generate([ids], dataclasses.replace(sp, n=3))
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            assert llm.tokenizer.decode(ids + c.token_ids) == expected, c.index
        assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
        assert out.metrics.prompt_tokens == len(ids)
        assert out.metrics.completion_tokens == 3 * len(out.outputs[0].token_ids)


def test_seeded_n4_equals_separate_requests_with_seed_plus_i(llm):
    # (test_cli_records... runs n > 1 beside n = 1 requests.)
    sp = SamplingParams(temperature=0.8, seed=1000, max_tokens=24, n=4)
    (out,) = llm.generate([PROMPT], sp)
    sep = llm.generate(
        [PROMPT] * 4,
        [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=24) for i in range(4)],
    )
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for c, s in zip(out.outputs, sep, strict=True):
        assert _fields(c) == _fields(s), c.index
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds differ
    assert out.metrics.prompt_tokens == sep[0].metrics.prompt_tokens
    assert out.metrics.completion_tokens == sum(s.metrics.completion_tokens for s in sep)
    # Without a seed every completion draws its own.
    free = llm.generate([PROMPT], SamplingParams(temperature=0.8, max_tokens=24, n=4))[0]
    assert len({tuple(c.token_ids) for c in free.outputs}) == 4


def test_streaming_shape(llm):
    sp = SamplingParams(temperature=0.8, seed=14, n=2, max_tokens=40, stop_token_ids=[DOT])
    outs = list(llm.generate_stream([PROMPT], sp, request_ids=["p"]))
    want = llm.generate([PROMPT] * 2, [dataclasses.replace(sp, n=1, seed=14 + i) for i in range(2)])
    assert [len(w.token_ids) for w in want] == [25, 11]  # the PAIR case (module docstring)
    *streamed, final = outs
    assert final.finished and final.request_id == "p"
    assert [c.index for c in final.outputs] == [0, 1]
    assert [c.delta_text for c in final.outputs] == ["", ""]  # all streamed before
    for c, w in zip(final.outputs, want, strict=True):
        assert _fields(c) == _fields(w)
    assert final.metrics.completion_tokens == 36
    assert final.metrics.prompt_tokens == len(llm.encode_prompt(PROMPT)[0])
    for i, w in enumerate(want):
        mine = [o for o in streamed if o.outputs[0].index == i]
        assert all(o.request_id == "p" and not o.finished and len(o.outputs) == 1 for o in mine)
        assert "".join(o.outputs[0].delta_text for o in mine) == w.text
        assert [o.outputs[0].finish_reason for o in mine] == [None] * (len(mine) - 1) + ["stop"]
        assert mine[-1].outputs[0].token_ids == w.token_ids
        assert all(o.delta_text == o.outputs[0].delta_text for o in mine)  # top = the completion
    assert len(streamed) == 25 + 11  # one per token
    # n = 1 streams as before: every output carries its one completion.
    one = list(llm.generate_stream([PROMPT], SamplingParams(temperature=0, max_tokens=5)))
    assert [o.finished for o in one] == [False] * 4 + [True]
    assert all(len(o.outputs) == 1 and o.outputs[0].delta_text == o.delta_text for o in one)


def test_closing_a_stream_aborts_every_completion(llm):
    stream = llm.generate_stream(
        [PROMPT], SamplingParams(temperature=0.8, n=3, max_tokens=40, ignore_eos=True)
    )
    next(stream)
    assert len(llm.engine._requests) == 3
    stream.close()
    assert not llm.engine._requests  # all three aborted, not just the one that streamed
    assert not llm._loop._routes and llm.engine_loop.num_requests == 0


def test_a_failed_completion_fails_the_request_and_the_batch_goes_on(llm, monkeypatch):
    step = EngineCore.step
    fired = []

    def failing_step(eng):
        outs = step(eng)
        if not fired and any(o.request_id == "1_bad" for o in outs):
            fired.append(1)
            outs = [
                eng.fail_request(o.request_id, "planted failure") if o.request_id == "1_bad" else o
                for o in outs
            ]
        return outs

    monkeypatch.setattr(EngineCore, "step", failing_step)
    other = SamplingParams(temperature=0.8, seed=3, max_tokens=12)
    outs = {
        o.request_id: o
        for o in llm.generate_stream(
            [PROMPT, "Lily"],
            [SamplingParams(temperature=0.8, n=3, max_tokens=30), other],
            request_ids=["bad", "good"],
        )
        if o.finished
    }
    monkeypatch.setattr(EngineCore, "step", step)
    bad = outs["bad"]
    assert bad.finish_reason == "error" and "completion 1 of 3" in bad.error
    assert "planted failure" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["abort", "error", "abort"]
    assert bad.to_record() == {"id": "bad", "error": bad.error, "finish_reason": "error"}
    assert not llm.engine.has_unfinished()  # the siblings were aborted
    assert _fields(outs["good"]) == _fields(llm.generate(["Lily"], other)[0])


def test_duplicate_and_colliding_ids_fail_alone(llm):
    sp2 = SamplingParams(temperature=0, max_tokens=4, n=2)
    sp1 = SamplingParams(temperature=0, max_tokens=4)
    outs = list(
        o
        for o in llm.generate_stream(
            [PROMPT] * 6,
            [sp2, sp1, sp2, sp1, sp1, sp2],
            request_ids=["a", "0_a", "a", "b", "1_c", "c"],
        )
        if o.finished
    )
    by = {}
    for o in outs:
        by.setdefault(o.request_id, []).append(o)
    errs = [o.error for o in by["0_a"] + by["a"] if o.error]
    assert len(errs) == 2 and all("duplicate request id" in e for e in errs), errs
    assert "completion 0 of the running request 'a'" in errs[0] + errs[1]
    (c,) = by["c"]  # its completion 1 would collide with the running request "1_c"
    assert "its completion id '1_c'" in c.error and len(c.outputs) == 2
    assert by["1_c"][0].error is None
    good_a = [o for o in by["a"] if o.error is None]
    assert len(good_a) == 1 and len(good_a[0].outputs) == 2 and by["b"][0].error is None


def test_resume_per_completion(llm):
    sp = SamplingParams(temperature=0.8, seed=14, n=2, max_tokens=40, stop_token_ids=[DOT])
    ref = llm.generate([PROMPT], sp)[0]
    a, b = ref.outputs
    states = [ResumeState(14, tuple(a.token_ids[:7])), ResumeState(15, tuple(b.token_ids[:-1]))]
    got = [o for o in llm.generate_stream([PROMPT], sp, resume=[states]) if o.finished][0]
    for g, w in zip(got.outputs, ref.outputs, strict=True):
        assert _fields(g) == _fields(w)
    assert got.metrics.resumed_tokens == 7 + len(b.token_ids) - 1
    bad = list(llm.generate_stream([PROMPT], sp, resume=[ResumeState(14)]))
    assert len(bad) == 1 and "n=2 must be a sequence of 2 ResumeState" in bad[0].error
    with pytest.raises(ValueError, match="n > 1"):
        llm.draw_seeds([sp])


# ----------------------------------------------------------------------------- the CLI


def _records() -> list[dict]:
    return [
        {**PAIR, "id": "pair", "seed": 14, "n": 2},
        {**PAIR, "id": "s14", "seed": 14},
        {**PAIR, "id": "s15", "seed": 15},
        {"id": "greedy", "prompt": PROMPT, "temperature": 0, "max_tokens": 30},
        # No seed: each completion's is drawn at the start and kept in the partial file.
        {"id": "free", "prompt": PROMPT, "temperature": 0.8, "max_tokens": 40, "n": 2},
        {"id": "zero", "prompt": PROMPT, "n": 0},
        {"id": "bool", "prompt": PROMPT, "n": True},
        {"id": "float", "prompt": PROMPT, "n": 2.0},
        {"id": "big", "prompt": PROMPT, "n": MAX_N + 1},
    ]


def _run(tmp_path: Path, capsys, out: Path, *flags: str) -> tuple[int, str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    rc = cli.main(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            *ENGINE,
            *flags,
        ]
    )
    return rc, capsys.readouterr().err


def _by_id(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


def test_cli_records_and_resume_mid_completion(tmp_path, capsys, monkeypatch):
    ref_out = tmp_path / "ref.jsonl"
    rc, err = _run(tmp_path, capsys, ref_out)
    assert rc == 0, err
    recs = _by_id(ref_out)
    for rid in ("zero", "bool", "float", "big"):  # bad n: an error record naming the field
        assert recs[rid]["finish_reason"] == "error" and " n " in recs[rid]["error"], recs[rid]
    pair = recs["pair"]
    assert list(pair) == ["id", "outputs", "usage", "metrics"]
    assert [c["index"] for c in pair["outputs"]] == [0, 1]
    for c, sep in zip(pair["outputs"], (recs["s14"], recs["s15"]), strict=True):
        assert list(c) == ["index", "text", "token_ids", "finish_reason", "stop_reason"]
        assert {k: c[k] for k in c if k != "index"} == {
            k: sep[k] for k in ("text", "token_ids", "finish_reason", "stop_reason")
        }
    assert [len(c["token_ids"]) for c in pair["outputs"]] == [25, 11]
    assert pair["usage"] == {
        "prompt_tokens": recs["s14"]["usage"]["prompt_tokens"],
        "completion_tokens": 36,
    }
    assert recs["free"]["outputs"][0] != recs["free"]["outputs"][1]
    # n = 1 records keep their shape.
    assert list(recs["greedy"]) == [
        "id",
        "text",
        "token_ids",
        "finish_reason",
        "stop_reason",
        "usage",
        "metrics",
    ]

    # Interrupted after completion 1 finished (token 11) and before completion 0 did (25).
    out = tmp_path / "out.jsonl"
    part = partial_mod.partial_path(out)
    step, steps = EngineCore.step, []

    def hooked(eng):
        steps.append(1)
        if len(steps) == 18:
            _sigterm()
        return step(eng)

    with monkeypatch.context() as m:
        m.setattr(EngineCore, "step", hooked)
        rc, err = _run(tmp_path, capsys, out)
    assert rc == 143, err
    saved = {r["id"]: r for r in json.loads(part.read_text())["requests"]}
    comps = saved["pair"]["completions"]
    assert [c["seed"] for c in comps] == [14, 15]
    assert len({c["seed"] for c in saved["free"]["completions"]}) == 2
    assert all(len(c["token_ids"]) > 5 for c in saved["free"]["completions"])
    assert comps[1]["token_ids"] == pair["outputs"][1]["token_ids"][:-1]  # finished: all but last
    assert 11 <= len(comps[0]["token_ids"]) < 25
    assert comps[0]["token_ids"] == pair["outputs"][0]["token_ids"][: len(comps[0]["token_ids"])]
    rc, err = _run(tmp_path, capsys, out)
    assert rc == 0 and not part.exists(), err
    got = _by_id(out)
    assert sorted(got) == sorted(recs)
    for rid, want in recs.items():
        g, w = dict(got[rid]), dict(want)
        if "metrics" in w:
            assert g.pop("metrics")["completion_tokens"] == w.pop("metrics")["completion_tokens"]
        assert g == w, rid
    assert got["pair"]["metrics"]["resumed_tokens"] == len(comps[0]["token_ids"]) + 10


def test_cli_n_flag(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    out = tmp_path / "o.jsonl"
    args = [
        "generate",
        "--model",
        str(STORIES),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        *ENGINE,
    ]
    assert cli.main([*args, "--n", "0"]) == 2
    assert "n must be in [1, 128]" in capsys.readouterr().err
    assert cli.main([*args, "--n", "2", "--temperature", "0", "--max-tokens", "6"]) == 0
    (rec,) = _by_id(out).values()
    assert [c["token_ids"] for c in rec["outputs"]] == [rec["outputs"][0]["token_ids"]] * 2
    assert len(rec["outputs"][0]["token_ids"]) == 6


def test_engine_refuses_an_unexpanded_n(stories_llm):
    # EngineCore.add_request runs one sequence: n > 1 reaching it directly would silently give one.
    eng = stories_llm.engine
    with pytest.raises(RequestError, match="n=3"):
        eng.add_request("direct-n3", [1, 2, 3], SamplingParams(n=3, max_tokens=2))
    assert "direct-n3" not in eng._requests and not eng.has_unfinished()
