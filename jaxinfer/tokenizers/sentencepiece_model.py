"""SentencePiece ``*.model`` tokenizers (Llama 1/2, Mistral, Gemma, llama2.c's ``tok512.model``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jaxinfer.errors import TokenizerError
from jaxinfer.tokenizers.base import SideFiles, Tokenizer, unique_ids


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._sp.encode(text) if text else []
        return [self.bos_id, *ids] if add_special_tokens and self.add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # SentencePiece drops control ids itself and strips the dummy-prefix space of the first
        # piece; special tokens kept in the text are spliced in between decoded runs.
        out, run = [], []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                continue
            if self.is_special(i):
                if not skip_special_tokens:
                    out.append(self._decode_run(run, at_start=not out))
                    out.append(self._sp.id_to_piece(i))
                    run = []
            else:
                run.append(i)
        out.append(self._decode_run(run, at_start=not out))
        return "".join(out)

    def _decode_run(self, run: list[int], at_start: bool) -> str:
        # SentencePiece strips the dummy-prefix space of a run's first piece; after a special token
        # kept in the text the space stays (transformers: "<s> Hello").
        text = self._sp.decode(run)
        if run and not at_start and self._sp.id_to_piece(run[0]).startswith("\u2581"):
            text = " " + text
        return text


def _piece(sp, i: int | None) -> str | None:
    return sp.id_to_piece(i) if i is not None and i >= 0 else None
