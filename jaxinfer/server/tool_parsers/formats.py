"""The tool-call formats of common models, as vLLM's parsers of the same names read them
(``vllm/entrypoints/openai/tool_parsers/``): ``hermes``, ``llama3_json``, ``mistral``."""

from __future__ import annotations

from jaxinfer.server.tool_parsers.base import (
    Parsed,
    PartialCall,
    ToolParser,
    call_from_object,
    json_list_calls,
    parse_calls_from,
    split_content,
)
from jaxinfer.server.tool_parsers.json_scan import skip_ws, value_end


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: content, then calls as
    ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call (the
    last one may lack its closing tag). Content is the text before the first block."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        content, k = split_content(text, self.START, final)
        if k < 0:
            return Parsed(content)
        calls: list[PartialCall] = []
        n, i = len(text), k
        while True:
            j = skip_ws(text, i + len(self.START))
            if j >= n:
                return Parsed(content, tuple(calls), ok=not final)
            if text[j] != "{":
                return Parsed(content, tuple(calls), ok=False)
            try:
                call, end = call_from_object(text, j)
            except ValueError:
                return Parsed(content, tuple(calls), ok=False)
            if call is not None:
                calls.append(call)
            if end is None:
                return Parsed(content, tuple(calls))
            if call is None:
                return Parsed(content, tuple(calls), ok=False)
            m = skip_ws(text, end)
            if m >= n or self.END.startswith(text[m:]):  # closing tag missing or partial
                return Parsed(content, tuple(calls))
            if not text.startswith(self.END, m):
                return Parsed(content, tuple(calls), ok=False)
            i = skip_ws(text, m + len(self.END))
            if i >= n or self.START.startswith(text[i:]):
                return Parsed(content, tuple(calls))
            if not text.startswith(self.START, i):  # text after the calls: not content
                return Parsed(content, tuple(calls))


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole output is
    ``{"name": "f", "parameters": {...}}`` (``"arguments"`` accepted too), optionally after
    ``<|python_tag|>``, several calls separated by ``;``. Output that does not start so (after
    whitespace) is content; a call output has no content."""

    name = "llama3_json"
    keep_special_tokens = True
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        s = skip_ws(text, 0)
        rest = text[s:]
        if not final and (rest == "" or (self.TAG.startswith(rest) and rest != self.TAG)):
            return Parsed("")  # may still become a call
        if rest.startswith(self.TAG):
            i = s + len(self.TAG)
        elif rest.startswith("{"):
            i = s
        else:
            return Parsed(text)
        calls: list[PartialCall] = []
        end, ok = parse_calls_from(text, i, ";", calls)
        ok = ok and skip_ws(text, end) == len(text)
        return Parsed("", tuple(calls), ok=ok)


class MistralParser(ToolParser):
    """Mistral: content, then ``[TOOL_CALLS]`` and either a JSON list of
    ``{"name", "arguments"}`` objects (tokenizers before v11) or ``name[ARGS]{...}`` with
    ``[TOOL_CALLS]`` before each further call (v11 on). ``[TOOL_CALLS]`` is a special token, so
    requests with tools keep special tokens in the text; call ids are 9 letters and digits, as
    Mistral's chat templates require."""

    name = "mistral"
    keep_special_tokens = True
    id_chars = 9
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Parsed:
        content, k = split_content(text, self.TAG, final)
        if k < 0:
            return Parsed(content)
        n = len(text)
        i = skip_ws(text, k + len(self.TAG))
        if i >= n:
            return Parsed(content, (), ok=not final)
        if text[i] == "[":
            return json_list_calls(text, i + 1, content)
        return self._named(text, i, content, final)

    def _named(self, text: str, i: int, content: str, final: bool) -> Parsed:
        calls: list[PartialCall] = []
        n = len(text)
        while True:
            a = text.find(self.ARGS, i)
            if a < 0:
                return Parsed(content, tuple(calls), ok=not final)
            name = text[i:a].strip()
            j = skip_ws(text, a + len(self.ARGS))
            if not name or (j < n and text[j] not in "{["):
                return Parsed(content, tuple(calls), ok=False)
            try:
                end = value_end(text, j) if j < n else None
            except ValueError:
                return Parsed(content, tuple(calls), ok=False)
            calls.append(PartialCall(name, text[j:end] if end else text[j:], end is not None))
            if end is None:
                return Parsed(content, tuple(calls), ok=not final)
            m = skip_ws(text, end)
            if m >= n or self.TAG.startswith(text[m:]):
                return Parsed(content, tuple(calls))
            if not text.startswith(self.TAG, m):
                return Parsed(content, tuple(calls), ok=False)
            i = skip_ws(text, m + len(self.TAG))


class RequiredParser(ToolParser):
    """The output of ``tool_choice: "required"``: the grammar makes it a JSON list of
    ``{"name": ..., "parameters": {...}}`` objects (``tool_choice.required_schema``)."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("", (), ok=not final)
        if text[i] != "[":
            return Parsed("", (), ok=False)
        return json_list_calls(text, i + 1, "")


class NamedParser(ToolParser):
    """The output of a named ``tool_choice``: the grammar makes the whole output the
    function's arguments (a JSON object of its parameters' schema)."""

    def __init__(self, function: str):
        self.name = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", (PartialCall(self.name, text.lstrip(), final),))
