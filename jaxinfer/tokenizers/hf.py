"""Hugging Face ``tokenizer.json`` tokenizers, run by the ``tokenizers`` library."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from jaxinfer.errors import TokenizerError
from jaxinfer.tokenizers.base import (
    GrammarVocabulary,
    SideFiles,
    Tokenizer,
    incomplete_utf8_suffix,
    unique_ids,
)

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
        # transformers' clean-up (" ." -> "."); transformers 5 skips it for BPE models, as
        # destructive there, unless told otherwise.
        model_type = (spec.get("model") or {}).get("type")
        self._cleanup = side_files.clean_up_tokenization_spaces and (
            model_type != "BPE" or side_files.clean_up_bpe
        )
        kinds = _decoder_types(spec.get("decoder"))
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
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

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The ``tokenizer.json`` as ``tokenizers`` holds it (added tokens included); the
        grammar engine reads its tokens itself."""
        return GrammarVocabulary(
            tokenizer_json=self._tok.to_str(), special_ids=tuple(sorted(self._special_ids))
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The ``tokenizers`` decoding, except for invalid byte tokens under a ``ByteFallback``
        decoder: ``tokenizers`` turns a run of byte tokens that is not valid UTF-8 into one
        U+FFFD per byte, valid characters in it included; here only the bytes that are not part
        of a valid character become U+FFFD (SentencePiece's rule), so that text already streamed
        stays right when later bytes turn out invalid."""
        text = self._decode_raw(ids, skip_special_tokens)
        return _clean_up_tokenization(text) if self._cleanup else text

    def _decode_raw(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = [int(i) for i in ids if 0 <= i < self.vocab_size]
        text = None
        if self._byte_fallback:
            tokens = [
                self._tok.id_to_token(i)
                for i in ids
                if not (skip_special_tokens and i in self._special_ids)
            ]
            if (fixed := _split_invalid_byte_runs(tokens)) is not None:
                text = self._tok.decoder.decode(fixed)
        if text is None:
            text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def decode_partial(
        self, ids: Sequence[int], skip_special_tokens: bool = True, continued: bool = False
    ) -> tuple[str, int]:
        del continued  # the start rules (Strip, run.c's) touch the first piece only
        # Only ByteLevel tokens (characters standing for bytes) and ByteFallback's <0xNN> tokens
        # can hold part of a character. ByteLevel decodes all bytes at once with Rust's
        # from_utf8_lossy (one U+FFFD for an incomplete sequence); ByteFallback, one per byte.
        raw = self._decode_raw(ids, skip_special_tokens)
        text, held = raw, 0
        if self._cleanup:
            # The clean-up's replacements run one after another over the whole text, so what a
            # later " ." or " n't" may change is found by trying every way to complete one.
            text = _clean_up_tokenization(raw)
            probes = [_clean_up_tokenization(raw + p) for p in _CLEANUP_PROBES]
            held = len(text) - len(os.path.commonprefix([text, *probes]))
        if not (self._byte_level or self._byte_fallback):
            return text, held
        tail = b""
        for i in reversed(ids):
            i = int(i)
            if self.decodes_to_nothing(i, skip_special_tokens):
                continue
            token = self._tok.id_to_token(i)
            if self._byte_level:
                if any(c not in _UNICODE_TO_BYTE for c in token):
                    part = token.encode("utf-8")  # the decoder's fallback: the text as it is
                else:
                    part = bytes(_UNICODE_TO_BYTE[c] for c in token)
            elif m := _BYTE_TOKEN.fullmatch(token):
                part = bytes([int(m.group(1), 16)])
            else:
                break  # a token of whole characters
            tail = part + tail
            if len(tail) >= 3:
                break
        utf8 = incomplete_utf8_suffix(tail)
        return text, max(held, min(utf8, 1) if self._byte_level else utf8)


def _decoder_types(decoder: dict | None) -> set[str]:
    """The ``type`` of a ``tokenizer.json`` decoder and of those in a ``Sequence``."""
    if not isinstance(decoder, dict):
        return set()
    found = {decoder.get("type")}
    for d in decoder.get("decoders") or []:
        found |= _decoder_types(d)
    return found


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel tokens are written in (openai/
    gpt-2 ``encoder.py``, ``bytes_to_unicode``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _gpt2_bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _split_invalid_byte_runs(tokens: list[str]) -> list[str] | None:
    """``tokens`` with every byte token (``<0xNN>``) that is not part of a valid UTF-8 character
    of its run replaced by a U+FFFD token, so that ``ByteFallback`` decodes each remaining run
    whole; None when every run is valid UTF-8 (nothing to replace)."""
    out: list[str] = []
    changed = False
    i = 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and _BYTE_TOKEN.fullmatch(tokens[j]):
            j += 1
        if j == i:
            out.append(tokens[i])
            i += 1
            continue
        run = bytes(int(t[3:5], 16) for t in tokens[i:j])
        k = 0
        while k < len(run):  # at each byte: a whole valid character, or U+FFFD for this byte
            n = next((n for n in (1, 2, 3, 4) if _is_one_char(run[k : k + n])), 0)
            if n:
                out += tokens[i + k : i + k + n]
                k += n
            else:
                out.append("\ufffd")
                changed = True
                k += 1
        i = j
    return out if changed else None


def _is_one_char(data: bytes) -> bool:
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


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


_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_CLEANUP_PROBES = sorted({a[n:] for a, _ in _CLEANUP for n in range(1, len(a))} | {"x"})


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (used when clean_up_tokenization_spaces is set)."""
    for a, b in _CLEANUP:
        text = text.replace(a, b)
    return text
