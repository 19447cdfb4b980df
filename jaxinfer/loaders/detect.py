"""Recognises the format of a checkpoint path (``detect_format``), for the loaders' dispatch in
``jaxinfer.loaders.load`` and for ``jaxinfer.quant.checkpoint``, which records and copies what a
source checkpoint holds. Depends only on ``jaxinfer.loaders.llama2c``'s file sniffing."""

from __future__ import annotations

import os
from pathlib import Path

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.llama2c import (
    is_llama2c_checkpoint_file,
    is_llama2c_tokenizer_file,
    read_header,
)

SUPPORTED_FORMATS = (
    "a Hugging Face model directory (config.json + *.safetensors); "
    "a llama2.c checkpoint .bin file (version 0, 1 or 2); "
    "a directory holding exactly one llama2.c checkpoint .bin; "
    "a quantized checkpoint directory (jaxinfer_quant.json, from `jaxinfer quantize`)"
)


def _llama2c_bins(directory: Path) -> tuple[list[Path], list[Path]]:
    """(checkpoint .bin files, other .bin files) of a directory, sorted."""
    ckpts, others = [], []
    for f in sorted(directory.glob("*.bin")):
        (ckpts if f.is_file() and is_llama2c_checkpoint_file(f) else others).append(f)
    return ckpts, others


def detect_format(path: str | os.PathLike) -> tuple[str, Path]:
    """Recognises a checkpoint: returns ("hf", directory) or ("llama2c", .bin file).

    Raises:
        CheckpointError: the path does not exist or holds no supported checkpoint (the message
            says what was found and which formats are supported).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory; supported: {SUPPORTED_FORMATS}")
    if p.is_dir():
        if (p / "jaxinfer_quant.json").is_file():  # before config.json, which it may also hold
            return "quantized", p
        if (p / "config.json").is_file():
            return "hf", p
        ckpts, others = _llama2c_bins(p)
        if len(ckpts) == 1:
            return "llama2c", ckpts[0]
        if len(ckpts) > 1:
            raise CheckpointError(
                f"{p}: directory holds {len(ckpts)} llama2.c checkpoints "
                f"({', '.join(f.name for f in ckpts)}); pass the .bin file to load"
            )
        found = sorted(f.name for f in p.iterdir())
        shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "")
        bad = [
            f"{f.name} ({f.stat().st_size} bytes)"
            for f in others
            if f.is_file() and not is_llama2c_tokenizer_file(f)
        ]
        why = (
            (
                f"; {', '.join(bad)}: not a valid llama2.c checkpoint (corrupt or truncated? pass "
                "the file itself for details)"
            )
            if bad
            else ""
        )
        raise CheckpointError(
            f"{p}: no checkpoint found: no config.json and no llama2.c checkpoint .bin "
            f"(directory holds: {shown or 'nothing'}){why}; supported: {SUPPORTED_FORMATS}"
        )
    if is_llama2c_checkpoint_file(p):
        if p.suffix != ".bin":  # any file's first 28 bytes may read as 7 positive int32s
            try:
                read_header(p)
            except CheckpointError:
                raise CheckpointError(
                    f"{p}: unrecognised file ({p.stat().st_size} bytes, not a .bin whose "
                    "header reads as a llama2.c checkpoint's, nor a model directory); "
                    f"supported: {SUPPORTED_FORMATS}"
                ) from None
        return "llama2c", p
    if is_llama2c_tokenizer_file(p):
        raise CheckpointError(
            f"{p}: this is a llama2.c tokenizer file, not a checkpoint; "
            f"supported: {SUPPORTED_FORMATS}"
        )
    raise CheckpointError(
        f"{p}: unrecognised file ({p.stat().st_size} bytes, neither a llama2.c checkpoint "
        f"header nor a model directory); supported: {SUPPORTED_FORMATS}"
    )


__all__ = ["SUPPORTED_FORMATS", "detect_format"]
