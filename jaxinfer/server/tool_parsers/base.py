"""What every tool-call parser shares: the parse result, one call read from a JSON object, and
the stream that turns growing text into OpenAI's ``tool_calls`` deltas.

A parser has one method, ``parse(text, final)``: the content and the calls found in the output
so far. With ``final`` False the text may still grow, and the result only holds what cannot
change any more (content that cannot be the start of a tool-call marker, a call's name once its
string is complete, its arguments as the text written so far): so each result extends the one
before, and a stream sends the difference (``ToolCallStream``). ``extract(text)`` is the
non-streaming answer: every call complete and valid JSON, else no call and the whole text as
content (as vLLM's parsers).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string

from jaxinfer.server.tool_parsers.json_scan import (
    WHITESPACE,
    held_prefix,
    scan_object,
    skip_ws,
    value_end,
)


@dataclasses.dataclass(frozen=True)
class PartialCall:
    """One tool call as far as it is written.

    Attributes:
        name: the function name once its JSON string is complete, else None.
        arguments: the arguments written so far (JSON text; grows as the output grows).
        complete: the call's text has ended.
    """

    name: str | None
    arguments: str
    complete: bool


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A parse of an output: ``content`` (text for ``message.content``, always a prefix of the
    output) and the calls; ``ok`` False when the tool-call part holds something that is not a
    call (then the non-streaming answer is the whole output as content)."""

    content: str
    calls: tuple[PartialCall, ...] = ()
    ok: bool = True


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A finished call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ExtractedToolCalls:
    """The non-streaming result: ``content`` None when there is none besides the calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def call_from_object(
    s: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[PartialCall | None, int | None]:
    """The call written as the JSON object at ``s[i]`` (``{"name": ..., "arguments": {...}}``;
    the first of ``args_keys`` present holds the arguments) and the object's end (None while
    unfinished). The call is None when the object is finished without a string ``name``.

    Arguments are the model's own text of the value (an object or array as it grows; a JSON
    string holding JSON, as some models write them, decoded once complete; a scalar once
    complete; ``{}`` when the finished object has none).

    Raises:
        ValueError: the text is not a JSON object.
    """
    members, end = scan_object(s, i)
    name = None
    if "name" in members and members["name"][1] is not None:
        a, b = members["name"]
        v = json.loads(s[a:b])
        if not isinstance(v, str):
            return None, end
        name = v
    if end is not None and name is None:
        return None, end
    key = next((k for k in args_keys if k in members), None)
    if key is None:
        args = "{}" if end is not None else ""
    else:
        a, b = members[key]
        if s[a] in "{[":
            args = s[a:b] if b is not None else s[a:]
        elif b is None:
            args = ""
        elif s[a] == '"':
            args = json.loads(s[a:b])
        else:
            args = s[a:b]
            if args == "null":
                args = "{}"
    return PartialCall(name, args, end is not None), end


def strict_calls(parsed: Parsed) -> tuple[ToolCall, ...] | None:
    """The calls of a final parse when every one is complete, named and has arguments that are
    valid JSON; else None."""
    if not parsed.ok:
        return None
    out = []
    for c in parsed.calls:
        if not c.complete or c.name is None:
            return None
        try:
            json.loads(c.arguments)
        except ValueError:
            return None
        out.append(ToolCall(c.name, c.arguments))
    return tuple(out)


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """A model's tool-call format (subclasses: ``parse``; class attributes below).

    Attributes:
        name: the ``tool_call_parser`` option's value.
        keep_special_tokens: the format's markers are special tokens, so a request with tools
            decodes with ``skip_special_tokens`` False (unless it asks otherwise).
        id_chars: tool call ids: None for OpenAI's ``call_`` + 24 hex digits, else that many
            letters and digits (Mistral's templates want 9).
    """

    name = ""
    keep_special_tokens = False
    id_chars: int | None = None

    def parse(self, text: str, final: bool) -> Parsed:  # pragma: no cover - abstract
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole output: every call complete and valid, else no
        call and all of ``text`` as content."""
        parsed = self.parse(text, final=True)
        calls = strict_calls(parsed)
        if not calls:
            return ExtractedToolCalls(text, ())
        return ExtractedToolCalls(content_or_none(parsed.content), calls)

    def new_call_id(self) -> str:
        """A fresh tool call id in this format's style."""
        if self.id_chars is None:
            return "call_" + secrets.token_hex(12)
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(self.id_chars))


def parse_calls_from(
    text: str, i: int, sep: str | None, calls: list, until: str = ""
) -> tuple[int, bool]:
    """Appends the calls written as JSON objects from ``text[i]`` on (separated by ``sep`` and
    whitespace) to ``calls``; returns where reading stopped and whether everything read was a
    call (an object without a string ``name``, or text that is not JSON, is not; a character
    of ``until`` ends the calls there)."""
    n = len(text)
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return i, True
        if text[i] != "{":
            return i, text[i] in until
        try:
            call, end = call_from_object(text, i)
        except ValueError:
            return i, False
        if call is None:
            return (n, True) if end is None else (end, False)
        calls.append(call)
        if end is None:
            return n, True
        i = skip_ws(text, end)
        if sep is not None and text.startswith(sep, i):
            i += len(sep)


def json_list_calls(text: str, i: int, content: str) -> Parsed:
    """The calls of a JSON list of call objects (``[{"name": ..., "arguments"|"parameters":
    ...}, ...]``) whose ``[`` is at ``text[i - 1]``, after ``content``; ``ok`` only when the
    list is closed and nothing but whitespace follows."""
    calls: list[PartialCall] = []
    end, ok = parse_calls_from(text, i, ",", calls, until="]")
    if not ok:
        return Parsed(content, tuple(calls), ok=False)
    end = skip_ws(text, end)
    closed = end < len(text) and text[end] == "]"
    tail_ok = skip_ws(text, end + 1) == len(text) if closed else end == len(text)
    return Parsed(content, tuple(calls), ok=closed and tail_ok)


def split_content(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before the first ``marker`` in ``text`` and the marker's index (-1 if
    absent). Content before a marker loses its trailing whitespace; while the text may grow
    (not ``final``) it also holds back a tail that may start the marker, and trailing
    whitespace (which a marker may follow), so content only ever grows."""
    k = text.find(marker)
    if k >= 0:
        return text[:k].rstrip(WHITESPACE), k
    if final:
        return text, -1
    return text[: len(text) - held_prefix(text, marker)].rstrip(WHITESPACE), -1


__all__ = [
    "ExtractedToolCalls",
    "Parsed",
    "PartialCall",
    "ToolCall",
    "ToolParser",
    "call_from_object",
    "content_or_none",
    "json_list_calls",
    "parse_calls_from",
    "split_content",
    "strict_calls",
    "value_end",
]
