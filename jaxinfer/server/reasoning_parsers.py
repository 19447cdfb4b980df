"""Reasoning parsers: a reasoning model's ``<think>...</think>`` text apart from its answer,
returned as ``message.reasoning_content`` (vLLM's ``--reasoning-parser``). Pure text functions.

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3-2507 thinking models): the output
  starts inside the reasoning (the chat template's generation prompt opens ``<think>``; a
  ``<think>`` the model writes itself is dropped) and the reasoning ends at ``</think>``; without
  ``</think>`` the whole output is reasoning (cut off by ``max_tokens``), no content.
- ``qwen3`` (Qwen3 hybrid models): reasoning only when the output starts with ``<think>``
  (``enable_thinking`` off gives none), up to ``</think>``; an output that does not start so is
  all content.

The content after ``</think>`` keeps its text as the model wrote it (usually led by newlines),
as vLLM's parsers do.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.server.tool_parsers.json_scan import held_prefix


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """One model family's reasoning markers.

    Attributes:
        name: the ``reasoning_parser`` option's value.
        start_required: reasoning only when the output starts with ``start`` (qwen3); else the
            output starts in the reasoning (deepseek_r1).
        start, end: the markers.
    """

    name: str
    start_required: bool
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``. With ``final`` False the text may grow: each
        part then only holds what cannot change (a tail that may be the start of a marker is
        held back), so both parts only ever grow."""
        if text.startswith(self.start):
            body = len(self.start)
        elif not final and self.start.startswith(text):
            return "", ""  # may still become the start marker
        elif self.start_required:
            return "", text
        else:
            body = 0
        e = text.find(self.end, body)
        if e >= 0:
            return text[body:e], text[e + len(self.end) :]
        if final:
            return text[body:], ""
        return text[body : len(text) - held_prefix(text[body:], self.end)], ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output, None for an empty part."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", start_required=False),
    "qwen3": ReasoningParser("qwen3", start_required=True),
}
"""The ``reasoning_parser`` option's values."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name``. Raises ValueError naming the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}"
        ) from None


class ReasoningStream:
    """One choice's growing output as (reasoning, content) deltas (``ReasoningParser.split``
    on the whole text at each feed; the difference is sent)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = [0, 0]

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Adds ``delta``; returns the new (reasoning, content) text."""
        self.text += delta
        parts = self.parser.split(self.text, final)
        out = tuple(p[s:] for p, s in zip(parts, self.sent, strict=True))
        self.sent = [max(s, len(p)) for p, s in zip(parts, self.sent, strict=True)]
        return out
