"""The server's structured output and tool calling (issue 31) through the real `openai` client
and raw HTTP, on stories260K: a model that knows nothing of JSON or tools, so only the grammar
makes its replies parse.

One in-process server for the module (uvicorn in a thread, 127.0.0.1, a free port) on the
session's ``stories_llm``, with the hermes tool-call parser and auto tool choice on, and a chat
template that renders tools and tool turns. Judges: the ``jsonschema`` library (every reply
against the schema asked for), the SDK's own ``parse`` helper, ``json.loads``, an independent
jinja2 rendering of the template (tool turns reach the prompt), and the same request without the
parsers (the text they read). Every wait is bounded in time.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Literal

import httpx
import jinja2
import jsonschema
import openai
import pydantic
import pytest
from json_text import whitespace_outside_strings

from jaxinfer.sampling.params import SamplingParams

uvicorn = pytest.importorskip("uvicorn")

MODEL = "stories260K"
TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [WEATHER, NOW]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SCHEMA = {  # nested: objects, arrays with bounds, enums, bounded numbers, a pattern
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "pets": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                },
                "required": ["kind", "legs"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Once upon a time"}]


class _Server:
    def __init__(self, url, state, llm):
        self.url, self.state, self.llm = url, state, llm
        self.client = openai.OpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=120
        )

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=120
        )


@pytest.fixture(scope="module")
def server(stories_llm):
    from jaxinfer.server.app import create_app
    from jaxinfer.server.command import bind_socket
    from jaxinfer.server.constraints import ToolOptions
    from jaxinfer.server.tool_parsers import get_tool_parser

    tok = stories_llm.tokenizer
    old = tok.chat_template
    tok.chat_template = TEMPLATE
    app = create_app(
        stories_llm, model_name=MODEL, tools=ToolOptions(get_tool_parser("hermes"), auto=True)
    )
    sock = bind_socket("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield _Server(f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.jaxinfer, stories_llm)
    finally:
        srv.should_exit = True
        th.join(30)
        tok.chat_template = old
    assert not th.is_alive()


@pytest.fixture(scope="module")
def constrained(stories_llm):
    """Skips where the engine does not enforce constraints yet (before the ``so`` branch)."""
    from jaxinfer.errors import RequestError

    try:
        stories_llm.generate(
            ["x"], SamplingParams(max_tokens=1, structured_outputs={"choice": ["a"]})
        )
    except RequestError as e:
        pytest.skip(f"the engine does not enforce structured outputs: {e}")


def _stream_message(chunks) -> tuple[dict, list]:
    """The message a chat stream adds up to (content, reasoning, tool calls by index) and its
    finish reasons; checks each call's first delta brings its id, type and name."""
    content, reasoning, calls, reasons = "", "", {}, []
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or ():
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    msg = {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [calls[k] for k in sorted(calls)],
    }
    return msg, reasons


def _check_calls(calls):
    """Every call names a tool and its arguments are JSON valid against that tool's schema."""
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def _message_calls(message) -> list[dict]:
    return [
        {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
        for t in message.tool_calls or ()
    ]


# ------------------------------------------------------------------ response_format


def test_json_schema_replies_validate_streamed_and_not(server, constrained):
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    ws = {"guided_whitespace_pattern": "[ ]?"}  # else stories260K writes whitespace without end
    r = server.client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        response_format=rf,
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=120,
        extra_body=ws,
    )
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
        assert ch.message.tool_calls is None
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            response_format=rf,
            temperature=1.0,
            seed=3,
            max_tokens=120,
            stream=True,
            extra_body=ws,
        )
    )
    msg, reasons = _stream_message(chunks)
    assert reasons == ["stop"]
    assert msg["content"] == r.choices[0].message.content  # seed 3, completion 0: the same draw
    # json_object, and vLLM's extra fields through extra_body, on completions too
    r = server.client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=4,
        max_tokens=60,
        extra_body={"guided_whitespace_pattern": ""},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut off: a prefix of an object
        assert r.choices[0].message.content.startswith("{")
    r = server.client.completions.create(
        model=MODEL,
        prompt="Once",
        max_tokens=8,
        temperature=1.0,
        seed=1,
        extra_body={"guided_choice": ["cat", "dog"]},
    )
    assert r.choices[0].text in ("cat", "dog")
    r = server.client.completions.create(
        model=MODEL,
        prompt="Once",
        max_tokens=8,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": "[a-c]{3}"}},
    )
    assert r.choices[0].text in {a + b + c for a in "abc" for b in "abc" for c in "abc"}


