"""SentencePiece ``*.model`` tokenizers (Llama 1/2, Mistral, Gemma, llama2.c's ``tok512.model``)."""

from __future__ import annotations

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


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``*.model`` (Llama 1/2, Mistral, Gemma, llama2.c's ``tok512.model``)."""

    def __init__(self, path: Path, side_files: SideFiles):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise TokenizerError(f"cannot read SentencePiece model {path}: {e}") from e
        sp = self._sp
        self.vocab_size = sp.get_piece_size()
        self._special_ids = frozenset(i for i in range(self.vocab_size) if sp.is_control(i))

        def id_of(token: str | None) -> int | None:
            if token is None:
                return None
            i = sp.piece_to_id(token)
            return None if i == sp.unk_id() and token != sp.id_to_piece(i) else i

        bos = id_of(side_files.tokens.get("bos_token"))
        self.bos_id = bos if bos is not None else (sp.bos_id() if sp.bos_id() >= 0 else None)
        eos = id_of(side_files.tokens.get("eos_token"))
        eos = eos if eos is not None else (sp.eos_id() if sp.eos_id() >= 0 else None)
        self.eos_ids = unique_ids(([eos] if eos is not None else []) + side_files.eos_ids)
        add_bos = side_files.add_bos if side_files.add_bos is not None else True
        self.add_bos = add_bos and self.bos_id is not None
        special = {"bos_token": _piece(sp, self.bos_id), "eos_token": _piece(sp, eos)}
        special |= {"unk_token": _piece(sp, sp.unk_id()), "pad_token": _piece(sp, sp.pad_id())}
        special = {k: v for k, v in special.items() if v is not None} | side_files.tokens
        super().__init__(path, special, side_files.chat_template)
        texts = [*special.values(), *side_files.added_tokens]
        texts += [sp.id_to_piece(i) for i in self._special_ids | {sp.unk_id()}]
        self._special_text = {t: i for t in texts if (i := id_of(t)) is not None}
        self._special_re = special_token_pattern(self._special_text)
        self._unk_text = sp.id_to_piece(sp.unk_id())
        self._anchor = next((i for i in range(self.vocab_size) if _plain_text(sp, i)), None)
        if self._anchor is None:
            raise TokenizerError(f"{path}: every piece is special, a byte or starts with a space")
        self._anchor_text = sp.decode([self._anchor])
        self._unk_len = len(sp.encode(self._unk_text))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """SentencePiece's encoding of each piece of ``text`` between the special tokens it
        contains (control pieces such as ``<s>``, ``<unk>``, the side files' tokens: one id each),
        as transformers' Llama tokenizers split it: only a piece at the start of ``text`` gets
        the dummy-prefix space."""
        ids: list[int] = []
        for k, part in enumerate(split_special(text, self._special_re, self._special_text)):
            if isinstance(part, int):
                ids.append(part)
            elif k == 0:
                ids += self._sp.encode(part)
            else:
                ids += self._encode_continuation(part)
        return [self.bos_id, *ids] if add_special_tokens and self.add_bos else ids

    def _encode_continuation(self, text: str) -> list[int]:
        # transformers' SentencePiece tokenizer (legacy=False): encode "<unk>" + text and
        # drop the pieces of "<unk>", so SentencePiece adds no dummy prefix to the text.
        return self._sp.encode(self._unk_text + text)[self._unk_len :]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens, at_start=True)

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """Each piece's bytes (U+2581 as a space, ``<0xNN>`` as byte NN, control and unknown
        pieces b""), and the encoder of a text that continues another (no dummy prefix)."""
        sp = self._sp

        def piece_bytes(i: int) -> bytes:
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or i in self._special_ids:
                return b""
            p = sp.id_to_piece(i)
            if sp.is_byte(i):
                return bytes([int(p[3:5], 16)])
            return p.replace("\u2581", " ").encode("utf-8")

        return GrammarVocabulary(
            token_bytes=tuple(piece_bytes(i) for i in range(self.vocab_size)),
            encode=self._encode_continuation,
            special_ids=tuple(sorted(self._special_ids | {sp.unk_id()})),
        )

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool, at_start: bool) -> str:
        # SentencePiece drops control ids itself (a run of byte pieces ends there) and strips the
        # dummy-prefix space of the first piece; special tokens kept in the text are spliced in
        # between decoded runs.
        out, run = [], []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                continue
            if self.is_special(i):
                if not skip_special_tokens:
                    out.append(self._decode_run(run, at_start=at_start and not out))
                    out.append(self._sp.id_to_piece(i))
                    run = []
                elif self._sp.is_control(i):
                    run.append(i)
            else:
                run.append(i)
        out.append(self._decode_run(run, at_start=at_start and not out))
        return "".join(out)

    def decode_partial(
        self, ids: Sequence[int], skip_special_tokens: bool = True, continued: bool = False
    ) -> tuple[str, int]:
        # SentencePiece writes one U+FFFD per byte of an incomplete sequence. Only byte pieces
        # (<0xNN>) can hold part of a character; any other piece ends in a whole one.
        tail = bytearray()
        for i in reversed(ids):
            i = int(i)
            if self.decodes_to_nothing(i, skip_special_tokens):
                continue
            if len(tail) == 3 or self.is_special(i) or not self._sp.is_byte(i):
                break
            tail[:0] = bytes([int(self._sp.id_to_piece(i)[3:5], 16)])
        text = self._decode(ids, skip_special_tokens, at_start=not continued)
        return text, incomplete_utf8_suffix(bytes(tail))

    def decodes_to_nothing(self, token_id: int, skip_special_tokens: bool = True) -> bool:
        # A skipped control id is not nothing: it ends a run of byte pieces.
        token_id = int(token_id)
        return not 0 <= token_id < self.vocab_size or (
            skip_special_tokens and self.is_special(token_id) and not self._sp.is_control(token_id)
        )

    def _decode_run(self, run: list[int], at_start: bool) -> str:
        # SentencePiece strips the dummy-prefix space of the text's first piece (all its leading
        # spaces under remove_extra_whitespaces); elsewhere, after a special token kept in the text
        # (transformers: "<s> Hello") or in a streaming window, the spaces stay: the run is
        # decoded after an anchor piece of ordinary text, which is then cut off.
        if at_start or not run:
            return self._sp.decode(run)
        return self._sp.decode([self._anchor, *run])[len(self._anchor_text) :]


def _plain_text(sp, i: int) -> bool:
    """Whether piece ``i`` is ordinary text that does not start with a space (an anchor)."""
    if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i):
        return False
    piece = sp.id_to_piece(i)
    return bool(piece) and not piece.startswith("\u2581") and bool(sp.decode([i]).strip())


def _piece(sp, i: int | None) -> str | None:
    return sp.id_to_piece(i) if i is not None and i >= 0 else None
