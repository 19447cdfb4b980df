"""`jaxinfer serve` (issue 19) through the real `openai` client and raw HTTP, on stories260K.

One in-process server per module (uvicorn in a thread, 127.0.0.1, a free port) on the session's
``stories_llm``. Judges: llama2.c's greedy outputs (``greedy_reference.json``), the same request
run alone through ``LLM.generate``, an independent jinja2 rendering of the chat template,
prometheus_client's own parser, and the engine's page pool. Every wait is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import jinja2
import numpy as np
import openai
import pytest
from conftest import stories_reference
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.sampling.params import SamplingParams

uvicorn = pytest.importorskip("uvicorn")

MODEL = "stories260K"
PROMPTS = [
    "Once upon a time",
    "Tom and his dog",
    "The sun was",
    "Lily had a red ball",
    "One day, a little bird",
    "Sam",
    "The cat sat on the",
    "Mia liked to paint",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class _Server:
    def __init__(self, url, state, llm, uv=None):
        self.url, self.state, self.llm, self.uv = url, state, llm, uv
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(stories_llm):
    from jaxinfer.server.app import create_app
    from jaxinfer.server.command import bind_socket

    app = create_app(stories_llm, model_name=MODEL)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield _Server(f"http://127.0.0.1:{port}", app.state.jaxinfer, stories_llm, srv)
    srv.should_exit = True
    th.join(30)
    assert not th.is_alive()


def _alone(llm, prompt, **sp):
    """The same request run alone through LLM.generate (the judge of every served output).
    Where logprobs are compared bitwise, a first run puts the prompt's full pages in the prefix
    cache, so the served request and the judge both read them from it (a cached prefix
    changes logprobs in the last bits, not tokens)."""
    return llm.generate([prompt], SamplingParams(**sp))[0]


def _wait_idle(server, timeout=10.0):
    eng = server.llm.engine
    deadline = time.monotonic() + timeout
    while eng.has_unfinished() or server.state.engine.outstanding:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.01)


# ------------------------------------------------------------------ llama2.c references


def test_greedy_completions_equal_llama2c_and_streams_add_up(server):
    tok = server.llm.tokenizer
    for k, case in enumerate(stories_reference()):
        ids = tok.encode(case["prompt"])
        kw = dict(
            model=MODEL,
            prompt=case["prompt"],
            temperature=0,
            max_tokens=case["max_steps"] - (len(ids) - 1),
            extra_body={"stop_token_ids": [1]},
        )  # run.c stops on BOS
        r = server.client.completions.create(echo=k % 2 == 1, **kw)
        (choice,) = r.choices
        text = choice.text if k % 2 else case["prompt"] + choice.text
        assert text == case["expected"], case["prompt"]
        assert r.usage.prompt_tokens == len(ids)
        streamed, reasons = [], []
        for chunk in server.client.completions.create(stream=True, **kw):
            streamed += [c.text for c in chunk.choices]
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert "".join(streamed) == text[len(case["prompt"]) :]
        assert reasons == [choice.finish_reason]


def test_sse_wire_format_done_and_usage(server):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 7,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    *text_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    assert all(c["usage"] is None for c in text_chunks)
    assert last["usage"]["prompt_tokens"] == 5 and last["usage"]["total_tokens"] == 12
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    ref = _alone(server.llm, "Once upon a time", temperature=0, max_tokens=7)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == ref.text
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tokens_without_text_still_stream_with_continuous_usage(server):
    """vLLM's streams: an output with new tokens is a chunk even when they add no text (here
    held back as a possible start of a stop string that never completes), and
    ``continuous_usage_stats`` puts the usage so far in every chunk (what bench_serve times
    tokens by)."""
    n = 12
    ref = _alone(server.llm, "Once upon a time", temperature=0, max_tokens=n)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": n,
        "temperature": 0,
        "stop": [ref.text + "#"],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    *steps, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n
    counts = [c["usage"]["completion_tokens"] for c in steps]
    assert counts == sorted(set(counts)) and counts[0] >= 1 and counts[-1] == n, counts
    assert all(c["usage"]["prompt_tokens"] == 5 for c in steps)
    texts = [c["choices"][0]["text"] for c in steps]
    assert "".join(texts) == ref.text and texts[-1] == ref.text  # held back to the end
    assert len(steps) >= 2 and not any(texts[:-1])  # ... yet every step before it streamed


# ------------------------------------------------------------------ as LLM.generate


def test_logprobs_seed_stop_and_n_as_llm_generate(server):
    llm, c = server.llm, server.client
    _alone(llm, "Tom and his dog", max_tokens=12, temperature=0.7, seed=11, logprobs=3)
    r = c.completions.create(
        model=MODEL, prompt="Tom and his dog", max_tokens=12, temperature=0.7, seed=11, logprobs=3
    )
    ref = _alone(llm, "Tom and his dog", max_tokens=12, temperature=0.7, seed=11, logprobs=3)
    (ch,) = r.choices
    assert ch.text == ref.text
    assert ch.logprobs.token_logprobs == [lp.logprob for lp in ref.logprobs]
    for top, lp in zip(ch.logprobs.top_logprobs, ref.logprobs, strict=True):
        assert sorted(top.values()) == sorted({v for _, v in lp.top} | {lp.logprob})
    assert "".join(ch.logprobs.tokens) == ch.text  # token strings add up to the text
    assert ch.logprobs.text_offset == list(
        np.cumsum([0] + [len(t) for t in ch.logprobs.tokens[:-1]])
    )
    # echo with logprobs: the prompt's logprobs first (None for its first token), as vLLM
    kw = dict(max_tokens=6, temperature=0, logprobs=2)
    r = c.completions.create(model=MODEL, prompt="Tom and his dog", echo=True, **kw)
    ref = _alone(llm, "Tom and his dog", prompt_logprobs=2, **kw)
    (ch,) = r.choices
    n_prompt = len(ref.prompt_token_ids)
    assert ch.text == "Tom and his dog" + ref.text
    assert ch.logprobs.token_logprobs == [None] + [lp.logprob for lp in ref.prompt_logprobs[1:]] + [
        lp.logprob for lp in ref.logprobs
    ]
    assert "".join(ch.logprobs.tokens) == ch.text and ch.logprobs.top_logprobs[0] is None
    assert ch.logprobs.text_offset[n_prompt] == len("Tom and his dog")
    streamed = list(
        c.completions.create(model=MODEL, prompt="Tom and his dog", echo=True, stream=True, **kw)
    )
    assert "".join(x.choices[0].text for x in streamed) == ch.text
    assert [
        v for x in streamed for v in x.choices[0].logprobs.token_logprobs
    ] == ch.logprobs.token_logprobs
    # vLLM's prompt_logprobs field: {token_id: {logprob, decoded_token}} per prompt token
    r = c.completions.create(
        model=MODEL,
        prompt="Tom and his dog",
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ref = _alone(llm, "Tom and his dog", max_tokens=2, temperature=0, prompt_logprobs=1)
    assert plp[0] is None and len(plp) == len(ref.prompt_token_ids)
    for got, lp in zip(plp[1:], ref.prompt_logprobs[1:], strict=True):
        assert got[str(lp.token_id)]["logprob"] == lp.logprob
        assert {int(t): v["logprob"] for t, v in got.items()} == {
            lp.token_id: lp.logprob,
            **dict(lp.top),
        }
    # stop strings, kept or cut, and the stop reason
    for include in (False, True):
        r = c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=40,
            temperature=0,
            stop=["girl", "park"],
            extra_body={"include_stop_str_in_output": include},
        )
        ref = _alone(
            llm,
            "Once upon a time",
            max_tokens=40,
            temperature=0,
            stop=["girl", "park"],
            include_stop_str_in_output=include,
        )
        assert r.choices[0].text == ref.text and ref.finish_reason == "stop"
        assert r.choices[0].text.endswith("girl") == include
        assert r.choices[0].finish_reason == "stop"
    # n: choice j is completion j of LLM.generate (seed + j), prompts in order
    # (n=2 over two prompts: 4 rows, the decode bucket of the references' 2 rows, no new shape)
    r = c.completions.create(
        model=MODEL, prompt=["The sun was", "Sam"], n=2, max_tokens=10, temperature=1.0, seed=5
    )
    assert [ch.index for ch in r.choices] == list(range(4))
    tokens = 0
    for i, p in enumerate(["The sun was", "Sam"]):
        ref = _alone(llm, p, n=2, max_tokens=10, temperature=1.0, seed=5)
        assert [ch.text for ch in r.choices[2 * i : 2 * i + 2]] == [o.text for o in ref.outputs]
        tokens += sum(len(o.token_ids) for o in ref.outputs)
    assert r.choices[0].text != r.choices[1].text  # seed + j: a prompt's choices differ
    assert r.usage.completion_tokens == tokens
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode("The sun was")) + len(
        llm.tokenizer.encode("Sam")
    )  # each prompt once, not n times


def test_streamed_echo_logprobs_and_usage_count_tokens_not_characters(server):
    """A stream with ``echo``: the generated tokens' ``text_offset`` continue after the echoed
    prompt (as the non-streamed answer's), and continuous usage counts generated tokens from
    the first (the prompt's characters once stood in for both)."""
    c = server.client
    kw = dict(model=MODEL, prompt="Tom and his dog", max_tokens=6, temperature=0, logprobs=1)
    whole = c.completions.create(echo=True, **kw).choices[0].logprobs
    chunks = list(
        c.completions.create(
            echo=True,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **kw,
        )
    )
    offsets = [o for x in chunks if x.choices for o in x.choices[0].logprobs.text_offset]
    assert offsets == whole.text_offset
    counts = [x.usage.completion_tokens for x in chunks if x.choices]
    # the echo first (no token yet), then the tokens so far (a backlog is merged: gaps allowed)
    assert counts[0] == 0 and counts[1:] == sorted(set(counts[1:])) and counts[-1] == 6, counts


def test_a_request_is_encoded_and_validated_once(server, monkeypatch):
    """Two prompts with n = 2: each prompt encoded once, each of the 4 completions validated
    once (``EngineLoop.process``), nothing checked again on the way to the engine."""
    from jaxinfer.engine.core import EngineCore

    calls = {"encode": 0, "validate": 0}
    tok = server.llm.tokenizer
    encode, validate = tok.encode, EngineCore.validate

    def counting_encode(*a, **kw):
        calls["encode"] += 1
        return encode(*a, **kw)

    def counting_validate(self, *a, **kw):
        calls["validate"] += 1
        return validate(self, *a, **kw)

    monkeypatch.setattr(tok, "encode", counting_encode)
    monkeypatch.setattr(EngineCore, "validate", counting_validate)
    r = server.client.completions.create(
        model=MODEL, prompt=["The sun was", "Sam"], n=2, max_tokens=3, temperature=0
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert calls == {"encode": 2, "validate": 4}


def test_chat_renders_the_template(server, monkeypatch):
    llm = server.llm
    monkeypatch.setattr(llm.tokenizer, "chat_template", TEMPLATE)
    msgs = [
        {"role": "system", "content": "Tell a story."},
        {"role": "user", "content": "Once upon a time"},
    ]
    rendered = jinja2.Template(TEMPLATE).render(
        messages=msgs, bos_token="<s>", add_generation_prompt=True
    )
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1 and 1 not in ids[1:]  # {{ bos_token }} is BOS, once
    tk = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    assert tk["tokens"] == ids and tk["count"] == len(ids)
    _alone(llm, {"prompt_token_ids": ids}, max_tokens=16, temperature=0, logprobs=2)
    r = server.client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2
    )
    ref = _alone(llm, {"prompt_token_ids": ids}, max_tokens=16, temperature=0, logprobs=2)
    (ch,) = r.choices
    assert ch.message.role == "assistant" and ch.message.content == ref.text
    assert r.usage.prompt_tokens == len(ids)
    assert [e.logprob for e in ch.logprobs.content] == [lp.logprob for lp in ref.logprobs]
    assert all(len(e.top_logprobs) == 2 for e in ch.logprobs.content)
    assert all(bytes(e.bytes) == e.token.encode() for e in ch.logprobs.content)
    # max_completion_tokens wins over max_tokens; streamed deltas add up, role first
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


# ------------------------------------------------------------------ many clients


def _mixed(i: int) -> dict:
    """Request i of the concurrent test: greedy, seeded top-p, top-k with a stop string,
    min-p, n=2; max_tokens 5..20. (No penalties: their step variants would cost compilations,
    and the engine's own tests cover them in batches.)"""
    kw = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 5 + (i * 7) % 16}
    kind = i % 5
    if kind == 0:
        kw.update(temperature=0)
    elif kind == 1:
        kw.update(temperature=0.9, top_p=0.9, seed=i)
    elif kind == 2:
        kw.update(temperature=1.0, top_k=20, seed=i, stop=[","])
    elif kind == 3:
        kw.update(temperature=0.8, seed=i, min_p=0.05)
    else:
        kw.update(temperature=1.0, seed=i, n=2)
    return kw


_EXTRA = ("top_k", "min_p")  # vLLM's fields: sent in the body by the openai client's extra_body


async def _stream_one(client, kw) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice of one streamed request."""
    body = {"model": MODEL, **{k: v for k, v in kw.items() if k not in _EXTRA}}
    extra = {k: kw[k] for k in _EXTRA if k in kw}
    texts, reasons = {}, {}
    stream = await client.completions.create(stream=True, extra_body=extra, **body)
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return [(texts.get(j, ""), reasons.get(j)) for j in range(kw.get("n", 1))]


BAD = [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"prompt": "Once " * 600}, 400, "prompt"),
]


def test_64_concurrent_streams_equal_requests_alone_and_bad_ones_get_their_errors(server):
    llm = server.llm
    goods = [_mixed(i) for i in range(64)]
    bads = [{**_mixed(i), **b} for i, (b, _, _) in enumerate(BAD * 2)]

    async def main():
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        async with client:
            tasks = [_stream_one(client, kw) for kw in goods + bads]
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 240)

    steps = llm.engine.num_steps
    results = asyncio.run(main())
    assert llm.engine.num_steps > steps
    for res, (_, status, param) in zip(results[64:], BAD * 2, strict=True):
        assert isinstance(res, openai.APIStatusError), res
        assert res.status_code == status and res.body["param"] == param, res.body
    _wait_idle(server)
    # nothing of the 64 + bad requests is left behind (a leak would grow over a soak)
    assert not llm.engine._requests and not llm._loop._routes
    assert not server.state.engine._mine and not server.state.engine._dirty
    for kw, res in zip(goods, results[:64], strict=True):
        assert not isinstance(res, BaseException), (kw, res)
        sp = {k: v for k, v in kw.items() if k != "prompt"}
        ref = _alone(llm, kw["prompt"], **sp)
        assert res == [(o.text, o.finish_reason) for o in ref.outputs], kw


def test_client_killed_mid_stream_frees_its_pages_within_a_step(server, monkeypatch):
    eng = server.llm.engine
    _wait_idle(server)
    free = eng.kv_manager.num_free_pages
    aborted_at = []  # engine steps when the server aborted the request
    real_abort = server.state.engine.abort

    def abort(ids):
        aborted_at.append(eng.num_steps)
        real_abort(ids)

    applied = []  # (engine steps, free pages) when the engine thread applied the abort
    real_apply = server.state.engine._apply_aborts

    def apply(ids):
        real_apply(ids)
        if ids:
            applied.append((eng.num_steps, eng.kv_manager.num_free_pages))

    monkeypatch.setattr(server.state.engine, "abort", abort)
    monkeypatch.setattr(server.state.engine, "_apply_aborts", apply)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens: the request runs
            assert eng.kv_manager.num_free_pages < free
            steps = eng.num_steps
    # the response and its connection are closed: the request is aborted at the next step
    deadline = time.monotonic() + 10
    while eng.kv_manager.num_free_pages != free or eng.has_unfinished():
        assert time.monotonic() < deadline, "pages not freed"
        time.sleep(0.005)
    assert len(aborted_at) == 1 and len(applied) == 1 and got
    # applied before the next step (the one running when the client went away may finish),
    # every page back at once; after it, only the step already dispatched (async scheduling)
    assert applied[0][0] - aborted_at[0] <= 1 and applied[0][1] == free
    assert eng.num_steps - applied[0][0] <= 1
    assert eng.num_steps - steps < 100  # nowhere near the 400 tokens asked for
    assert server.state.engine.outstanding == 0


def test_a_stream_that_falls_behind_gets_its_backlog_merged(server):
    """While the event loop is blocked the engine runs on; the tokens made meanwhile come as one
    chunk of their joined text (not one chunk each), and the text still equals the request
    run alone."""
    eng = server.llm.engine
    loop = server.uv.servers[0].get_loop()
    _wait_idle(server)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }

    def block_until_steps(n, timeout=20.0):  # runs on the event loop: it blocks it
        deadline = time.monotonic() + timeout
        while eng.num_steps < n and eng.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.002)

    texts = []
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = (x for x in r.iter_lines() if x.startswith("data: {"))
            texts.append(json.loads(next(lines)[6:])["choices"][0]["text"])
            loop.call_soon_threadsafe(block_until_steps, eng.num_steps + 20)
            texts += [json.loads(x[6:])["choices"][0]["text"] for x in lines]
    ref = _alone(server.llm, "Once upon a time", max_tokens=60, temperature=0, ignore_eos=True)
    assert "".join(texts) == ref.text
    # 60 tokens; >= 19 of them made while the loop was blocked arrive in one chunk
    assert len(texts) <= 60 - 18, len(texts)
    assert max(len(t) for t in texts) > 10


def test_queue_limit_answers_503(server, monkeypatch):
    from jaxinfer.server.engine_thread import AsyncEngine

    llm = server.llm
    assert AsyncEngine(llm, max_queue=3).capacity == llm.engine.ecfg.max_num_seqs + 3
    monkeypatch.setattr(server.state.engine, "capacity", 2)
    body = {"model": MODEL, "prompt": "Sam", "max_tokens": 4, "temperature": 0}
    got = []
    with llm._loop._lock:  # the engine thread cannot take requests: they stay queued
        threads = [
            threading.Thread(
                target=lambda: got.append(
                    httpx.post(server.url + "/v1/completions", json=body, timeout=60)
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while server.state.engine.outstanding < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        over = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert over.status_code == 503, over.text
    assert over.json()["error"]["type"] == "ServiceUnavailableError"
    for t in threads:
        t.join(60)
    assert [r.status_code for r in got] == [200, 200]
    _wait_idle(server)


# ------------------------------------------------------------------ errors


def _post(server, path, body, raw=False):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if raw
        else {"json": body}
    )
    return httpx.post(server.url + path, timeout=30, **kw)


ERRORS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": "x", "foo": 1}, 400, "foo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [512]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 600]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Once " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
        400,
        "messages",
    ),  # stories260K's tokenizer has no chat template
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
    ),
    ("/detokenize", {"tokens": [1, 9999]}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
]


def test_bad_requests_are_openai_errors_and_never_reach_the_engine(server):
    _wait_idle(server)
    steps = server.llm.engine.num_steps
    for path, body, status, param in ERRORS:
        r = _post(server, path, body, raw=isinstance(body, bytes))
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["code"] == status, (body, err)
        assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        if param is not None:
            assert param in err["message"] or status == 404, err
    assert server.llm.engine.num_steps == steps  # nothing was run
    assert server.state.engine.outstanding == 0


def test_an_engine_failure_is_a_500_for_that_request_alone(server, monkeypatch):
    import jax

    llm = server.llm
    eng = llm.engine
    marker = 5  # prompts with this token fail on the (simulated) device
    real = eng.runner.run

    def faulty(inputs, prev=None):
        if marker in np.asarray(inputs.batch.tokens):
            for leaf in jax.tree_util.tree_leaves(eng.runner.kv):
                leaf.delete()
            raise RuntimeError("INTERNAL: simulated device fault")
        return real(inputs, prev)

    monkeypatch.setattr(eng.runner, "run", faulty)
    ok = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.wait_for(
                asyncio.gather(
                    c.post("/v1/completions", json=ok),
                    c.post("/v1/completions", json={**ok, "prompt": [1, 400, marker, 401]}),
                    c.post("/v1/completions", json={**ok, "prompt": "Sam"}),
                ),
                120,
            )

    good, bad, good2 = asyncio.run(main())
    assert bad.status_code == 500, bad.text
    assert "simulated device fault" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "InternalServerError"
    monkeypatch.setattr(eng.runner, "run", real)
    assert (
        good.json()["choices"][0]["text"]
        == _alone(llm, "Once upon a time", max_tokens=12, temperature=0).text
    )
    assert (
        good2.json()["choices"][0]["text"] == _alone(llm, "Sam", max_tokens=12, temperature=0).text
    )
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------ metrics, models, tokenize


def _scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(
                f",{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le")
            )
            if "le" in s.labels:
                continue
            out[key] = s.value
    return out


def test_metrics_parse_and_count_the_work_done(server):
    _wait_idle(server)
    before = _scrape(server)
    rs = [
        server.client.completions.create(model=MODEL, prompt=p, max_tokens=6 + i, temperature=0)
        for i, p in enumerate(PROMPTS[:3])
    ]
    rs.append(
        server.client.completions.create(
            model=MODEL, prompt="Sam", max_tokens=30, temperature=0, stop=[" the"]
        )
    )
    _wait_idle(server)
    after = _scrape(server)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("jaxinfer:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    assert delta("jaxinfer:generation_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    reasons = [r.choices[0].finish_reason for r in rs]
    for reason in set(reasons):
        assert delta(f"jaxinfer:request_success_total,finished_reason={reason}") == reasons.count(
            reason
        )
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "time_per_output_token_seconds",
    ):
        assert delta(f"jaxinfer:{h}_count") == len(rs), h
        assert delta(f"jaxinfer:{h}_sum") > 0
    assert after["jaxinfer:num_requests_running"] == 0
    assert after["jaxinfer:num_requests_waiting"] == 0
    eng = server.llm.engine
    kv = eng.kv_manager
    assert after["jaxinfer:num_kv_pages_total"] == kv.num_pages - 1
    assert after["jaxinfer:num_kv_pages_used"] == kv.num_pages - 1 - kv.num_free_pages
    assert 0 <= after["jaxinfer:prefix_cache_hit_rate"] <= 1
    assert after["jaxinfer:num_compilations"] == len(eng.compile_keys) >= 2


def test_models_health_tokenize_detokenize(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    tok = server.llm.tokenizer
    r = _post(server, "/tokenize", {"prompt": "Once upon a time"}).json()
    assert r["tokens"] == [1, 403, 407, 261, 378]  # the model card's SentencePiece ids
    assert r["max_model_len"] == server.llm.engine.ecfg.max_model_len
    r = _post(server, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})
    assert r.json()["tokens"] == [403, 407, 261, 378]
    r = _post(server, "/detokenize", {"tokens": [403, 407, 261, 378]}).json()
    assert r["prompt"] == tok.decode([403, 407, 261, 378]) == "Once upon a time"


def test_more_sequences_than_the_server_ever_takes_is_400_not_503(server, monkeypatch):
    """A request that could never fit under --max-queue is the client's error (a 503 would be
    retried for nothing), naming ``n``; found by a new-user check."""
    monkeypatch.setattr(server.state.engine, "capacity", 5)
    body = {"model": MODEL, "prompt": "Sam", "max_tokens": 2, "temperature": 0, "n": 6}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "6 sequences" in err["message"], err
    body["n"] = 5  # fits: served
    assert _post(server, "/v1/completions", body).status_code == 200


def test_lone_surrogate_prompt_is_a_clear_400(server):
    raw = '{"model": "' + MODEL + '", "prompt": "a\\ud800b", "max_tokens": 2}'
    r = _post(server, "/v1/completions", raw, raw=True)
    assert r.status_code == 400, r.text
    assert "lone surrogate \\ud800" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt"
