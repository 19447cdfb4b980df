"""One chat choice's text as OpenAI's message: reasoning apart (``reasoning_content``), tool
calls read back (``tool_calls``, ``finish_reason: "tool_calls"``), whole or as stream deltas.

The non-streaming message is the stream's answer to the whole text at once, so both read the
same calls: a forced call (``tool_choice`` "required" or named) or an "auto" one becomes
``tool_calls`` only when its JSON is complete and valid (a reply cut off by ``max_tokens``
inside the JSON comes back as content, ``finish_reason: "length"``); streamed, the arguments go
out as they are written.
"""

from __future__ import annotations

from jaxinfer.server.constraints import OutputPlan
from jaxinfer.server.reasoning_parsers import ReasoningParser, ReasoningStream
from jaxinfer.server.tool_parsers import ToolCallStream
from jaxinfer.server.tool_parsers.formats import NamedParser, RequiredParser


def needs_reading(plan: OutputPlan, reasoning: ReasoningParser | None) -> bool:
    """Whether a chat choice's text needs a ``ChoiceReader`` (else it is all content)."""
    return plan.tool_mode != "none" or reasoning is not None


class ChoiceReader:
    """Reads one chat choice's output, fed as it grows (``delta``) or whole (``message``).

    Args:
        plan: the request's ``OutputPlan`` ("none": no calls read).
        reasoning: the server's reasoning parser, or None.
    """

    def __init__(self, plan: OutputPlan, reasoning: ReasoningParser | None):
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        mode = plan.tool_mode
        if mode == "auto":
            parser = plan.parser
        elif mode == "required":
            parser = RequiredParser()
        elif mode == "named":
            parser = NamedParser(plan.tool_name)
        else:
            parser = None
        self.tools = ToolCallStream(parser) if parser is not None else None

    @property
    def called(self) -> bool:
        """Whether a tool call was read."""
        return self.tools is not None and self.tools.called

    def delta(self, text: str, final: bool) -> dict:
        """The stream delta of ``text`` (the output's new text; ``final``: the output ended):
        any of ``reasoning_content``, ``content`` and ``tool_calls``, only those with
        something new."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
        calls: list[dict] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text, final)
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if text:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict:
        """The non-streaming message of the whole output ``text``: ``role``, ``content``
        (None when there is only tool calls or reasoning), ``tool_calls`` when calls were
        read, ``reasoning_content`` with a reasoning parser."""
        d = self.delta(text, final=True)
        msg: dict = {"role": "assistant", "content": d.get("content")}
        if self.reasoning is not None:
            msg["reasoning_content"] = d.get("reasoning_content")
        if "tool_calls" in d:
            msg["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in d["tool_calls"]
            ]
            if msg["content"] is not None and not msg["content"].strip():
                msg["content"] = None
        elif msg["content"] is None and self.reasoning is None:
            msg["content"] = ""
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``finish_reason``: "tool_calls" when calls were read and the output ended
        on its own ("stop"), else ``reason``."""
        return "tool_calls" if reason == "stop" and self.called else reason
