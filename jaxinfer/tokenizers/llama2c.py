"""llama2.c ``tokenizer.bin``: our reader, and run.c's BPE encoder and decoder."""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from jaxinfer.errors import TokenizerError
from jaxinfer.tokenizers.base import (
    GrammarVocabulary,
    SideFiles,
    Tokenizer,
    incomplete_utf8_suffix,
    special_token_pattern,
    split_special,
    unique_ids,
)

_LLAMA2C_CHECKPOINT_MAGIC = 0x616B3432  # "ak42", llama2.c checkpoint format version >= 1
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer(Tokenizer):
    """llama2.c's ``tokenizer.bin`` with ``run.c``'s encoder and decoder.

    File layout (little-endian): ``i32 max_token_length``, then per token ``f32 score``,
    ``i32 len``, ``len`` bytes of UTF-8 piece (SentencePiece's U+2581 written as a space; BOS and
    EOS written as ``"\\n<s>\\n"`` and ``"\\n</s>\\n"``). BOS is 1, EOS is 2, byte ``b`` is id
    ``b + 3``. Source: karpathy/llama2.c ``run.c`` (build_tokenizer, encode, decode) and
    ``tokenizer.py`` (export).
    """

    def __init__(self, path: Path, side_files: SideFiles):
        self.max_token_length, self._scores, self._pieces = read_llama2c_tokenizer(path)
        self.vocab_size = len(self._pieces)
        self._ids: dict[bytes, int] = {}
        for i, p in enumerate(self._pieces):
            self._ids.setdefault(p, i)  # run.c's bsearch; pieces are unique in exported files
        self.bos_id, self.add_bos = 1, True
        self.eos_ids = unique_ids([2, *side_files.eos_ids])
        self._special_ids = frozenset((1, 2))
        special = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        } | side_files.tokens
        super().__init__(path, special, side_files.chat_template)
        # The text of a special token is its id: run.c writes BOS and EOS as "\n<s>\n" and
        # "\n</s>\n", so those are matched by name; others by their piece.
        self._special_text = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for t in [*special.values(), *side_files.added_tokens]:
            if (i := self._ids.get(t.encode("utf-8"))) is not None:
                self._special_text.setdefault(t, i)
        self._special_re = special_token_pattern(self._special_text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """run.c's encoder, on each piece of ``text`` between the special tokens it contains
        (``<s>``, ``</s>``, ``<unk>`` and the side files' tokens: one id each, as transformers
        reads them); only a piece at the start of ``text`` gets run.c's dummy-prefix space (the
        rule of transformers' Llama tokenizers)."""
        ids: list[int] = []
        for k, part in enumerate(split_special(text, self._special_re, self._special_text)):
            ids += [part] if isinstance(part, int) else self._encode_text(part, prefix=k == 0)
        return [self.bos_id, *ids] if add_special_tokens else ids

    def _encode_text(self, text: str, prefix: bool) -> list[int]:
        ids: list[int] = []
        # The dummy-prefix space, then one piece per UTF-8 character; byte fallback (id b + 3).
        pieces = [c.encode("utf-8", "surrogatepass") for c in text]
        for piece in ([b" "] if prefix else []) + pieces:
            i = self._ids.get(piece)
            if i is None:
                ids.extend(b + 3 for b in piece)
            else:
                ids.append(i)
        return self._merge(ids)

    def _merge(self, ids: list[int]) -> list[int]:
        """run.c's merge loop (repeatedly merge the adjacent pair whose concatenation is the
        best-scoring vocabulary piece, leftmost on ties), with a heap instead of a rescan."""
        n = len(ids)
        tok, nxt, prv, alive = list(ids), list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        heap: list[tuple[float, int, int]] = []  # (-score, left position, merged id)

        def push(left: int) -> None:
            right = nxt[left]
            if right < n:
                merged = self._ids.get(self._pieces[tok[left]] + self._pieces[tok[right]])
                if merged is not None:
                    heapq.heappush(heap, (-self._scores[merged], left, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left] if alive[left] else n
            if (
                right >= n
                or self._pieces[tok[left]] + self._pieces[tok[right]] != (self._pieces[merged])
            ):
                continue  # stale: a neighbour was merged since this pair was pushed
            tok[left], alive[right] = merged, False
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left])
            push(left)
        return [t for t, a in zip(tok, alive, strict=True) if a]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """Each piece's bytes (``<0xNN>`` as byte NN; BOS, EOS and ``<unk>`` b""), and run.c's
        encoder without the dummy-prefix space (a text that continues another)."""
        special = set(self._special_ids) | {0}

        def piece_bytes(i: int) -> bytes:
            if i in special:
                return b""
            m = _BYTE_PIECE.fullmatch(self._pieces[i])
            return bytes([int(m.group(1), 16)]) if m else self._pieces[i]

        return GrammarVocabulary(
            token_bytes=tuple(piece_bytes(i) for i in range(self.vocab_size)),
            encode=lambda text: self._encode_text(text, prefix=False),
            special_ids=tuple(sorted(special)),
        )

    def decode_partial(
        self, ids: Sequence[int], skip_special_tokens: bool = True, continued: bool = False
    ) -> tuple[str, int]:
        del continued  # the start rules (Strip, run.c's) touch the first piece only
        # Python's "replace" writes one U+FFFD for an incomplete sequence at the end.
        data = self._bytes(ids, skip_special_tokens)
        return data.decode("utf-8", errors="replace"), min(incomplete_utf8_suffix(data), 1)

    def _bytes(self, ids: Sequence[int], skip_special_tokens: bool) -> bytes:
        """The bytes run.c prints for ``ids``. run.c drops the leading space of the piece after
        BOS; we drop it from the first non-special piece (the same whenever ids start with BOS,
        and SentencePiece's rule)."""
        out = bytearray()
        at_start = True
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                continue
            piece = self._pieces[i]
            if i in self._special_ids:
                if not skip_special_tokens:
                    out += piece.strip(b"\n")
                continue
            if at_start and piece.startswith(b" "):
                piece = piece[1:]
            at_start = False
            m = _BYTE_PIECE.fullmatch(piece)
            out += bytes([int(m.group(1), 16)]) if m else piece
        return bytes(out)


