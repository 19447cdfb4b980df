"""What a request asks of its output: the structured-output constraint (OpenAI's
``response_format``, vLLM's ``structured_outputs`` and older ``guided_*`` fields) and tool
calling (``tools``, ``tool_choice``), turned into the engine's ``StructuredOutputsParams`` and a
plan for reading the reply (``OutputPlan``).

As vLLM's OpenAI server (``vllm/entrypoints/openai/protocol.py``, ``serving_chat.py``):

- ``tool_choice`` defaults to ``"auto"`` when there are tools, else ``"none"``;
- a named function is enforced with the function's ``parameters`` schema (the output is the
  arguments); ``"required"`` with the schema of a non-empty list of ``{"name", "parameters"}``
  objects, one branch per tool (vLLM's ``_get_json_schema_from_tool``; ``parallel_tool_calls``
  false caps the list at one call, and each object admits no other key);
- ``"auto"`` leaves the output free and reads the model's own format with the server's
  ``tool_call_parser``; without ``enable_auto_tool_choice`` and a parser it is a 400 (vLLM's
  message);
- ``"none"`` passes the tools to the chat template all the same and reads no calls.

The grammar of a forced call admits no whitespace between JSON tokens (compact arguments, as
OpenAI's): a model free to add whitespace can add it without end (a small model does).
``response_format`` keeps vLLM's default (any whitespace; ``guided_whitespace_pattern`` or
``structured_outputs: {"disable_any_whitespace": true}`` narrow it: a ``structured_outputs``
holding only such options applies them to the constraint another field sets, as vLLM's
``to_sampling_params``).

On a server with a reasoning parser, a constraint starts where the reasoning ends: its
``StructuredOutputsParams`` get ``start_after`` (the end marker's token id) and, for a parser
whose reasoning is optional (qwen3), ``reasoning_start`` (``reasoning_fields``); the engine
leaves the reasoning free and the content follows the grammar.

Every refusal is an ``APIError`` (400) naming the request field at fault.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from jaxinfer.errors import RequestError, TokenizerError
from jaxinfer.sampling.structured_params import StructuredOutputsParams
from jaxinfer.server.errors import APIError
from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxinfer.server.reasoning_parsers import ReasoningParser
from jaxinfer.server.tool_parsers import ToolParser

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older request fields and the ``StructuredOutputsParams`` field each sets."""
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
"""``structured_outputs`` fields that shape a JSON constraint without being one."""
BACKENDS = ("auto", "guidance", "llguidance")
"""``guided_decoding_backend`` values accepted (the engine compiles every grammar with
llguidance; a request naming another backend is refused)."""
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolOptions:
    """The server's tool-calling options (``EngineArgs``' ``tool_call_parser``,
    ``enable_auto_tool_choice``, ``reasoning_parser``, as parsers)."""

    parser: ToolParser | None = None
    auto: bool = False
    reasoning: ReasoningParser | None = None


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """How one request's output is constrained and read.

    Attributes:
        structured: the engine's constraint, or None.
        param: the request field the constraint came from (an engine refusal names it).
        tool_mode: "none" (no calls read), "auto" (``parser`` reads the model's format),
            "required" or "named" (the grammar writes the calls).
        tool_name: the function of a named ``tool_choice``.
        parser: the tool-call parser of "auto".
        template_tools: the tools as the chat template reads them (``[{"type": "function",
            "function": {...}}]``), or None.
        skip_special_tokens: a value the request's sampling params take (None: the request's
            own), False when the parser's markers are special tokens.
    """

    structured: StructuredOutputsParams | None = None
    param: str | None = None
    tool_mode: str = "none"
    tool_name: str | None = None
    parser: ToolParser | None = None
    template_tools: list[dict[str, Any]] | None = None
    skip_special_tokens: bool | None = None


