"""MXFP4 weights (gpt-oss experts as they ship) dequantized at load, in numpy.

An MXFP4 tensor is stored as two uint8 tensors: ``<name>_blocks`` u8[*lead, R, G, 16], each byte
two FP4 (e2m1) values, the low nibble first (element ``2i`` of a 32-value block is byte i's low
four bits, element ``2i + 1`` its high four bits); and ``<name>_scales`` u8[*lead, R, G], one
E8M0 exponent per block of 32 values (the scale is ``2 ** (s - 127)``). The dequantized tensor
is ``[*lead, R, G * 32]``: R output rows, G * 32 inputs.

The values follow transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``): the
FP4 code to float table, times the power of two (``ldexp``, exact in float32), rounded once to
the compute dtype.
Sources: OCP Microscaling Formats (MX) v1.0; transformers ``integrations/mxfp4.py``.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError

# FP4 e2m1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0.
FP4_VALUES = np.asarray(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCK_BYTES = 16  # 32 FP4 values per scale
SCALE_BIAS = 127


def check_mxfp4(
    blocks_shape: tuple[int, ...],
    scales_shape: tuple[int, ...],
    *,
    where: str,
    name: str,
    blocks_dtype=np.uint8,
    scales_dtype=np.uint8,
) -> None:
    """Checks a pair of MXFP4 tensors' shapes and dtypes before anything is read.

    Args:
        blocks_shape: shape of ``<name>_blocks``, expected ``[*lead, R, G, 16]``.
        scales_shape: shape of ``<name>_scales``, expected ``[*lead, R, G]``.
        where: the file named in errors; name: the tensor's name (without the suffixes).
        blocks_dtype, scales_dtype: the stored dtypes (uint8 both).

    Raises:
        CheckpointError: naming the file and the tensor, when the blocks are not uint8 with a
            last axis of 16 bytes, or the scales not uint8 of the blocks' shape without it.
    """
    b, s = tuple(blocks_shape), tuple(scales_shape)
    for suffix, dt in (("_blocks", blocks_dtype), ("_scales", scales_dtype)):
        if np.dtype(dt) != np.uint8:
            raise CheckpointError(
                f"{where}: tensor {name + suffix!r} is {np.dtype(dt).name}; MXFP4 stores uint8"
            )
    if len(b) < 2 or b[-1] != BLOCK_BYTES:
        raise CheckpointError(
            f"{where}: tensor {name + '_blocks'!r} has shape {list(b)}; expected [..., R, G, "
            f"{BLOCK_BYTES}] (G blocks of 32 FP4 values, two per byte)"
        )
    if s != b[:-1]:
        raise CheckpointError(
            f"{where}: tensor {name + '_scales'!r} has shape {list(s)}; expected {list(b[:-1])}, "
            f"one exponent per block of {name + '_blocks'!r} {list(b)}"
        )


def dequantize_mxfp4(
    blocks: np.ndarray, scales: np.ndarray, dtype=np.float32, *, where: str = "", name: str = ""
) -> np.ndarray:
    """MXFP4 blocks u8[*lead, R, G, 16] and scales u8[*lead, R, G] -> dtype[*lead, R, G * 32].

    ``dtype``: the compute dtype (float32, bfloat16 or float16); each value is FP4 times
    ``2 ** (scale - 127)`` (exact in float32), rounded once to ``dtype``. Raises
    CheckpointError naming ``where`` and ``name`` for mismatched shapes or dtypes
    (``check_mxfp4``).
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    check_mxfp4(
        blocks.shape,
        scales.shape,
        where=where,
        name=name,
        blocks_dtype=blocks.dtype,
        scales_dtype=scales.dtype,
    )
    out = np.empty((*blocks.shape[:-1], 2 * BLOCK_BYTES), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]  # low nibble: the even element
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    # value * 2 ** e, exact in float32 (ldexp, as transformers' torch.ldexp): a scale of 255
    # gives 2 ** 128 times the FP4 value, inf beyond float32's range, 0 for a zero value.
    with np.errstate(over="ignore"):
        out = np.ldexp(out, (scales.astype(np.int32) - SCALE_BIAS)[..., None])
    return out.reshape(*blocks.shape[:-2], -1).astype(dtype)


def dequantize_expert_weight(
    blocks: np.ndarray, scales: np.ndarray, dtype=np.float32, *, where: str = "", name: str = ""
) -> np.ndarray:
    """gpt-oss expert weights as transformers' ``GptOssExperts`` holds them: blocks
    u8[E, R, G, 16], scales u8[E, R, G] -> dtype[E, G * 32, R] (input first; ``gate_up_proj``
    [E, D, 2F], ``down_proj`` [E, F, D]), the layout ``convert_moe_packed_tensors`` returns.
    Raises CheckpointError as ``dequantize_mxfp4``, or for blocks that are not 4-D."""
    if np.ndim(blocks) != 4:
        raise CheckpointError(
            f"{where}: tensor {name + '_blocks'!r} has shape {list(np.shape(blocks))}; expected "
            f"[experts, rows, blocks, {BLOCK_BYTES}]"
        )
    w = dequantize_mxfp4(blocks, scales, dtype, where=where, name=name)
    return np.ascontiguousarray(w.swapaxes(1, 2))
