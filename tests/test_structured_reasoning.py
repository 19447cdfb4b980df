"""Structured outputs after a reasoning (issue 31: "the constraint applies after it"):
``StructuredOutputsParams.start_after`` leaves the output free until it ends with the marker's
ids, then the grammar starts. On stories260K, with " there was" (two tokens it writes often) as
the marker: before it the tokens are those of the same seeded run without any constraint (no
mask at all: the sampler's Gumbel draws are the same, and an allowed pick stays the pick), after
it the text is judged by ``re`` and ``jsonschema``; a marker in the prompt starts nothing. The
server gets the marker from its reasoning parser (here one whose end marker is " was", a single
token of stories260K): ``reasoning_content`` comes apart and ``content`` validates.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from json_text import whitespace_outside_strings

from jaxinfer import SamplingParams, StructuredOutputsParams
from jaxinfer.errors import RequestError

PROMPT = "Once upon a time"
MARKER_TEXT = " there was"
REGEX = r"[0-9]{2,4}( [a-z]{1,5})?"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def marker(stories_llm) -> tuple[int, ...]:
    ids = tuple(stories_llm.tokenizer.encode("Once upon a time," + MARKER_TEXT)[-2:])
    assert stories_llm.tokenizer.grammar_vocabulary().token_bytes[ids[1]] == b" was"
    return ids


def _end_of(ids: list[int], marker: tuple[int, ...]) -> int | None:
    """The index just past the first occurrence of ``marker`` in ``ids`` (None: absent)."""
    n = len(marker)
    return next((i + n for i in range(len(ids) - n + 1) if tuple(ids[i : i + n]) == marker), None)


def _so(kind: str, **kw) -> StructuredOutputsParams:
    if kind == "regex":
        return StructuredOutputsParams(regex=REGEX, **kw)
    return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, **kw)


def _judge(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert whitespace_outside_strings(text) == [], text
        jsonschema.validate(json.loads(text), SCHEMA)


def _free_then_grammar(llm, prompt: str, marker, seeds, **so_kw) -> int:
    """Runs each seed free and constrained (start_after=marker); checks the constrained output
    is the free one up to the marker's end, then the grammar's; returns how many met it."""
    kinds = ["regex", "json"]
    free = llm.generate(
        [prompt] * len(seeds),
        [SamplingParams(temperature=1.0, seed=s, max_tokens=48) for s in seeds],
    )
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=48,
            structured_outputs=_so(kinds[s % 2], start_after=marker, **so_kw),
        )
        for s in seeds
    ]
    got = llm.generate([prompt] * len(seeds), params)
    started = 0
    for s, f, c in zip(seeds, free, got, strict=True):
        assert c.error is None, c.error
        e = _end_of(f.token_ids, marker)
        if e is None:  # never started: the free output itself
            assert c.token_ids == f.token_ids
            continue
        started += 1
        assert c.token_ids[:e] == f.token_ids[:e], s
        assert c.finish_reason == "stop", c.text
        end = c.text.index(MARKER_TEXT) + len(MARKER_TEXT)  # the text the reader splits at
        assert c.text[:end] == f.text[:end]
        _judge(kinds[s % 2], c.text[end:])
    return started


def test_free_until_the_marker_then_the_grammar(stories_llm, marker):
    assert _free_then_grammar(stories_llm, PROMPT, marker, range(6)) >= 4


def test_the_marker_in_the_prompt_starts_nothing(stories_llm, marker):
    prompt = "Once upon a time," + MARKER_TEXT
    assert tuple(stories_llm.tokenizer.encode(prompt)[-2:]) == marker
    _free_then_grammar(stories_llm, prompt, marker, range(4))


def test_reasoning_start_decides_at_the_first_token(stories_llm, marker):
    """``reasoning_start`` (Qwen3's optional ``<think>``): a first token that is it leaves the
    output free up to the marker; any other first token is the grammar's."""
    comma = stories_llm.tokenizer.encode("Once upon a time,")[-1]
    # the free first token of these seeds is ",": allowed by the first mask, it is still the
    # pick, and the output reasons up to the marker
    assert _free_then_grammar(stories_llm, PROMPT, marker, [0, 3, 4], reasoning_start=comma) == 3
    # an opener the model rarely picks (a byte-fallback token): where the first token is
    # another, the grammar holds from it on; where it is the opener, the output is free
    rare, seeds = 5, range(6)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=48,
            structured_outputs=_so("regex", start_after=marker, reasoning_start=rare),
        )
        for s in seeds
    ]
    outs = stories_llm.generate([PROMPT] * len(params), params)
    for o in outs:
        if o.token_ids[0] != rare:
            assert o.finish_reason == "stop", o.text
            _judge("regex", o.text)
    assert sum(o.token_ids[0] != rare for o in outs) >= 4


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(start_after=(512,)), "structured_outputs.start_after"),
        (dict(start_after=(1, 2), reasoning_start=10**6), "structured_outputs.reasoning_start"),
    ],
)
def test_ids_outside_the_vocabulary_are_refused(stories_llm, fields, field):
    bad = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a", **fields)
    )
    with pytest.raises(RequestError, match=re.escape(field) + ".*outside the model's vocabulary"):
        stories_llm.engine.validate([1, 2], bad)
    out = stories_llm.generate([PROMPT, PROMPT], [bad, SamplingParams(max_tokens=3)])
    assert field in out[0].error and out[1].error is None and len(out[1].token_ids) == 3


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(start_after=[]), "non-empty list of token ids"),
        (dict(start_after=[-1]), "non-empty list of token ids"),
        (dict(start_after="</think>"), "list of token ids"),
        (dict(start_after=[True]), "non-empty list of token ids"),
        (dict(reasoning_start=3), "goes with start_after"),
        (dict(start_after=[3], reasoning_start="x"), "reasoning_start must be a token id"),
    ],
)
def test_bad_marker_fields(fields, words):
    with pytest.raises(RequestError, match=words):
        StructuredOutputsParams(regex="a", **fields)


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def client(stories_llm):
    from fastapi.testclient import TestClient

    from jaxinfer.server.app import create_app
    from jaxinfer.server.constraints import ToolOptions
    from jaxinfer.server.reasoning_parsers import ReasoningParser

    tok = stories_llm.tokenizer
    old = tok.chat_template
    tok.chat_template = CHAT_TEMPLATE
    r1 = ReasoningParser("r1_test", start_required=False, end=" was")  # deepseek_r1's rule
    app = create_app(stories_llm, model_name="m", tools=ToolOptions(reasoning=r1))
    try:
        with TestClient(app) as c:
            yield c
    finally:
        tok.chat_template = old


