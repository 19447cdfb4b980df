"""Tool-call parsers: a model's own way of writing function calls, read back as OpenAI's
``tool_calls`` (vLLM's ``--tool-call-parser``). Pure text functions: no engine, no HTTP.

``TOOL_PARSERS`` names the formats (``formats``); ``get_tool_parser(name)`` gives one;
``ToolParser.extract(text)`` answers a whole output; ``ToolCallStream`` answers one as it grows.
"""

from __future__ import annotations

from jaxinfer.server.tool_parsers.base import (
    ExtractedToolCalls,
    Parsed,
    PartialCall,
    ToolCall,
    ToolParser,
)
from jaxinfer.server.tool_parsers.formats import HermesParser, Llama3JsonParser, MistralParser
from jaxinfer.server.tool_parsers.stream import ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
"""The ``tool_call_parser`` option's values and their formats."""


def get_tool_parser(name: str) -> ToolParser:
    """The parser named ``name``. Raises ValueError naming the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "Parsed",
    "PartialCall",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]
