"""The tokenizer interface, chat-template rendering, and the Hugging Face side files."""

from __future__ import annotations

import json
from collections.abc import Sequence
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

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token: BOS, EOS or a marked added token."""
        return token_id == self.bos_id or token_id in self.eos_ids or token_id in self._special_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Renders ``messages`` with the tokenizer's chat template, as transformers'
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``, within the
        time, size and depth limits of ``chat_template.py``.

        Raises:
            TokenizerError: the tokenizer has no chat template.
            ChatTemplateError (a TokenizerError): ``messages`` is not a list of dicts with a
                string ``role``, the template does not compile, it raised (``raise_exception``,
                or any Python error such as ``1/0``), or it went past a rendering limit.
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.path}: the tokenizer has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja beside it)"
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
            tools=None,
            documents=None,
            **self._special_tokens,
        )
        return render_chat_template(self.chat_template, variables, where=str(self.path))


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
        self.clean_up_tokenization_spaces = bool(tc.get("clean_up_tokenization_spaces", False))
        template = tc.get("chat_template")
        if isinstance(template, list):
            # [{"name": ..., "template": ...}]: transformers uses the one named "default".
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
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
