"""Hugging Face ``tokenizer.json`` tokenizers, run by the ``tokenizers`` library."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jaxinfer.errors import TokenizerError
from jaxinfer.tokenizers.base import SideFiles, Tokenizer, unique_ids

_USUAL_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, run by the ``tokenizers`` library."""

    def __init__(self, path: Path, side_files: SideFiles):
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        id_of = self._tok.token_to_id

        pp_bos = _template_first_special(spec.get("post_processor"))
        bos = side_files.tokens.get("bos_token") or pp_bos
        self.bos_id = id_of(bos) if bos is not None else None
        eos = side_files.tokens.get("eos_token")
        self.eos_ids = unique_ids(([id_of(eos)] if eos else []) + side_files.eos_ids)
        if not self.eos_ids:  # no side files: the usual names of the end-of-text token
            self.eos_ids = unique_ids(
                [id_of(t) for t in _USUAL_EOS if id_of(t) in self._special_ids]
            )
        # What the post-processor does; tokenizer_config.json's add_bos_token overrides it.
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        without = self._tok.encode("a", add_special_tokens=False).ids
        self._pp_adds_bos = (
            self.bos_id is not None
            and len(with_special) > len(without)
            and with_special[0] == self.bos_id
        )
        add_bos = side_files.add_bos if side_files.add_bos is not None else self._pp_adds_bos
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self._cleanup = side_files.clean_up_tokenization_spaces
        special = dict(side_files.tokens)
        if bos is not None:
            special.setdefault("bos_token", bos)
        super().__init__(path, special, side_files.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos != self._pp_adds_bos:
            if self.add_bos:
                ids = [self.bos_id, *ids]
            elif ids and ids[0] == self.bos_id:
                ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(
            [int(i) for i in ids if 0 <= i < self.vocab_size],
            skip_special_tokens=skip_special_tokens,
        )
        return _clean_up_tokenization(text) if self._cleanup else text


def _template_first_special(post_processor: dict | None) -> str | None:
    """The special token a ``TemplateProcessing`` post-processor puts first, e.g. ``<s>``."""
    if not post_processor:
        return None
    if post_processor.get("type") == "Sequence":
        for p in post_processor.get("processors", []):
            if (found := _template_first_special(p)) is not None:
                return found
        return None
    if post_processor.get("type") == "TemplateProcessing":
        single = post_processor.get("single") or []
        if single and "SpecialToken" in single[0]:
            return single[0]["SpecialToken"]["id"]
    return None


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (used when clean_up_tokenization_spaces is set)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(a, b)
    for a, b in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
