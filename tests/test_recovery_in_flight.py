"""Step-failure recovery while a step is in flight (async scheduling): the dropped step's sampled
tokens are dropped with it (their placeholders too), every request is recomputed, and the outputs
are still llama2.c's greedy references (``shared/models/stories260K/greedy_reference.json``)."""

from __future__ import annotations

from test_step_recovery import _assert_idle, _reference_requests, _unvalidated


def _run_with_a_late_request(eng, refs, late_params) -> dict:
    """The reference requests, then, after their prefill step (collected while the first decode
    step is in flight), a late 3-token request with ``late_params``; returns the final outputs."""
    for i, (ids, sp, _) in enumerate(refs):
        eng.add_request(f"ref{i}", ids, sp)
    outs = {}
    for o in eng.step():
        outs[o.request_id] = o
    assert eng._inflight is not None and any(s.pending for s, _ in eng._inflight.sampled)
    eng.add_request("late", [1, 400, 401], late_params)
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def test_failure_with_a_step_in_flight_recomputes_without_its_tokens(stories_llm):
    llm = stories_llm
    eng = llm.engine
    assert eng.async_scheduling
    refs = _reference_requests(llm.tokenizer)
    refs = refs[1:]  # the two 64-step cases (the first runs 200 steps)
    # First with a valid late request: the step shapes compile, so in the run below the late
    # request's step is dispatched while the previous one is in flight (a step of a new shape
    # waits for the one in flight to be read back first).
    _run_with_a_late_request(eng, refs, _unvalidated())
    failures = eng.num_step_failures
    # top_k 2**31 breaks the int32 sampling tensors: the next dispatch fails with a step in flight
    outs = _run_with_a_late_request(eng, refs, _unvalidated(top_k=2**31))
    assert eng.num_step_failures > failures
    assert outs["late"].finish_reason == "error" and "OverflowError" in outs["late"].error
    for i, (ids, _, expected) in enumerate(refs):
        out = outs[f"ref{i}"]
        assert out.finished and out.error is None, out.error
        assert llm.tokenizer.decode(ids + out.token_ids) == expected
    _assert_idle(eng)
