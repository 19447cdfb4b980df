"""Async scheduling (``EngineConfig.async_scheduling``): step N+1 is dispatched before step N's
tokens are read back. Its outputs must equal the synchronous engine's, which the greedy reference
tests tie to llama2.c; here the two modes run the same mixed workload side by side."""

import numpy as np
import pytest
from test_engine import MIXED, reference_requests

from jaxinfer.sampling.sampler import SamplingParams


@pytest.fixture(scope="module")
def sync_llm(stories_dir):
    from jaxinfer.llm import LLM

    # Same sizes as the shared stories_llm fixture (async by default), so the compiled steps are
    # shared; only the scheduling differs.
    return LLM(stories_dir, max_num_seqs=32, compilation_cache=False, async_scheduling=False)


def workload(tokenizer):
    refs = reference_requests(tokenizer)
    prompts = [ids for ids, _, _ in refs] + [tokenizer.encode(p) for p in MIXED[:8]]
    params = [sp for _, sp, _ in refs] + [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.9, seed=3, max_tokens=60),
        SamplingParams(temperature=0.0, max_tokens=200, stop=["park", "."]),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=50, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25),
        SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=45, stop_token_ids=[13]),
    ]
    return refs, prompts, params


def run_engine(llm, prompts, params):
    """Drives ``llm.engine`` step by step; returns (outputs by id, steps leaving one in flight)."""
    eng = llm.engine
    for i, (ids, sp) in enumerate(zip(prompts, params, strict=False)):
        eng.validate(ids, sp)
        eng.add_request(f"a{i}", ids, sp)
    seqs = {rid: req.seq for rid, req in eng._requests.items()}
    finals, overlapped = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finish_reason is not None:
                finals[out.request_id] = out
        overlapped += eng._inflight is not None
    assert eng.kv_manager.num_free_pages == eng.kv_manager.num_pages - 1  # every page came back
    for rid, seq in seqs.items():
        if seq.finish_reason == "length":  # its last token is known to be last: never computed
            assert seq.num_computed == seq.num_tokens - 1, rid
    return [finals[f"a{i}"] for i in range(len(prompts))], overlapped


def test_async_outputs_equal_sync(stories_llm, sync_llm):
    refs, prompts, params = workload(stories_llm.tokenizer)
    outs_a, overlapped_a = run_engine(stories_llm, prompts, params)
    outs_s, overlapped_s = run_engine(sync_llm, prompts, params)
    assert overlapped_s == 0 and overlapped_a > 0
    for (ids, _, expected), out in zip(
        refs, outs_a, strict=False
    ):  # llama2.c's outputs, EOS stop included
        assert stories_llm.tokenizer.decode(ids + out.token_ids) == expected
    for a, s in zip(outs_a, outs_s, strict=False):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            s.token_ids,
            s.text,
            s.finish_reason,
            s.stop_reason,
        ), a.request_id
        assert a.metrics.completion_tokens == len(a.token_ids)
        if s.logprobs is not None:
            assert [lp.token_id for lp in a.logprobs] == a.token_ids
            np.testing.assert_allclose(
                [lp.logprob for lp in a.logprobs],
                [lp.logprob for lp in s.logprobs],
                rtol=0,
                atol=1e-5,
            )


def test_async_stops_exactly_at_max_model_len(stories_llm, sync_llm):
    """The last token of a sequence that reaches max_model_len (or max_tokens) is known to be its
    last before it is read back: the next step must not compute it (``run_engine`` checks that
    it never is), and the output ends exactly at max_model_len."""
    rng = np.random.default_rng(0)
    n = stories_llm.engine.ecfg.max_model_len
    prompts = [[1] + rng.integers(3, 500, n - 1 - k).tolist() for k in (1, 2, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outs_a, _ = run_engine(stories_llm, prompts, [sp] * 3)
    outs_s, _ = run_engine(sync_llm, prompts, [sp] * 3)
    for p, a, s in zip(prompts, outs_a, outs_s, strict=False):
        assert len(p) + len(a.token_ids) == n and a.finish_reason == "length"
        assert a.token_ids == s.token_ids


def test_async_scheduling_flag_is_validated():
    from jaxinfer.args import EngineArgs

    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineArgs("m", async_scheduling="yes")


def test_async_with_speculative_is_refused(stories_dir):
    from jaxinfer.llm import LLM

    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        LLM(stories_dir, speculative="ngram", async_scheduling=True, compilation_cache=False)


def _spy_order(eng, monkeypatch):
    """Records the engine's dispatches (with their live decode / prefill row counts, read from
    the batch the runner gets) and collects."""
    events = []
    run, collect = eng.runner.run, eng._collect

    def spy_run(inputs, prev=None):
        md = inputs.batch.md
        td, live = int(md.num_decode), np.asarray(md.kv_lens) > 0
        events.append(("dispatch", int(live[:td].sum()), int(live[td:].sum())))
        return run(inputs, prev)

    def spy_collect(done):
        events.append(("collect",))
        return collect(done)

    monkeypatch.setattr(eng.runner, "run", spy_run)
    monkeypatch.setattr(eng, "_collect", spy_collect)
    return events


def test_first_token_is_read_before_a_new_shape_is_dispatched(stories_llm, monkeypatch):
    """Cold start (issue 21): a step whose shape is not compiled yet is dispatched only after the
    step in flight was read back, so the first token does not wait for the decode step's compile.
    Once the shapes are known, the next step is dispatched before the last is read (async)."""
    eng = stories_llm.engine
    ids = stories_llm.tokenizer.encode("Once upon a time")
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    monkeypatch.setattr(eng.runner, "compile_keys", set())  # as a fresh engine: nothing compiled
    events = _spy_order(eng, monkeypatch)
    eng.add_request("cold", ids, sp)
    first = eng.step()
    assert [o.request_id for o in first] == ["cold"] and len(first[0].token_ids) == 1
    # The prefill was dispatched and collected; the decode shape (new) was dispatched after.
    assert events == [("dispatch", 0, 1), ("collect",), ("dispatch", 1, 0)]
    while eng.has_unfinished():
        eng.step()
    # Later decode steps reuse the compiled shape: each is dispatched before the last is read.
    later = events[3:]
    assert later[:2] == [("dispatch", 1, 0), ("collect",)], events
    assert len([e for e in events if e[0] == "dispatch"]) == 5  # prefill + 4 decode steps


def test_collect_first_drops_rows_that_finished_meanwhile(stories_llm, monkeypatch):
    """A row that finishes on the collected token is not dispatched again: "a" stops on ","
    (llama2.c's greedy continuation of the prompt is ", there was ...", the shared reference)."""
    eng = stories_llm.engine
    ids = stories_llm.tokenizer.encode("Once upon a time")
    monkeypatch.setattr(eng.runner, "compile_keys", set())
    events = _spy_order(eng, monkeypatch)
    eng.add_request("a", ids, SamplingParams(temperature=0.0, max_tokens=10, stop=[","]))
    eng.add_request("b", ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert (outs["a"].finish_reason, outs["a"].text) == ("stop", "")
    assert outs["b"].text == ", there was"
    # Both prefilled in one step; "a" finished when it was read, so only "b" decodes after.
    assert events[:3] == [("dispatch", 0, 2), ("collect",), ("dispatch", 1, 0)], events
