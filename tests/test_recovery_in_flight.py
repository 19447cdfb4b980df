"""Step-failure recovery while a step is in flight (async scheduling): the dropped step's sampled
tokens are dropped with it (their placeholders too), every request is recomputed, and the outputs
are still llama2.c's greedy references (``shared/models/stories260K/greedy_reference.json``)."""

from __future__ import annotations

from test_step_recovery import _assert_idle, _reference_requests, _unvalidated


def test_failure_with_a_step_in_flight_recomputes_without_its_tokens(stories_llm):
    llm = stories_llm
    eng = llm.engine
    assert eng.async_scheduling
    refs = _reference_requests(llm.tokenizer)
    refs = refs[1:]  # the two 64-step cases (the first runs 200 steps)
    for i, (ids, sp, _) in enumerate(refs):
        eng.add_request(f"ref{i}", ids, sp)
    outs = {}
    for o in eng.step():  # the prefill step is collected while the first decode step runs
        outs[o.request_id] = o
    assert eng._inflight is not None and any(s.pending for s, _ in eng._inflight.sampled)
    failures = eng.num_step_failures
    # top_k 2**31 breaks the int32 sampling tensors: the next dispatch fails with a step in flight
    eng.add_request("bad", [1, 400, 401], _unvalidated(top_k=2**31))
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert eng.num_step_failures > failures
    assert outs["bad"].finish_reason == "error" and "OverflowError" in outs["bad"].error
    for i, (ids, _, expected) in enumerate(refs):
        out = outs[f"ref{i}"]
        assert out.finished and out.error is None, out.error
        assert llm.tokenizer.decode(ids + out.token_ids) == expected
    _assert_idle(eng)
