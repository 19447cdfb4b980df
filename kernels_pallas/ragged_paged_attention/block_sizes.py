"""Block sizes of the ragged paged attention kernels, with their static checks and defaults."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel launch.

    Attributes:
        pages_per_block: KV pages read per kernel step (a KV block is ``pages_per_block * Z``
            tokens). Larger blocks mean fewer, longer steps; the last block of a sequence is
            partly masked.
        q_block: query tokens per prefill block (the flat prefill region is cut into blocks of
            this many tokens; decode rows always have one token).
    """

    pages_per_block: int = 8
    q_block: int = 32

    def __post_init__(self):
        if self.pages_per_block < 1:
            raise ValueError(f"pages_per_block={self.pages_per_block} must be >= 1")
        if self.q_block < 1 or self.q_block & (self.q_block - 1):
            raise ValueError(f"q_block={self.q_block} must be a positive power of two")


def default_block_sizes(page_size: int, max_pages: int, backend: str) -> BlockSizes:
    """Defaults: KV blocks of about 128 tokens (GPU) / 256 tokens (TPU), never wider than the
    block table; 32-token query blocks. Not yet tuned on hardware (see
    ``scripts/device_check_kernels.py``).
    """
    target = 256 if backend == "tpu" else 128
    ppb = max(1, min(target // page_size, max_pages))
    if backend == "gpu":
        ppb = 1 << (ppb.bit_length() - 1)  # Triton block shapes are powers of two
        ppb = max(ppb, -(-16 // page_size))  # tl.dot needs >= 16 keys
    return BlockSizes(pages_per_block=ppb, q_block=32)
