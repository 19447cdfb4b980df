"""Streaming detokenization: generated ids to text, one id at a time.

The rule (also in docs/python-api.md): the output text of a request is the decoding of its output
ids in the context of its prompt, and the concatenated deltas are exactly that text:

    text == decode(prompt + output)[len(c):]

where ``c`` is ``decode(prompt)`` without the U+FFFD that stand for an incomplete UTF-8 sequence
at the prompt's end (``Tokenizer.decode_partial``; at most 3 bytes). So a character the prompt
starts and the output finishes belongs to the output (vLLM's rule: prompt "Once " plus two bytes
of an emoji, output the other two bytes then " world", gives output text "😀 world"); if the output
does not complete it, its U+FFFD are output text too. Without such a prompt tail, ``text`` is the
output's own decoding after the prompt (the prompt gives spacing context: SentencePiece's dummy
prefix, a ``Strip`` decoder), and for a prompt of BOS only it is ``decode(output)``. (A tokenizer
with transformers' ``clean_up_tokenization_spaces`` may also change the prompt's last characters:
"Hello " then "." decode as "Hello."; the output text then starts where ``decode(prompt +
output)`` departs from ``c``: ".".)

While streaming, only the incomplete UTF-8 sequence at the end (at most 3 bytes, at most 3 U+FFFD
in the text) is held back, or, with the clean-up, the start of one of its patterns (" ", " '",
" n", ...: at most 3 characters): bytes that can never form a character are emitted as U+FFFD at
once, and ``finish`` flushes what is held. Each ``add`` decodes a window of at most
``2 * _KEEP`` ids, so streaming n ids costs O(n).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxinfer.tokenizers.base import Tokenizer

_FFFD = "\ufffd"
_CONTEXT = 5  # ids of context before the unread ones (vLLM's initial prefix offset)
_KEEP = _CONTEXT + 3  # ... plus room for the ids of an incomplete character (at most 3 bytes)


class IncrementalDetokenizer:
    """Turns generated ids into text one id at a time (module docstring: the rule).

    Keeps a window of the last ids (context, then the unread ones) and decodes it after each id:
    the text past what was already emitted, minus the incomplete character at its end, is the
    delta. Method of vLLM's ``detokenize_incrementally`` and transformers' ``TextStreamer``, with
    the hold-back decided from the bytes (``Tokenizer.decode_partial``) rather than from a
    trailing U+FFFD, which invalid bytes also produce.

    Args:
        tokenizer: a ``Tokenizer`` (or any object with ``decode(ids, skip_special_tokens)``,
            whose text is then taken as final at once).
        prompt_ids: the prompt, int[P]: the context of the output's first ids, and the start of
            a character its last bytes begin.
        skip_special_tokens: as in ``decode``.

    Attributes:
        text: all output text emitted so far (the concatenated deltas), the prompt excluded.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Tokenizers given by duck typing (tests' stand-ins) may have only ``decode``.
        self._partial = getattr(tokenizer, "decode_partial", None)
        self._nothing = getattr(tokenizer, "decodes_to_nothing", None)
        self._window = [int(i) for i in prompt_ids if not self._drops(i)][-_KEEP:]
        # whether the window starts after the text's start
        self._continued = sum(not self._drops(i) for i in prompt_ids) > _KEEP
        text, held = self._decode()
        if text[len(text) - held :] != _FFFD * held:
            held = 0  # text a clean-up may still change (" " before "."): the prompt's own
        self._sent = len(text) - held  # characters of the window's text already accounted for
        self._accounted = text[: self._sent]  # (the prompt's, or emitted)
        self.text = ""

    def _drops(self, token_id: int) -> bool:
        return self._nothing is not None and self._nothing(int(token_id), self._skip)

    def _decode(self) -> tuple[str, int]:
        if self._partial is not None:
            return self._partial(self._window, self._skip, continued=self._continued)
        return self._tokenizer.decode(self._window, self._skip), 0

    @property
    def held_chars(self) -> int:
        """Characters decoded but held back (at most 3): the U+FFFD of an incomplete UTF-8
        sequence, or the start of a clean-up pattern (``Tokenizer.decode_partial``)."""
        return len(self._decode()[0]) - self._sent

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it makes final ("" while a character is incomplete).

        Ids the tokenizer decodes to nothing (a skipped special token, an id past the
        vocabulary) leave the window unchanged.
        """
        if self._drops(token_id):
            return ""
        self._window.append(int(token_id))
        text, held = self._decode()
        end = len(text) - held
        # Emitted text never changes (what may still change is held), but the prompt's may: a
        # clean-up joins its final " " to an output "." ("Hello " + "." is "Hello."); the output
        # text then starts where the decoding departs from the prompt's.
        start = min(self._sent, len(os.path.commonprefix([text, self._accounted])))
        delta = text[start:end]
        self._sent = max(start, end)
        self._accounted = text[: self._sent]
        if len(self._window) > 2 * _KEEP:  # keep the window short: O(1) work per id
            self._window, self._continued = self._window[-_KEEP:], True
            text, held = self._decode()
            self._sent = len(text) - held
            self._accounted = text[: self._sent]
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flushes what is held back (an unfinished character as the tokenizer decodes it:
        U+FFFD) at the end of the request; returns it ("" when nothing is held)."""
        text, _ = self._decode()
        delta = text[self._sent :]
        self._sent = len(text)
        self._accounted = text
        self.text += delta
        return delta
