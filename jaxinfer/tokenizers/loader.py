"""``load_tokenizer``: finds a checkpoint's tokenizer file and picks its backend."""

from __future__ import annotations

import os
from pathlib import Path

from jaxinfer.errors import TokenizerError
from jaxinfer.tokenizers.base import SideFiles, Tokenizer
from jaxinfer.tokenizers.hf import HFTokenizer
from jaxinfer.tokenizers.llama2c import Llama2cTokenizer, read_llama2c_tokenizer
from jaxinfer.tokenizers.sentencepiece_model import SentencePieceTokenizer


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
    """Loads the tokenizer of a checkpoint.

    Args:
        path: a directory (Hugging Face style: ``tokenizer.json``, else ``tokenizer.model``, else
            another ``*.model``, else a llama2.c tokenizer ``*.bin``; ``tokenizer_config.json``,
            ``chat_template.jinja``, ``special_tokens_map.json``, ``generation_config.json`` and
            ``config.json`` read when present), or one file: ``*.json``, ``*.model``
            (SentencePiece) or ``*.bin`` (llama2.c tokenizer); the side files beside it are read.
        vocab_size: the model's vocabulary size (embedding rows), if known.

    Raises:
        TokenizerError: the path is missing or unreadable, holds no tokenizer, is a llama2.c
            checkpoint rather than a tokenizer, or the tokenizer has more ids than ``vocab_size``.
    """
    path = Path(path)
    if not path.exists():
        raise TokenizerError(f"no tokenizer at {path}: no such file or directory")
    if path.is_dir():
        file = _find_tokenizer_file(path)
    else:
        file = path
    side_files = SideFiles(file.parent)
    suffix = file.suffix.lower()
    if suffix == ".json":
        tok: Tokenizer = HFTokenizer(file, side_files)
    elif suffix == ".model":
        tok = SentencePieceTokenizer(file, side_files)
    elif suffix == ".bin":
        tok = Llama2cTokenizer(file, side_files)
    else:
        raise TokenizerError(
            f"{file}: unknown tokenizer format (expected tokenizer.json, a SentencePiece .model "
            "or a llama2.c tokenizer .bin)"
        )
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise TokenizerError(
            f"{file}: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has "
            f"only {vocab_size}"
        )
    return tok


def _find_tokenizer_file(directory: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return directory / name
    models = sorted(directory.glob("*.model"))
    if models:
        return models[0]
    bins = sorted(directory.glob("*.bin"), key=lambda p: (p.name != "tokenizer.bin", p.name))
    for candidate in bins:
        try:
            read_llama2c_tokenizer(candidate)
        except TokenizerError:
            continue
        return candidate
    raise TokenizerError(
        f"no tokenizer in {directory}: looked for tokenizer.json, tokenizer.model, *.model and "
        "a llama2.c tokenizer *.bin"
    )
