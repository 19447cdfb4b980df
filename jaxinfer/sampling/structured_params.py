"""`StructuredOutputsParams`: the output constraint of one request (JSON schema, regex, choice,
grammar), as vLLM's ``vllm/sampling_params.py`` ``StructuredOutputsParams``.

This module only describes and validates the request's constraint on the host; the grammar
library that compiles it and the token masks live in `jaxinfer.sampling.structured`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from jaxinfer.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraint kinds, in vLLM's field order; a request sets exactly one."""


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint; exactly one of the kinds is set (vLLM's semantics).

    Attributes:
        json: a JSON schema (a JSON string or a mapping, stored as a compact JSON string in the
            schema's own key order: the output's properties come in the order ``properties``
            lists them, as OpenAI's structured outputs); the output is one JSON value valid
            against it.
        regex: a regular expression the whole output must match (``re.fullmatch``).
        choice: the output is exactly one of these strings (a list or tuple, stored as a tuple).
        grammar: a Lark grammar (llguidance's Lark dialect) the output must parse with.
        json_object: True = the output is any JSON object (OpenAI's ``response_format:
            {"type": "json_object"}``).
        structural_tag: vLLM's structural-tag JSON string (free text with constrained
            segments between tags).
        disable_any_whitespace: JSON without whitespace between tokens.
        disable_additional_properties: JSON objects without properties the schema does not
            name, whatever its ``additionalProperties`` says.
        whitespace_pattern: a regex for the whitespace allowed between JSON tokens.
        start_after: token ids (a reasoning model's end-of-reasoning marker, ``</think>``'s
            id): the grammar is dormant (no mask: every token free, EOS included) until the
            output first ends with these ids, and starts fresh after them (vLLM starts the
            grammar where its reasoning parser sees the reasoning end). Only output tokens
            count: the marker in the prompt starts nothing. None: the grammar applies from the
            first output token. The server sets it from its ``--reasoning-parser``.
        reasoning_start: with ``start_after``, a token id (Qwen3's ``<think>``, where thinking
            may be off) that alone opens a reasoning: an output whose first token is another is
            constrained from that first token (the first mask allows this id beside the
            grammar's). None: the output starts inside the reasoning (DeepSeek-R1's template
            opens ``<think>``).

    Raises:
        RequestError: when no kind or more than one is set, or a field has the wrong type (a
            schema that is not valid JSON, an empty choice list, ...). Whether the grammar
            library accepts the schema, regex or grammar is checked when it is compiled.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    start_after: tuple[int, ...] | None = None
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise RequestError(f"structured_outputs: {msg}")

        def setf(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        js = self.json
        if js is not None:
            if isinstance(js, Mapping):
                try:
                    js = json.dumps(js, separators=(",", ":"))
                except (TypeError, ValueError) as e:
                    fail(f"json: the schema is not JSON-serialisable: {e}")
            elif isinstance(js, str):
                try:
                    obj = json.loads(js)
                except ValueError as e:
                    fail(f"json: the schema is not valid JSON: {e}")
                if not isinstance(obj, dict | bool):
                    fail(f"json: a schema is a JSON object or a boolean, got {type(obj).__name__}")
                js = json.dumps(obj, separators=(",", ":"))
            else:
                fail(f"json must be a JSON schema (a string or an object), got {js!r}")
            setf("json", js)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                fail(f"{name} must be a string, got {v!r}")
            if isinstance(v, str) and name != "whitespace_pattern" and v == "":
                fail(f"{name} must not be empty")
        ch = self.choice
        if ch is not None:
            if isinstance(ch, str | bytes | Mapping) or not isinstance(ch, Iterable):
                fail(f"choice must be a list of strings, got {ch!r}")
            ch = tuple(ch)
            if not ch:
                fail("choice must name at least one string")
            if not all(isinstance(c, str) for c in ch):
                fail(f"choice must contain only strings, got {ch!r}")
            setf("choice", ch)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            if v is None:
                setf(name, False)
            elif not isinstance(v, bool):
                fail(f"{name} must be a bool, got {v!r}")
        sa = self.start_after
        if sa is not None:
            if isinstance(sa, str | bytes | Mapping) or not isinstance(sa, Iterable):
                fail(f"start_after must be a list of token ids, got {sa!r}")
            sa = tuple(sa)
            if not sa or not all(_is_id(i) for i in sa):
                fail(f"start_after must be a non-empty list of token ids (ints >= 0), got {sa!r}")
            setf("start_after", sa)
        rs = self.reasoning_start
        if rs is not None:
            if not _is_id(rs):
                fail(f"reasoning_start must be a token id (an int >= 0), got {rs!r}")
            if sa is None:
                fail("reasoning_start goes with start_after (the marker that ends the reasoning)")
        kinds = self.kinds
        if not kinds:
            fail(f"set one of {', '.join(KINDS)}")
        if len(kinds) > 1:
            fail(f"set only one constraint kind, got {', '.join(kinds)}")

    @property
    def grammar_only(self) -> StructuredOutputsParams:
        """These params without ``start_after`` / ``reasoning_start``: what the grammar is
        compiled from (one compiled grammar serves both)."""
        if self.start_after is None:
            return self
        return dataclasses.replace(self, start_after=None, reasoning_start=None)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The constraint kinds set (one on a valid instance)."""
        return tuple(
            k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)
        )

    @property
    def kind(self) -> str:
        """The one constraint kind set: one of `KINDS`."""
        return self.kinds[0]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructuredOutputsParams:
        """Builds params from a JSON-like mapping (a CLI record's or the server's field).

        Raises:
            RequestError: if `d` is not a mapping, names a field that does not exist (the
                allowed ones are listed), or a value is invalid.
        """
        if isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            raise RequestError(
                f"structured_outputs: expected a JSON object, got {type(d).__name__}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown:
            raise RequestError(
                f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(names)}"
            )
        return cls(**d)


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``)."""
