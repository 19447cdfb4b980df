"""FlashAttention Pallas kernels (TPU and GPU variants) with a pure-jnp reference."""

from kernels_pallas.flash_attention.block_sizes import BlockSizes
from kernels_pallas.flash_attention.kernel import BACKENDS, flash_attention
from kernels_pallas.flash_attention.reference import SegmentIds, attention_mask, mha_reference

__all__ = [
    "BACKENDS",
    "BlockSizes",
    "SegmentIds",
    "attention_mask",
    "flash_attention",
    "mha_reference",
]