def _params(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except RequestError as e:
        msg = str(e).removeprefix("structured_outputs: ")
        raise APIError(f"{param}: {msg}", param=param) from None


def structured_from_request(
    req: CompletionRequest | ChatCompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from (None, None: free text).

    Raises:
        APIError: more than one constraint field set, a value the params refuse, a
            ``json_schema`` response format without its schema, ``guided_whitespace_pattern``
            without a JSON constraint, an unsupported ``guided_decoding_backend``.
    """
    backend = req.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise APIError(
            f"guided_decoding_backend={backend!r} is not supported: this server compiles every "
            f"constraint with llguidance (accepted: {', '.join(BACKENDS)}, or leave it out)",
            param="guided_decoding_backend",
        )
    rf = req.response_format
    sources = [n for n in ("structured_outputs", *GUIDED) if getattr(req, n) is not None]
    if rf is not None and rf.type != "text":
        sources.insert(0, "response_format")
    options = _options_only(req.structured_outputs)
    if options is not None and len(sources) > 1:  # vLLM: the options go with the other kind
        sources.remove("structured_outputs")
    else:
        options = {}
    if len(sources) > 1:
        raise APIError(
            f"{sources[1]}: set one output constraint, got {' and '.join(sources)}",
            param=sources[1],
        )
    ws = req.guided_whitespace_pattern
    if ws is not None and sources not in (["guided_json"], ["response_format"]):
        raise APIError(
            "guided_whitespace_pattern applies to a JSON constraint (guided_json or "
            "response_format); put it in structured_outputs.whitespace_pattern otherwise",
            param="guided_whitespace_pattern",
        )
    if ws is not None:
        if "whitespace_pattern" in options:
            raise APIError(
                "guided_whitespace_pattern: set it or structured_outputs.whitespace_pattern, "
                "not both",
                param="guided_whitespace_pattern",
            )
        options = {**options, "whitespace_pattern": ws}
    if not sources:
        return None, None
    src = sources[0]
    if src == "response_format":
        if rf.type == "json_object":
            return _params(src, json_object=True, **options), src
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(
                'response_format.json_schema.schema is required with type "json_schema" (the '
                "JSON schema the output must follow)",
                param="response_format.json_schema.schema",
            )
        return _params(src, json=rf.json_schema.schema_, **options), src
    if src == "structured_outputs":
        try:
            return StructuredOutputsParams.from_dict(req.structured_outputs), src
        except RequestError as e:
            raise APIError(str(e), param=src) from None
    return _params(src, **{GUIDED[src]: getattr(req, src)}, **options), src


def _options_only(fields: dict[str, Any] | None) -> dict[str, Any] | None:
    """``structured_outputs`` when it sets only options (``OPTIONS``), no constraint kind: as
    vLLM, they then apply to the kind that ``response_format`` or a ``guided_*`` field sets.
    None otherwise.

    Raises:
        APIError: an option of the wrong type (``structured_outputs``).
    """
    if not fields or not isinstance(fields, dict) or not set(fields) <= set(OPTIONS):
        return None
    try:
        StructuredOutputsParams(json_object=True, **fields)  # checks the options' types
    except RequestError as e:
        raise APIError(str(e), param="structured_outputs") from None
    return fields


def marker_id(tokenizer, text: str) -> int | None:
    """The id of the one token whose text is ``text`` (a reasoning model's ``</think>``, an
    added token), or None when there is none or more than one (the tokenizer writes ``text``
    with several tokens). Found by encoding ``text``, else among the token bytes of a
    vocabulary that lists them (SentencePiece, whose encoder adds a space in front)."""
    if tokenizer is None or not getattr(tokenizer, "has_text", False):
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text:
        return ids[0]
    try:
        token_bytes = tokenizer.grammar_vocabulary().token_bytes
    except TokenizerError:
        return None
    same = [i for i, b in enumerate(token_bytes or ()) if b == text.encode("utf-8")]
    return same[0] if len(same) == 1 else None


def reasoning_fields(parser: ReasoningParser, tokenizer, param: str) -> dict[str, Any]:
    """``StructuredOutputsParams`` fields that start a constraint where ``parser``'s reasoning
    ends (vLLM's structured outputs with a reasoning parser): ``start_after`` the end marker's
    id, and for a parser whose reasoning is optional (``start_required``: qwen3)
    ``reasoning_start``, the start marker's id.

    Raises:
        APIError: a marker is not one token of the model (vLLM's parsers need them in the
            vocabulary too), naming ``param``.
    """
    fields: dict[str, Any] = {}
    markers = [("start_after", parser.end)]
    if parser.start_required:
        markers.append(("reasoning_start", parser.start))
    for name, text in markers:
        tid = marker_id(tokenizer, text)
        if tid is None:
            raise APIError(
                f"{param}: an output constraint on a server with --reasoning-parser "
                f"{parser.name} starts where the reasoning ends, at the token {text!r}; this "
                "model's tokenizer has no such single token, so the constraint cannot start "
                "there (send the request without a constraint, or serve a reasoning model)",
                param=param,
            )
        fields[name] = (tid,) if name == "start_after" else tid
    return fields


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``'s output: a list of one or more calls
    ``{"name": <a tool's name>, "parameters": <that tool's arguments>}`` (at most one when not
    ``parallel``); the tools' ``$defs`` are gathered at the top (vLLM's
    ``_get_json_schema_from_tool``).

    Args:
        tools: ``{"type": "function", "function": {"name", "parameters", ...}}`` dicts.

    Raises:
        APIError: two tools define one ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    branches = []
    for t in tools:
        f = t["function"]
        params = copy.deepcopy(f.get("parameters")) or dict(EMPTY_PARAMETERS)
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise APIError(
                    f"tools: the definition {name!r} ($defs) has two different schemas",
                    param="tools",
                )
            defs[name] = schema
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def plan_output(
    req: CompletionRequest | ChatCompletionRequest, opts: ToolOptions, tokenizer=None
) -> OutputPlan:
    """The request's ``OutputPlan``. On a server with a reasoning parser, the constraint
    starts where the reasoning ends (``reasoning_fields``; ``tokenizer``: the model's).

    Raises:
        APIError: 400 naming the field: a bad constraint (``structured_from_request``); two
            tools of one name; ``tool_choice`` without tools, naming a function not in
            ``tools``, or "auto" on a server without an auto tool parser; a forced tool call
            together with another output constraint; an output constraint on a server whose
            reasoning markers are not single tokens of the model (``reasoning_fields``).
    """
    structured, param = structured_from_request(req)
    tools_in = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if choice is None:
        choice = "auto" if tools_in else "none"
    tools = [t.model_dump(exclude_none=True) for t in tools_in] if tools_in else None
    names = [t["function"]["name"] for t in tools or ()]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(f"tools: two tools are named {dup!r}", param="tools")
    mode, name = (choice, None) if isinstance(choice, str) else ("named", choice.function.name)
    if mode != "none" and not tools:
        raise APIError(
            f"tool_choice: {mode!r} needs tools (the request has none)", param="tool_choice"
        )
    if mode == "named" and name not in names:
        raise APIError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(map(repr, names))})",
            param="tool_choice",
        )
    if mode == "auto" and not (opts.auto and opts.parser is not None):
        raise APIError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            'be set (give tool_choice "required", "none" or a named function, or start the '
            "server with both)",
            param="tool_choice",
        )
    if mode in ("named", "required"):
        if structured is not None:
            raise APIError(
                f"{param}: an output constraint cannot go with tool_choice {mode!r}, which "
                "constrains the output to the tool call itself",
                param=param,
            )
        if mode == "named":
            f = tools[names.index(name)]["function"]
            schema = f.get("parameters") or EMPTY_PARAMETERS
        else:
            schema = required_schema(tools, req.parallel_tool_calls is not False)
        structured = _params("tools", json=schema, disable_any_whitespace=True)
        param = "tools"
    if structured is not None and opts.reasoning is not None and structured.start_after is None:
        fields = reasoning_fields(opts.reasoning, tokenizer, param)
        structured = dataclasses.replace(structured, **fields)
    parser = opts.parser if mode == "auto" else None
    skip = None
    if parser is not None and parser.keep_special_tokens and req.skip_special_tokens is None:
        skip = False
    return OutputPlan(structured, param, mode, name, parser, tools, skip)