def _chat(client, **body):
    r = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": PROMPT}], **body},
    )
    return r


def test_server_reasoning_content_then_valid_content(client):
    """Each choice's reasoning is that of the same request without a constraint (the tokens
    before the marker are free), and its content, after the marker, is compact valid JSON; a
    choice whose reasoning never ends has no content (as without a constraint)."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    kw = dict(temperature=1.0, seed=0, n=4, max_tokens=100)
    free = _chat(client, **kw).json()["choices"]
    body = dict(response_format=rf, structured_outputs={"disable_any_whitespace": True}, **kw)
    r = _chat(client, **body)
    assert r.status_code == 200, r.text
    started = 0
    for f, c in zip(free, r.json()["choices"], strict=True):
        assert c["message"]["reasoning_content"] == f["message"]["reasoning_content"], (c, f)
        if f["message"]["content"] is None:  # no marker: all reasoning, cut off
            assert c["message"] == f["message"] and c["finish_reason"] == "length"
            continue
        started += 1
        assert c["finish_reason"] == "stop", c
        _judge("json", c["message"]["content"])
    assert started >= 2
    # streamed: the deltas add up to the same message
    lines = _chat(client, stream=True, **{**body, "n": 1}).text.splitlines()
    deltas = [json.loads(ln[6:])["choices"] for ln in lines if ln.startswith("data: {")]
    got = {"reasoning_content": "", "content": ""}
    for ch in deltas:
        for k in got:
            got[k] += (ch[0]["delta"] if ch else {}).get(k) or ""
    first = r.json()["choices"][0]["message"]
    assert got == {k: first[k] or "" for k in got}


def test_server_refusals(client, monkeypatch):
    # a marker id outside the vocabulary, from the client: 400 naming the field
    so = {"regex": "[0-9]", "start_after": [100000]}
    r = _chat(client, max_tokens=4, structured_outputs=so)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "start_after" in r.json()["error"]["message"]
    # a parser whose markers are not single tokens of the model ("</think>" is several here)
    from jaxinfer.server.constraints import ToolOptions
    from jaxinfer.server.reasoning_parsers import get_reasoning_parser

    state = client.app.state.jaxinfer
    for name in ("deepseek_r1", "qwen3"):
        monkeypatch.setattr(state, "tools", ToolOptions(reasoning=get_reasoning_parser(name)))
        r = _chat(client, max_tokens=4, response_format={"type": "json_object"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert "has no such single token" in r.json()["error"]["message"]
    monkeypatch.undo()
    r = _chat(client, max_tokens=3, temperature=0)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_partial_file_fingerprints_keep_their_old_value():
    """A partial file written before start_after existed still resumes: its fingerprint (taken
    at commit 32c6813, before these fields) is unchanged; setting start_after changes it."""
    from jaxinfer.cli import partial

    sp = SamplingParams(structured_outputs={"regex": "a+"})
    old = "30ed6def11b0b9faf09bd253f73ead1fd2f219cbfcb743f24c86120fd7505fd3"
    assert partial.fingerprint([1, 2], sp) == old
    marked = SamplingParams(structured_outputs={"regex": "a+", "start_after": [3]})
    assert partial.fingerprint([1, 2], marked) != old


def test_markers_of_a_tokenizer_json_with_think_tokens(tmp_path):
    """A byte-level BPE tokenizer.json with Qwen3's ``<think>`` / ``</think>`` added (not
    special) tokens: the server's marker ids are those the ``tokenizers`` library gives them,
    and qwen3's optional reasoning adds ``reasoning_start``; text of several tokens is none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxinfer.server.constraints import marker_id, reasoning_fields
    from jaxinfer.server.reasoning_parsers import get_reasoning_parser
    from jaxinfer.tokenizers.loader import load_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["Once upon a time, there was a little girl."] * 20, trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    ours = load_tokenizer(tmp_path)
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert marker_id(ours, "</think>") == end and marker_id(ours, "<think>") == start
    assert marker_id(ours, "Once upon") is None
    assert reasoning_fields(get_reasoning_parser("qwen3"), ours, "x") == {
        "start_after": (end,),
        "reasoning_start": start,
    }
    assert reasoning_fields(get_reasoning_parser("deepseek_r1"), ours, "x") == {
        "start_after": (end,)
    }