def read_llama2c_tokenizer(path: Path) -> tuple[int, list[float], list[bytes]]:
    """Parses a llama2.c tokenizer file. Raises TokenizerError if it is not one."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
    if _looks_like_llama2c_checkpoint(data):
        raise TokenizerError(f"{path} is a llama2.c model checkpoint, not a tokenizer file")
    bad = TokenizerError(f"{path} is not a llama2.c tokenizer file (i32 max_token_length, then "
                         "(f32 score, i32 len, bytes) records)")  # fmt: skip
    if len(data) < 4:
        raise bad
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len < 1 << 16:
        raise bad
    scores, pieces, off = [], [], 4
    while off < len(data):
        if off + 8 > len(data):
            raise bad
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if not 0 <= n <= max_len or off + n > len(data):
            raise bad
        scores.append(score)
        pieces.append(data[off : off + n])
        off += n
    if not pieces:
        raise bad
    if len(pieces) < 259:  # run.c's byte fallback encodes byte b as id b + 3
        raise TokenizerError(
            f"{path} holds {len(pieces)} tokens; a llama2.c tokenizer has at least 259 (<unk>, "
            "BOS, EOS and the 256 byte pieces <0x00>..<0xFF> at ids 3..258): is it truncated?"
        )
    return max_len, scores, pieces


def _looks_like_llama2c_checkpoint(data: bytes) -> bool:
    if len(data) < 28:
        return False
    if struct.unpack_from("<I", data, 0)[0] == _LLAMA2C_CHECKPOINT_MAGIC:
        return True
    dim, hidden, layers, heads, kv_heads, vocab, seq = struct.unpack_from("<7i", data, 0)
    # A legacy checkpoint: seven positive config ints (vocab may be negative: unshared classifier),
    # and far more bytes than a tokenizer of that vocabulary.
    return (
        min(dim, hidden, layers, heads, kv_heads, seq) > 0
        and abs(vocab) > 0
        and len(data) >= 4 * dim * abs(vocab)
    )