def test_structured_outputs_options_apply_to_response_format(server, constrained):
    """vLLM's way to ask for compact JSON: ``structured_outputs`` holding only
    ``disable_any_whitespace`` beside ``response_format``; no whitespace outside strings."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = server.client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        response_format=rf,
        temperature=1.0,
        seed=11,
        n=3,
        max_tokens=120,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        assert whitespace_outside_strings(ch.message.content) == [], ch.message.content
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)
    name: str = pydantic.Field(max_length=5)


def test_the_sdks_parse_helper_returns_the_object(server, constrained):
    parse = (
        getattr(server.client.chat.completions, "parse", None)
        or server.client.beta.chat.completions.parse
    )
    r = parse(
        extra_body={"guided_whitespace_pattern": "[ ]?"},
        model=MODEL,
        messages=MSGS,
        response_format=Pet,
        temperature=1.0,
        seed=5,
        max_tokens=60,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 4
    assert Pet.model_validate_json(r.choices[0].message.content) == pet


# ------------------------------------------------------------------ tools


def test_tool_choice_required_is_enforced_streamed_and_not(server, constrained):
    kw = dict(
        model=MODEL,
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        max_tokens=120,
        parallel_tool_calls=False,  # stories260K would add calls until max_tokens
    )
    r = server.client.chat.completions.create(seed=7, **kw)
    (ch,) = r.choices
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    calls = _message_calls(ch.message)
    _check_calls(calls)
    assert all(c["id"].startswith("call_") for c in calls)
    msg, reasons = _stream_message(server.client.chat.completions.create(seed=7, stream=True, **kw))
    assert reasons == ["tool_calls"] and msg["content"] is None
    assert [(c["name"], c["arguments"]) for c in msg["calls"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert len(calls) == 1
    # parallel calls: a list of calls, cut off by max_tokens here (then content, "length")
    kw["parallel_tool_calls"] = True
    ch = server.client.chat.completions.create(seed=7, **kw).choices[0]
    if ch.finish_reason == "tool_calls":
        _check_calls(_message_calls(ch.message))
    else:
        assert ch.finish_reason == "length" and ch.message.tool_calls is None
        assert ch.message.content.startswith('[{"name":"')


def test_a_named_tool_choice_gives_that_call(server, constrained):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=60
    )
    r = server.client.chat.completions.create(seed=2, **kw)
    (ch,) = r.choices
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    calls = _message_calls(ch.message)
    assert [c["name"] for c in calls] == ["get_weather"]
    _check_calls(calls)
    msg, reasons = _stream_message(server.client.chat.completions.create(seed=2, stream=True, **kw))
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in msg["calls"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]


HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
    "</tool_call>"
)


def test_auto_reads_the_models_hermes_calls(server, constrained):
    """stories260K writes no tool call of itself: a choice constraint makes it write one in
    the hermes format, which tool_choice auto must read back."""
    kw = dict(
        model=MODEL,
        messages=MSGS,
        tools=TOOLS,
        temperature=1.0,
        max_tokens=80,
        extra_body={"guided_choice": ["It is: " + HERMES_CALL]},
    )
    r = server.client.chat.completions.create(**kw)
    (ch,) = r.choices
    assert ch.finish_reason == "tool_calls" and ch.message.content == "It is:"
    calls = _message_calls(ch.message)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})
    ]
    msg, reasons = _stream_message(server.client.chat.completions.create(stream=True, **kw))
    assert reasons == ["tool_calls"] and msg["content"] == "It is:"
    assert [(c["name"], c["arguments"]) for c in msg["calls"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    # no call in the text: all of it is content, finish_reason stays "stop"
    kw["extra_body"] = {"guided_choice": ["no tool today"]}
    r = server.client.chat.completions.create(**kw)
    assert r.choices[0].message.content == "no tool today" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None


def test_tool_turns_reach_the_chat_template(server):
    llm = server.llm
    msgs = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Rome", "unit": "C"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    as_template = [dict(m, content=m["content"] or "") for m in copy.deepcopy(msgs)]
    as_template[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome", "unit": "C"}
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)  # transformers' tojson
    rendered = env.from_string(TEMPLATE).render(
        messages=as_template, tools=TOOLS, bos_token="<s>", add_generation_prompt=True
    )
    assert "<tool_call>" in rendered and '"city": "Rome"' in rendered and "tool: sunny" in rendered
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    r = server.client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert r.usage.prompt_tokens == len(ids)
    ref = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0))[0]
    assert r.choices[0].message.content == ref.text and r.choices[0].message.tool_calls is None


# ------------------------------------------------------------------ reasoning


def test_reasoning_content_apart_from_the_content(server, monkeypatch):
    from jaxinfer.server.constraints import ToolOptions
    from jaxinfer.server.reasoning_parsers import get_reasoning_parser

    kw = dict(model=MODEL, messages=MSGS, max_tokens=12, temperature=0)
    plain = server.client.chat.completions.create(**kw).choices[0]
    monkeypatch.setattr(
        server.state, "tools", ToolOptions(reasoning=get_reasoning_parser("deepseek_r1"))
    )
    ch = server.client.chat.completions.create(**kw).choices[0]
    # no </think> in the text: all of it is reasoning (deepseek_r1), no content
    assert ch.message.reasoning_content == plain.message.content and ch.message.content is None
    assert ch.finish_reason == plain.finish_reason
    msg, reasons = _stream_message(server.client.chat.completions.create(stream=True, **kw))
    assert msg["reasoning"] == plain.message.content and msg["content"] is None
    # a constraint starts after "</think>", which is no single token of stories260K: refused,
    # naming the field (tests/test_structured_reasoning.py runs one with a marker it has)
    r = server.post({"messages": MSGS, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "'</think>'" in r.json()["error"]["message"]


# ------------------------------------------------------------------ bad requests


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                },
            }
        },
        "response_format",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    (
        {"guided_json": {"type": "object"}, "structured_outputs": {"disable_any_whitespace": 1}},
        "structured_outputs",
    ),
    (
        {
            "guided_json": {"type": "object"},
            "guided_whitespace_pattern": " ",
            "structured_outputs": {"whitespace_pattern": ""},
        },
        "guided_whitespace_pattern",
    ),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
]


def test_bad_constraints_and_tools_are_400s_naming_the_field(server, monkeypatch):
    from jaxinfer.server.constraints import ToolOptions

    cases = list(BAD)
    for body, param in cases:
        r = server.post({"messages": MSGS, "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "BadRequestError", (body, err)
        assert param.split(".")[0] in err["message"], err
    # auto without the parser and the switch: vLLM's 400
    monkeypatch.setattr(server.state, "tools", ToolOptions())
    r = server.post({"messages": MSGS, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    monkeypatch.undo()
    # and the engine serves the next request
    r = server.post({"messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert server.state.engine.outstanding == 0
