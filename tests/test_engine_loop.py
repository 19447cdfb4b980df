"""``EngineLoop``'s public API, the one front door (``add(request, sink)``, ``abort``, ``step``),
on stories260K.

Judges from outside the code under test: llama2.c's greedy outputs
(``shared/models/stories260K/greedy_reference.json``) for every text, the engine's page pool for
what an abort frees, and call counts for "validated once".
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import stories_reference
from test_engine import reference_requests

from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.inputs import Request
from jaxinfer.errors import RequestError
from jaxinfer.sampling.params import SamplingParams


def _run(loop, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not loop.has_work():
            return
        loop.step()
    raise AssertionError("the loop did not finish")


def _assert_idle(llm) -> None:
    eng = llm.engine
    assert not eng.has_unfinished() and llm.engine_loop.num_requests == 0
    assert eng.kv_manager.num_free_pages == eng.ecfg.num_pages - 1  # page 0 is the null page


def test_add_and_step_route_each_output_to_its_sink(stories_llm):
    llm, loop = stories_llm, stories_llm.engine_loop
    refs = reference_requests(llm.tokenizer)[1:]  # the two 64-step cases
    sinks = [[] for _ in refs]
    for i, ((ids, sp, _), sink) in enumerate(zip(refs, sinks, strict=True)):
        loop.add(Request(f"route-{i}", {"prompt_token_ids": ids}, sp), sink.append)
    assert loop.num_requests == 2
    _run(loop)
    for i, ((ids, _, expected), sink) in enumerate(zip(refs, sinks, strict=True)):
        assert {o.request_id for o in sink} == {f"route-{i}"}
        assert [o.finished for o in sink] == [False] * (len(sink) - 1) + [True]
        final = sink[-1]
        assert final.error is None and llm.tokenizer.decode(ids + final.token_ids) == expected
        assert "".join(o.delta_text for o in sink) == final.text  # the deltas add up
    _assert_idle(llm)


def test_abort_frees_the_pages_and_the_id(stories_llm):
    llm, loop = stories_llm, stories_llm.engine_loop
    eng = llm.engine
    free = eng.kv_manager.num_free_pages
    sink = []
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    loop.add(Request("abort-me", "Once upon a time", long), sink.append)
    for _ in range(4):
        loop.step()
    assert sink and eng.kv_manager.num_free_pages < free
    seen = len(sink)
    loop.abort(["abort-me", "never-added"])  # unknown ids are ignored
    assert loop.num_requests == 0 and eng.kv_manager.num_free_pages == free  # every page at once
    loop.step()  # collects the step already dispatched (async scheduling), if any
    assert not eng.has_unfinished()
    assert len(sink) == seen and not any(o.finished for o in sink)  # nothing more comes
    # the id is free again: the same id runs to llama2.c's output
    ids, sp, expected = reference_requests(llm.tokenizer)[1]
    again = []
    loop.add(Request("abort-me", {"prompt_token_ids": ids}, sp), again.append)
    _run(loop)
    assert llm.tokenizer.decode(ids + again[-1].token_ids) == expected
    _assert_idle(llm)


def test_a_running_id_is_refused_and_nothing_is_queued(stories_llm):
    llm, loop = stories_llm, stories_llm.engine_loop
    eng = llm.engine
    ids, sp, expected = reference_requests(llm.tokenizer)[1]
    prompt = {"prompt_token_ids": ids}
    outs = []
    loop.add(Request("1_z", prompt, sp), outs.append)
    loop.add(Request("pair", prompt, dataclasses.replace(sp, n=2)), outs.append)
    assert sorted(eng._requests) == ["0_pair", "1_pair", "1_z"] and loop.num_requests == 2
    with pytest.raises(RequestError, match="duplicate request id '1_z': a request with this id"):
        loop.add(Request("1_z", prompt, sp), outs.append)
    with pytest.raises(RequestError, match="duplicate request id 'pair': a request with this id"):
        loop.add(Request("pair", prompt, sp), outs.append)
    with pytest.raises(RequestError, match="completion 1 of the running request 'pair'"):
        loop.add(Request("1_pair", prompt, sp), outs.append)
    with pytest.raises(RequestError, match="its completion id '1_z'"):  # nor half of one
        loop.add(Request("z", prompt, dataclasses.replace(sp, n=2)), outs.append)
    assert sorted(eng._requests) == ["0_pair", "1_pair", "1_z"] and loop.num_requests == 2
    _run(loop)
    finals = {o.request_id: o for o in outs if o.finished}
    assert sorted(finals) == ["1_z", "pair"] and len(outs) > 2
    for out in [finals["1_z"], *finals["pair"].outputs]:
        assert llm.tokenizer.decode(ids + out.token_ids) == expected
    _assert_idle(llm)


def test_n_fans_out_once_into_completions_each_the_reference(stories_llm, monkeypatch):
    llm, loop = stories_llm, stories_llm.engine_loop
    ids, sp, expected = reference_requests(llm.tokenizer)[2]
    calls = {"validate": 0, "add_request": 0}
    validate, add_request = EngineCore.validate, EngineCore.add_request

    def counting_validate(self, *a, **kw):
        calls["validate"] += 1
        return validate(self, *a, **kw)

    def counting_add(self, *a, **kw):
        calls["add_request"] += 1
        return add_request(self, *a, **kw)

    monkeypatch.setattr(EngineCore, "validate", counting_validate)
    monkeypatch.setattr(EngineCore, "add_request", counting_add)
    sink = []
    loop.add(Request("three", {"prompt_token_ids": ids}, dataclasses.replace(sp, n=3)), sink.append)
    assert calls == {"validate": 3, "add_request": 3}  # one check and one request a completion
    _run(loop)
    *streamed, final = sink
    assert final.finished and final.request_id == "three"
    assert [c.index for c in final.outputs] == [0, 1, 2]
    for c in final.outputs:
        assert llm.tokenizer.decode(ids + c.token_ids) == expected, c.index
        mine = [o for o in streamed if o.outputs[0].index == c.index]
        assert "".join(o.delta_text for o in mine) == c.text
    assert not any(o.finished for o in streamed)
    _assert_idle(llm)


def test_process_checks_a_request_once_and_add_trusts_it(stories_llm, monkeypatch):
    llm, loop = stories_llm, stories_llm.engine_loop
    too_long = SamplingParams(max_tokens=2)
    with pytest.raises(RequestError, match="max_model_len"):
        loop.process(Request("long", [1] * llm.engine.ecfg.max_model_len, too_long))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        loop.add(Request("oov", [1, llm.config.vocab_size], too_long), [].append)
    assert loop.num_requests == 0 and not llm.engine.has_unfinished()
    ids, sp, expected = reference_requests(llm.tokenizer)[1]
    case_prompt = stories_reference()[1]["prompt"]
    proc = loop.process(Request("text", case_prompt, sp))
    assert proc.prompt_ids == ids and proc.prompt_text == case_prompt and proc.n == 1
    validate = EngineCore.validate
    monkeypatch.setattr(EngineCore, "validate", lambda *a, **kw: pytest.fail("validated twice"))
    sink = []
    loop.add(proc, sink.append)
    monkeypatch.setattr(EngineCore, "validate", validate)
    _run(loop)
    assert llm.tokenizer.decode(ids + sink[-1].token_ids) == expected
    _assert_idle(llm)
