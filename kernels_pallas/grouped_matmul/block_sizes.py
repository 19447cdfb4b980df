"""Tile sizes of the grouped matmul kernels, with their static checks and defaults."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one grouped matmul launch ``[T, D] x [E, D, F] -> [T, F]``. Tiles change speed,
    not results (up to float rounding); edges that a tile does not divide are masked (TPU) or
    zero-padded (GPU).

    Attributes:
        block_t: rows (token copies) per tile. A row tile that straddles two groups is visited
            once per group (TPU) or each group's rows start their own tiles (GPU).
        block_d: contracted columns per step of the f32 accumulation.
        block_f: output columns per tile.
    """

    block_t: int = 128
    block_d: int = 512
    block_f: int = 512

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 8 or value % 8:
                raise ValueError(f"BlockSizes.{field.name}={value!r}: must be a multiple of 8")


def _pow2_at_most(x: int, cap: int) -> int:
    """The largest power of two <= min(x, cap), at least 16 (the smallest ``tl.dot``)."""
    return max(16, 1 << (min(x, cap).bit_length() - 1))


def default_block_sizes(t: int, d: int, f: int, backend: str) -> BlockSizes:
    """Defaults for rows ``t``, contracted width ``d``, output width ``f``; not yet tuned on
    hardware (no device has run these kernels un-interpreted).

    TPU: 128-row tiles, and the whole of D (F) when it is at most 512 wide (a block equal to the
    array's dimension is always a legal Mosaic block), else 512 (a multiple of the 128 lanes).
    GPU: powers of two (Triton tile shapes), 64 rows, 64 contracted, 128 output columns, shrunk
    for small problems.
    """
    if backend == "gpu":
        return BlockSizes(
            block_t=_pow2_at_most(t, 64),
            block_d=_pow2_at_most(d, 64),
            block_f=_pow2_at_most(f, 128),
        )
    whole = lambda x: x if x <= 512 and x % 8 == 0 else 512  # noqa: E731
    return BlockSizes(block_t=128, block_d=whole(d), block_f=whole(f))
