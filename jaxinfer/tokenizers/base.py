"""The tokenizer interface, chat-template rendering, and the Hugging Face side files."""

from __future__ import annotations

import datetime
import functools
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
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``.

        Raises:
            TokenizerError: the tokenizer has no chat template, the template does not compile, or
                it calls ``raise_exception`` (for example on an unsupported role order).
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.path}: the tokenizer has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja beside it)"
            )
        import jinja2

        try:
            template = _compile_chat_template(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special_tokens,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.path}: chat template error: {e}") from e


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str):
    """Compiles ``source`` in the jinja2 environment of transformers' ``_compile_jinja_template``
    (``transformers/utils/chat_template_utils.py``)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


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
