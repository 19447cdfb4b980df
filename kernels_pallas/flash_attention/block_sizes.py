"""Tile sizes of the FlashAttention kernels (forward, dK/dV and dQ passes)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes in tokens. They change speed, not results (up to float rounding).

    Each block must divide its sequence length; `flash_attention` checks that, and the
    backend's own layout rules, against the actual shapes and raises ValueError.
    """

    block_q: int = 128
    """Query tokens per tile in the forward pass."""
    block_k: int = 128
    """Key/value tokens per tile in the forward pass."""
    block_q_dkv: int | None = None
    """Query tokens per tile in the dK/dV backward kernel (default: `block_q`)."""
    block_k_dkv: int | None = None
    """Key/value tokens per tile in the dK/dV backward kernel (default: `block_k`)."""
    block_q_dq: int | None = None
    """Query tokens per tile in the dQ backward kernel (default: `block_q`)."""
    block_k_dq: int | None = None
    """Key/value tokens per tile in the dQ backward kernel (default: `block_k`)."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 8:
                raise ValueError(f"BlockSizes.{field.name}={value!r}: must be an int >= 8")
            if value % 8:
                raise ValueError(f"BlockSizes.{field.name}={value}: must be a multiple of 8")

    @property
    def dkv(self) -> tuple[int, int]:
        """(block_q, block_k) of the dK/dV kernel."""
        return (self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k)

    @property
    def dq(self) -> tuple[int, int]:
        """(block_q, block_k) of the dQ kernel."""
        return (self.block_q_dq or self.block_q, self.block_k_dq or self.block_k)
