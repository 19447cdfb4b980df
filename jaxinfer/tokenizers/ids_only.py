"""Running a model without a tokenizer (vLLM's ``skip_tokenizer_init``): token ids in, token ids
out, no text.

``IdsOnlyTokenizer`` stands in for the tokenizer inside the engine: it carries the special ids the
engine stops on, read from the checkpoint's own config (``config_special_ids``), and refuses every
operation that needs text with a ``RequestError`` that says to pass ``prompt_token_ids``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from jaxinfer.errors import CheckpointError, RequestError
from jaxinfer.models.config import ModelConfig
from jaxinfer.tokenizers.base import Tokenizer, unique_ids

# llama2.c's convention (run.c, tokenizer.bin): BOS = 1, EOS = 2.
LLAMA2C_BOS, LLAMA2C_EOS = 1, 2


class NoTokenizerWarning(UserWarning):
    """A model was loaded without a tokenizer: only ``prompt_token_ids`` prompts can run."""


def _ids_field(value, where: str, field: str, vocab_size: int) -> list[int]:
    """A config's special-id field (None, an int or a list of ints) as a list. Raises
    CheckpointError naming ``where`` and ``field`` for any other value or an id outside the
    vocabulary."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise CheckpointError(
                f"{where}: {field} must be an integer or a list of integers, got {value!r}"
            )
        if not 0 <= v < vocab_size:
            raise CheckpointError(
                f"{where}: {field} {v} is outside the vocabulary [0, {vocab_size})"
            )
    return values


def config_special_ids(
    cfg: ModelConfig, path: str | os.PathLike
) -> tuple[int | None, tuple[int, ...]]:
    """(BOS id, EOS ids) of a checkpoint from its own files, for running it without a tokenizer.

    llama2.c checkpoints (``cfg.model_type == "llama2c"``, also once quantized) use BOS = 1,
    EOS = 2. Hugging Face checkpoints give ``eos_token_id`` (an int or a list) and
    ``bos_token_id`` in ``generation_config.json`` and ``config.json`` (at the top level or in
    ``text_config``); the EOS ids of both are kept, generation_config.json's first, as the
    tokenizer's side files are read (``tokenizers.base.SideFiles``).

    Args:
        cfg: the loaded model's config (its vocabulary bounds the ids).
        path: the checkpoint directory, or a file in it.

    Raises:
        CheckpointError: a file is not valid JSON, or an id field is not an integer / list of
            integers in ``[0, vocab_size)`` (the message names the file and the field).
    """
    if cfg.model_type == "llama2c":
        return LLAMA2C_BOS, (LLAMA2C_EOS,)
    d = Path(path)
    d = d if d.is_dir() else d.parent
    bos: int | None = None
    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = d / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e
        if not isinstance(data, dict):
            continue  # the loader names a config.json that is not an object
        sections = [(data, "")]
        if isinstance(data.get("text_config"), dict):
            sections.append((data["text_config"], "text_config."))
        for section, prefix in sections:
            eos += _ids_field(
                section.get("eos_token_id"), str(file), prefix + "eos_token_id", cfg.vocab_size
            )
            b = _ids_field(
                section.get("bos_token_id"), str(file), prefix + "bos_token_id", cfg.vocab_size
            )
            if bos is None and b:
                bos = b[0]
    return bos, unique_ids(eos)


def no_tokenizer_message(model: str | os.PathLike, what: str) -> str:
    """The error of a request that needs text on a model without a tokenizer."""
    return (
        f"{what} needs a tokenizer, and the model {model} runs without one (none was found "
        "beside it, or skip_tokenizer_init is set): pass prompt_token_ids (and stop_token_ids "
        "instead of stop strings), or pass tokenizer=PATH"
    )


class IdsOnlyTokenizer(Tokenizer):
    """The engine's tokenizer for a model run without one: special ids only, no text.

    Attributes:
        has_text: False (the engine keeps no detokenizer and outputs no text).
        vocab_size, bos_id, eos_ids, add_bos, chat_template, path: as ``Tokenizer`` (``bos_id`` and
            ``eos_ids`` from ``config_special_ids``; ``add_bos`` False; no chat template).
    """

    has_text = False

    def __init__(self, cfg: ModelConfig, path: str | os.PathLike):
        self.vocab_size = cfg.vocab_size
        self.bos_id, self.eos_ids = config_special_ids(cfg, path)
        self.add_bos = False
        super().__init__(Path(path), {}, None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raises RequestError: there is no vocabulary to encode with."""
        raise RequestError(no_tokenizer_message(self.path, "a text prompt"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Raises RequestError: there is no vocabulary to decode with."""
        raise RequestError(no_tokenizer_message(self.path, "decoding text"))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """Raises RequestError: chat needs a tokenizer."""
        raise RequestError(no_tokenizer_message(self.path, "a chat ('messages') request"))
