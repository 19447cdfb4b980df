"""The tokenizer interface, chat-template rendering, and the Hugging Face side files."""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxinfer.errors import TokenizerError


class Tokenizer:
    """What the engine needs from a tokenizer; implemented by HFTokenizer, SentencePieceTokenizer
    and Llama2cTokenizer.

    Attributes:
        vocab_size: number of ids the tokenizer can produce (added tokens included).
        bos_id: beginning-of-sequence id, or None when the tokenizer has none.
        eos_ids: every id that ends generation (the tokenizer's EOS, then those of
            ``generation_config.json`` / ``config.json``), without duplicates.
        add_bos: whether ``encode(text, add_special_tokens=True)`` prepends ``bos_id``.
        chat_template: jinja2 source, or None.
        path: the file the vocabulary was read from (for error messages).
        has_text: False only for ``IdsOnlyTokenizer``, the stand-in of a model run without a
            tokenizer (token ids in and out, no text).
    """

    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None
    path: Path
    has_text: bool = True
    _special_ids: frozenset[int] = frozenset()  # control / special added tokens of the backend

    def __init__(self, path: Path, special_tokens: dict[str, str], chat_template: str | None):
        self.path = path
        self._special_tokens = special_tokens  # template variables: bos_token, eos_token, ...
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` and ``add_bos``, BOS first.

        An empty text gives ``[bos_id]`` (or ``[]`` without BOS).
        """
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Invalid UTF-8 byte sequences decode to U+FFFD; ids outside the
        vocabulary (a model's padded embedding rows) decode to nothing."""
        raise NotImplementedError

    def decode_partial(
        self, ids: Sequence[int], skip_special_tokens: bool = True, continued: bool = False
    ) -> tuple[str, int]:
        """``decode(ids)`` and how many characters at its end (0 to 3) later ids may still change:
        the U+FFFD of an incomplete UTF-8 sequence (the first 1 to 3 bytes of a character, valid
        so far), or the start of a clean-up pattern (``HFTokenizer`` with
        ``clean_up_tokenization_spaces``: " ", " '", " n", ...). Everything before them is final:
        appending ids never changes it. The streaming detokenizer holds back exactly them.

        ``continued``: ``ids`` follow earlier text (the detokenizer's window), so no rule for the
        start of a text that reaches past the first piece applies (SentencePiece's dropping of
        all leading spaces under ``remove_extra_whitespaces``); rules for the first piece alone
        (its dummy-prefix space) may, the window's first ids being context only.

        This default suits tokenizers whose tokens are whole characters (no byte tokens): 0.
        """
        del continued  # rules for the first piece only: that piece is context
        return self.decode(ids, skip_special_tokens), 0

    def decodes_to_nothing(self, token_id: int, skip_special_tokens: bool = True) -> bool:
        """Whether ``decode`` drops ``token_id`` wherever it stands (an id outside the vocabulary,
        or a special token when ``skip_special_tokens``): removing it changes no decoded text."""
        token_id = int(token_id)
        return not 0 <= token_id < self.vocab_size or (
            skip_special_tokens and token_id in self._special_ids
        )

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """What a grammar engine needs to know of this vocabulary (``GrammarVocabulary``), for
        constrained decoding (``jaxinfer.sampling.structured``).

        Raises:
            TokenizerError: the tokenizer cannot describe its tokens as bytes (the default:
                ``IdsOnlyTokenizer`` and duck-typed tokenizers).
        """
        raise TokenizerError(
            f"{self.path}: this tokenizer ({type(self).__name__}) cannot list its tokens as "
            "bytes, which constrained decoding (structured_outputs) needs"
        )

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token: BOS, EOS or a marked added token."""
        return token_id == self.bos_id or token_id in self.eos_ids or token_id in self._special_ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """Renders ``messages`` with the tokenizer's chat template, as transformers'
        ``apply_chat_template(messages, tools=..., tokenize=False, add_generation_prompt=...)``,
        within the time, size and depth limits of ``chat_template.py``. ``tools``: the
        functions the model may call (OpenAI's ``[{"type": "function", "function": {...}}]``),
        the template's ``tools`` variable.

        Raises:
            TokenizerError: the tokenizer has no chat template.
            ChatTemplateError (a TokenizerError): ``messages`` is not a list of dicts with a
                string ``role``, the template does not compile, it raised (``raise_exception``,
                or any Python error such as ``1/0``), or it went past a rendering limit.
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.path}: the tokenizer has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja beside it); give one with "
                "--chat-template FILE or LLM(chat_template=FILE)"
            )
        from jaxinfer.tokenizers.chat_template import ChatTemplateError, render_chat_template

        if not isinstance(messages, list):
            raise ChatTemplateError(
                f"messages must be a list of {{'role', 'content'}} dicts, not "
                f"{type(messages).__name__}"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ChatTemplateError(f"messages[{i}] must be a dict, not {type(m).__name__}")
            if not isinstance(m.get("role"), str):
                raise ChatTemplateError(
                    f"messages[{i}]['role'] must be a string, not {type(m.get('role')).__name__}"
                )
        variables = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
            documents=None,
            **self._special_tokens,
        )
        return render_chat_template(self.chat_template, variables, where=str(self.path))


@dataclasses.dataclass(frozen=True)
class GrammarVocabulary:
    """A vocabulary as a grammar engine (llguidance) reads it: either the ``tokenizer.json``
    text (``tokenizer_json``: the library reads the tokens itself), or each id's bytes inside a
    text (``token_bytes``: b"" for control, unknown and special ids, which a grammar never
    allows) with an encoder of text that continues a text (``encode``: no BOS, no dummy-prefix
    space), used for the tokens a grammar forces.

    Attributes:
        tokenizer_json: a Hugging Face ``tokenizer.json`` as text, or None.
        token_bytes: bytes[vocab_size] per id, or None (with ``tokenizer_json``).
        encode: text -> ids, or None (with ``tokenizer_json``).
        special_ids: control / special ids (never allowed by a grammar; EOS apart).
    """

    tokenizer_json: str | None = None
    token_bytes: tuple[bytes, ...] | None = None
    encode: Callable[[str], list[int]] | None = None
    special_ids: tuple[int, ...] = ()


class SideFiles:
    """What the Hugging Face side files say about a tokenizer (all optional)."""

    def __init__(self, directory: Path):
        tc = _read_json(directory / "tokenizer_config.json")
        stm = _read_json(directory / "special_tokens_map.json")
        self.tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tc.get(key, stm.get(key))
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self.tokens[key] = value
        self.add_bos: bool | None = tc.get("add_bos_token")
        # transformers' added tokens (special or not): their text is one token wherever it occurs.
        added = tc.get("added_tokens_decoder")
        self.added_tokens: list[str] = [
            t["content"]
            for t in (added.values() if isinstance(added, dict) else [])
            if isinstance(t, dict) and isinstance(t.get("content"), str) and t["content"]
        ]
        self.clean_up_tokenization_spaces = bool(tc.get("clean_up_tokenization_spaces", False))
        # transformers 5 ignores the clean-up for a BPE model unless this is set as well
        self.clean_up_bpe = bool(
            tc.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        template = tc.get("chat_template")
        where = directory / "tokenizer_config.json"
        if isinstance(template, list):
            # [{"name": ..., "template": ...}]: transformers uses the one named "default".
            if not all(isinstance(t, dict) for t in template):
                raise TokenizerError(
                    f"{where}: chat_template must be a string or a list of "
                    '{"name", "template"} objects'
                )
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(
                f"{where}: chat_template must be a string, got {type(template).__name__}"
            )
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_file}: cannot read the chat template: {e}") from None
        self.chat_template: str | None = template
        self.eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(directory / name).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [eos]
            self.eos_ids += [e for e in eos if isinstance(e, int) and e >= 0]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def unique_ids(ids: list[int | None]) -> tuple[int, ...]:
    """``ids`` without Nones and repeats, in first-seen order."""
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def incomplete_utf8_suffix(data: bytes) -> int:
    """Length (0 to 3) of the incomplete UTF-8 sequence at the end of ``data``: a lead byte and
    fewer continuation bytes than it needs, each valid so far (so more bytes may complete it).
    Python's incremental UTF-8 decoder is the judge: it holds back exactly these bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-3:], final=False)  # an incomplete sequence is at most 3 bytes long
    tail = decoder.getstate()[0]
    if len(tail) < 2:
        return len(tail)  # a lone valid lead byte (C2..F4)
    # CPython also holds back a surrogate's first two bytes (ED A0..BF), which nothing completes;
    # past the second byte any continuation byte fits, so 0x80s complete every other prefix.
    need = 4 if tail[0] >= 0xF0 else 3 if tail[0] >= 0xE0 else 2
    try:
        (tail + b"\x80" * (need - len(tail))).decode("utf-8")
    except UnicodeDecodeError:
        return 0
    return len(tail)


def special_token_pattern(tokens: dict[str, int]) -> re.Pattern | None:
    """A regex matching any of ``tokens`` (text -> id), the longest first where several start at
    one place (transformers' added-tokens trie splits at the leftmost longest match); None if
    there are none."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def split_special(text: str, pattern: re.Pattern | None, tokens: dict[str, int]) -> list[str | int]:
    """``text`` cut at the special tokens it contains, as transformers cuts it before running
    the model's tokenizer on the pieces between them: texts (non-empty) and token ids, in order."""
    if pattern is None:
        return [text] if text else []
    out: list[str | int] = []
    start = 0
    for m in pattern.finditer(text):
        if m.start() > start:
            out.append(text[start : m.start()])
        out.append(tokens[m.group()])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out
