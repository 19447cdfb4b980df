"""``ToolCallStream``: one choice's output, fed as it grows, as OpenAI's streamed deltas
(content text, and ``tool_calls`` entries: the id, type and name first, then arguments text)."""

from __future__ import annotations

from jaxinfer.server.tool_parsers.base import ToolParser, strict_calls


class ToolCallStream:
    """Turns the growing output of one choice into content and ``tool_calls`` deltas.

    Each ``feed`` parses the whole output so far (``parser.parse``) and sends what is new: the
    content, then per call (in order, each once its name is complete) one entry ``{"index",
    "id", "type": "function", "function": {"name", "arguments"}}`` and later entries
    ``{"index", "function": {"arguments"}}`` with the arguments text that grew. The last feed
    (``final``) settles the output as ``parser.extract`` does: when no call was sent and the
    output holds no valid call, the held-back text goes out as content.

    Args:
        parser: the model's format.
        ids: where call ids come from (default ``parser.new_call_id``).
    """

    def __init__(self, parser: ToolParser, ids=None):
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []
        self._new_id = ids or parser.new_call_id

    @property
    def called(self) -> bool:
        """Whether a tool call was sent."""
        return bool(self.ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Adds ``delta`` to the output; returns (new content text, new ``tool_calls``
        entries), each possibly empty."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        if final and not self.ids and not strict_calls(parsed):
            new_content = self.text[self.content_sent :]  # no call: all of it is content
            self.content_sent = len(self.text)
            return new_content, []
        new_content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        entries: list[dict] = []
        for k, call in enumerate(parsed.calls):
            if k == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(self._new_id())
                self.args_sent.append(0)
                entries.append(
                    {
                        "index": k,
                        "id": self.ids[k],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            new = call.arguments[self.args_sent[k] :]
            if not new:
                continue
            self.args_sent[k] = len(call.arguments)
            if entries and entries[-1]["index"] == k:
                entries[-1]["function"]["arguments"] += new
            else:
                entries.append({"index": k, "function": {"arguments": new}})
        return new_content, entries
