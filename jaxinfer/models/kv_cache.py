"""Paged KV cache: the device-side page pool (a pytree). Which sequence holds which page is the
host's business (``jaxinfer.engine.page_pool``, ``jaxinfer.engine.kv_manager``).

Layout (PagedAttention, Kwon et al. 2023; the per-layer layout of jax's Pallas paged_attention):
``k_pages, v_pages: [L, K, P, Z, H]``. A sequence owns a list of page ids (its block table); token
``i`` of a sequence lives in page ``block_table[i // Z]`` at offset ``i % Z``, i.e. at the flat slot
``block_table[i // Z] * Z + i % Z`` (its slot mapping). Page 0 is reserved as the null page: padding
tokens write there and padded block-table entries point there, so no real page is ever touched by
padding.

A page-major pool (``KVCache.page_major``) stores ``[L, P, K, Z, H]`` instead: a page's K heads are
one contiguous block (48 KB for 12 heads of 64 at Z = 16, not 12 pieces of 4 KB), so the XLA
attention's page gathers read large runs, which makes XLA CPU's decode attention faster
(docs/performance.md); the Pallas kernels and sharded pools use the head-major layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.quant.kv import quantize_kv

NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The page pool of every layer.

    Attributes:
        k_pages: [L, K, P, Z, H] keys (RoPE applied); int8 for an int8 cache. Page-major:
            [L, P, K, Z, H].
        v_pages: values, the same layout.
        k_scales, v_scales: f32[L, K, P, Z] (page-major: [L, P, K, Z]) per-token, per-head scales
            of an int8 cache (``jaxinfer.quant.kv``), None for a float cache.
        page_major: static, the layout (see the module docstring).
    """

    k_pages: jax.Array
    v_pages: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    page_major: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1 if self.page_major else 2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]


def init_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype, page_major: bool = False
) -> KVCache:
    """A zeroed pool of ``num_pages`` pages of ``page_size`` tokens (page 0 is the null page).
    ``dtype`` int8 makes an int8 cache with per-token, per-head f32 scales; ``page_major`` the
    ``[L, P, K, Z, H]`` layout."""
    layers, heads = cfg.num_layers, cfg.num_kv_heads
    lead = (layers, num_pages, heads) if page_major else (layers, heads, num_pages)
    shape = (*lead, page_size, cfg.head_dim)
    if jnp.dtype(dtype) == jnp.int8:
        return KVCache(
            jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype),
            jnp.zeros(shape[:-1], jnp.float32),
            jnp.zeros(shape[:-1], jnp.float32),
            page_major=page_major,
        )
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), page_major=page_major)


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Bytes of K and V of one token over all layers (int8: values plus one f32 scale per head)."""
    per_head = cfg.head_dim * jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) == jnp.int8:
        per_head += 4
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def write_kv(
    cache: KVCache,
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]
) -> KVCache:
    """Writes the K/V of T tokens of one layer at their slots (in place under donation)."""
    z = cache.page_size
    page, offset = slot_mapping // z, slot_mapping % z
    # Both index forms select [T, K, (H)]: the advanced indices are split by the head slice.
    at = (
        (layer, page, slice(None), offset)
        if cache.page_major
        else (layer, slice(None), page, offset)
    )
    if cache.k_scales is not None:  # int8 cache: quantize per token and head
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        return dataclasses.replace(
            cache,
            k_pages=cache.k_pages.at[at].set(kq),
            v_pages=cache.v_pages.at[at].set(vq),
            k_scales=cache.k_scales.at[at].set(ks),
            v_scales=cache.v_scales.at[at].set(vs),
        )
    return dataclasses.replace(
        cache,
        k_pages=cache.k_pages.at[at].set(k.astype(cache.k_pages.dtype)),
        v_pages=cache.v_pages.at[at].set(v.astype(cache.v_pages.dtype)),
    )
