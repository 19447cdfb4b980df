"""Issue 15, classes 1 and 7: values the device cannot represent are refused before admission; a
step that fails anyway fails only the request that caused it and the engine lives on; one LLM is
safe to use from several threads and interleaved streams.

The judges are llama2.c's own greedy outputs (``greedy_reference.json``) and numpy's float32."""

import dataclasses
import threading

import numpy as np
import pytest
from test_engine import reference_requests

from jaxinfer.errors import RequestError
from jaxinfer.sampling.sampler import SamplingParams

# ------------------------------------------------------------------ what the device can represent


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 1e-46),
        ("repetition_penalty", 1e-300),
        ("min_p", 1e-300),
        ("presence_penalty", 1e-300),
        ("frequency_penalty", -1e-45),
        ("temperature", 1e300),
        ("repetition_penalty", 1e39),
    ],
)
def test_float_fields_outside_float32_are_refused(field, value):
    with np.errstate(over="ignore"):
        f32 = np.float64(value).astype(np.float32)
    # The premise, from numpy: on device the value would be 0, a flushed denormal, or inf.
    assert f32 == 0 or np.isinf(f32) or abs(f32) < np.finfo(np.float32).tiny
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_float32_boundaries_and_int32_top_k():
    tiny = float(np.finfo(np.float32).tiny)
    SamplingParams(top_p=tiny, min_p=tiny, repetition_penalty=tiny)  # representable: accepted
    SamplingParams(temperature=1e-300)  # below SAMPLING_EPS: greedy, not a device value
    SamplingParams(top_k=np.iinfo(np.int32).max)
    with pytest.raises(RequestError, match="top_k"):
        SamplingParams(top_k=2**31)


# ------------------------------------------------------------------ references


def _reference_requests(tokenizer):
    return reference_requests(tokenizer)


def _assert_references(llm, outs, refs):
    for (ids, _, expected), out in zip(refs, outs, strict=True):
        assert out.error is None, out.error
        assert llm.tokenizer.decode(ids + out.token_ids) == expected


def _assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_pages == engine.ecfg.num_pages - 1  # page 0 is the null page
    assert not engine._requests


def test_out_of_vocabulary_stop_token_ids_fail_alone(stories_llm):
    llm = stories_llm
    refs = _reference_requests(llm.tokenizer)
    v = llm.config.vocab_size
    bad = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[v])
    outs = llm.generate([ids for ids, _, _ in refs] + ["Once"], [sp for _, sp, _ in refs] + [bad])
    _assert_references(llm, outs[:-1], refs)
    assert outs[-1].finish_reason == "error" and "stop_token_ids" in outs[-1].error
    SamplingParams(stop_token_ids=[v - 1])  # the last id is in the vocabulary
    last = dataclasses.replace(bad, stop_token_ids=(v - 1,))
    assert llm.generate(["Once"], last)[0].error is None


def _unvalidated(**fields) -> SamplingParams:
    """Params that slipped past validation (a bug elsewhere, or a future field)."""
    sp = SamplingParams(max_tokens=6, seed=3)
    for k, v in fields.items():
        object.__setattr__(sp, k, v)
    return sp


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failing_step_fails_only_its_request(stories_llm, async_scheduling):
    llm = stories_llm
    eng = llm.engine
    saved = eng.async_scheduling
    eng.async_scheduling = async_scheduling
    try:
        refs = _reference_requests(llm.tokenizer)
        prompts = [ids for ids, _, _ in refs]
        params = [sp for _, sp, _ in refs]
        bad = _unvalidated(top_k=2**31)  # breaks the int32 sampling tensors
        failures = eng.num_step_failures
        outs = llm.generate(prompts[:1] + ["Tom"] + prompts[1:], params[:1] + [bad] + params[1:])
        assert outs[1].finish_reason == "error" and "step failed" in outs[1].error
        assert "OverflowError" in outs[1].error
        _assert_references(llm, outs[:1] + outs[2:], refs)
        assert eng.num_step_failures > failures
        _assert_idle(eng)
        # The engine lives on: the references again, alone and together.
        _assert_references(llm, llm.generate(prompts, params), refs)
        _assert_references(llm, llm.generate(prompts[:1], params[0]), refs[:1])
    finally:
        eng.async_scheduling = saved


def test_a_device_failure_that_consumed_the_pool_is_recovered(stories_llm, monkeypatch):
    """The failed call had the (donated) KV pool: it is rebuilt and every sequence recomputed."""
    llm = stories_llm
    eng = llm.engine
    refs = _reference_requests(llm.tokenizer)
    marker = 5  # a token id that triggers the simulated device fault
    prompts = [ids for ids, _, _ in refs]
    assert all(marker not in ids for ids in prompts)
    real = eng.runner.run
    calls = {"faults": 0}

    def faulty(inputs, prev=None):
        if marker in np.asarray(inputs.batch.tokens):
            for leaf in __import__("jax").tree_util.tree_leaves(eng.runner.kv):
                leaf.delete()  # what a failed donated call leaves behind
            calls["faults"] += 1
            raise RuntimeError("INTERNAL: simulated device fault")
        return real(inputs, prev)

    monkeypatch.setattr(eng.runner, "run", faulty)
    bad_prompt = [1, 400, marker, 401]
    outs = llm.generate(prompts + [bad_prompt], [sp for _, sp, _ in refs] + [refs[0][1]])
    _assert_references(llm, outs[:-1], refs)
    assert outs[-1].finish_reason == "error" and "simulated device fault" in outs[-1].error
    assert calls["faults"] == 2  # in the batch, then alone
    _assert_idle(eng)
    monkeypatch.setattr(eng.runner, "run", real)
    _assert_references(llm, llm.generate(prompts, [sp for _, sp, _ in refs]), refs)


# ------------------------------------------------------------------ one LLM, several callers


def test_threads_share_one_llm(stories_llm):
    llm = stories_llm
    refs = _reference_requests(llm.tokenizer)
    prompts, params = [ids for ids, _, _ in refs], [sp for _, sp, _ in refs]
    results, errors = [], []

    def work():
        try:
            for _ in range(2):
                results.append(llm.generate(prompts, params))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == 6
    for outs in results:
        _assert_references(llm, outs, refs)
    _assert_idle(llm.engine)


def test_interleaved_streams_and_an_abandoned_one(stories_llm):
    llm = stories_llm
    refs = _reference_requests(llm.tokenizer)
    (ids0, sp0, _), (ids1, sp1, _) = refs[0], refs[1]
    s0 = llm.generate_stream([ids0], sp0)
    s1 = llm.generate_stream([ids1], sp1)
    s2 = llm.generate_stream(["Once upon a time"], SamplingParams(max_tokens=None, ignore_eos=True))
    next(s2)
    s2.close()  # the consumer goes away: its request is aborted, its pages freed
    outs0, outs1 = [], []
    for a, b in zip(s0, s1):  # noqa: B905 - one output of each in turn, then the rest
        outs0.append(a)
        outs1.append(b)
    outs0 += list(s0)
    outs1 += list(s1)
    assert all(o.request_id == outs0[0].request_id for o in outs0)
    _assert_references(llm, [outs0[-1], outs1[-1]], refs[:2])
    _assert_idle(llm.engine)
