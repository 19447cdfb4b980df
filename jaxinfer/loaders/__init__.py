"""Checkpoint loading: one entry point, ``load``, that recognises the format of a path.

Supported formats:
- a Hugging Face model directory (``config.json`` + safetensors), via ``jaxinfer.loaders.hf``;
- a llama2.c checkpoint ``.bin`` file (versions 0, 1, 2), or a directory holding exactly one,
  via ``jaxinfer.loaders.llama2c``;
- a quantized checkpoint directory written by ``jaxinfer quantize`` (``jaxinfer_quant.json``),
  via ``jaxinfer.quant.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.detect import SUPPORTED_FORMATS, detect_format
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import Params

if TYPE_CHECKING:
    from jaxinfer.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run.

    Attributes:
        config: the architecture.
        params: the weights.
        tokenizer: the tokenizer found beside the checkpoint (or given), or None when there is
            none.
        path: the checkpoint path that was loaded (the directory or the .bin file).
    """

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    path: Path


WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def _resolve_dtype(dtype):
    """The jnp dtype of a weight dtype name or dtype; ValueError unless one of WEIGHT_DTYPES."""
    import jax.numpy as jnp

    try:
        resolved = None if isinstance(dtype, bool) else jnp.dtype(dtype)
    except (TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.name not in WEIGHT_DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported for weights; supported: {', '.join(WEIGHT_DTYPES)} "
            "(int8 weights: quantization='int8')"
        )
    return resolved


def load(
    path: str | os.PathLike,
    dtype="float32",
    tokenizer: str | os.PathLike | None = None,
    place=None,
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Loads a checkpoint of any supported format, with its tokenizer.

    Args:
        path: a Hugging Face model directory, a llama2.c checkpoint ``.bin`` or a directory
            holding exactly one llama2.c checkpoint.
        dtype: weight dtype, a name (``"float32"``, ``"bfloat16"``) or a jnp dtype.
        tokenizer: a tokenizer file or directory overriding the one found beside the checkpoint
            (the checkpoint's directory is searched when ``path`` is a file).
        place: optional ``place(cfg, field, x: np.ndarray) -> jax.Array`` putting each host
            tensor on devices (e.g. ``jaxinfer.models.sharding.ShardedPlacer``, which shards it).
        skip_tokenizer_init: load no tokenizer (as vLLM's option of that name).

    Returns:
        LoadedModel with ``tokenizer`` None when no tokenizer was given and none is beside the
        checkpoint, or with ``skip_tokenizer_init``.

    Raises:
        CheckpointError: unrecognised path or damaged checkpoint.
        TokenizerError: the tokenizer given explicitly cannot be loaded, or does not match the
            model's vocabulary.
        ValueError: both ``tokenizer`` and ``skip_tokenizer_init`` are given.
    """
    if skip_tokenizer_init and tokenizer is not None:
        raise ValueError(
            f"tokenizer={tokenizer!s} and skip_tokenizer_init=True contradict each "
            "other: pass one or the other"
        )
    dtype = _resolve_dtype(dtype)
    fmt, ckpt = detect_format(path)
    if fmt == "hf":
        from jaxinfer.loaders.hf import load_hf

        cfg, params = load_hf(ckpt, dtype, place=place)
        tok_dir = ckpt
    elif fmt == "quantized":
        from jaxinfer.quant.checkpoint import load_quantized

        cfg, params = load_quantized(ckpt, dtype, place=place)
        tok_dir = ckpt
    else:
        from jaxinfer.loaders.llama2c import load_llama2c

        cfg, params = load_llama2c(ckpt, dtype, place=place)
        tok_dir = ckpt.parent
    tok = None if skip_tokenizer_init else _load_tokenizer(tokenizer, tok_dir, cfg)
    return LoadedModel(config=cfg, params=params, tokenizer=tok, path=Path(path))


def _load_tokenizer(explicit, tok_dir: Path, cfg: ModelConfig):
    from jaxinfer.errors import TokenizerError
    from jaxinfer.tokenizers import load_tokenizer

    if explicit is not None:
        return load_tokenizer(explicit, vocab_size=cfg.vocab_size)
    try:
        return load_tokenizer(tok_dir, vocab_size=cfg.vocab_size)
    except TokenizerError:
        if _has_tokenizer_files(tok_dir):
            raise  # a tokenizer is there but broken: say so rather than return None
        return None


def _has_tokenizer_files(d: Path) -> bool:
    from jaxinfer.loaders.llama2c import is_llama2c_tokenizer_file

    names = ("tokenizer.json", "tokenizer.model", "tok512.model")
    if any((d / n).is_file() for n in names) or any(d.glob("*.model")):
        return True
    return any(is_llama2c_tokenizer_file(f) for f in d.glob("*.bin"))


__all__ = [
    "CheckpointError",
    "LoadedModel",
    "SUPPORTED_FORMATS",
    "WEIGHT_DTYPES",
    "detect_format",
    "load",
]
