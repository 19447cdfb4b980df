"""Streaming detokenization: generated ids to text, one id at a time."""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.tokenizers.base import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids into text one id at a time, never emitting half a UTF-8 character.

    Keeps a window of already-emitted ids (prefix offset) before the unread ids (read offset) and
    decodes the window with and without the new ids: context-dependent spacing (SentencePiece's
    dummy prefix, ``Strip`` decoders) cancels, and text ending in U+FFFD (an incomplete byte
    sequence) is held back. Method of vLLM's ``detokenize_incrementally`` and transformers'
    ``TextStreamer``.

    Attributes:
        text: all generated text so far, the prompt excluded.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - 5, 0)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta
