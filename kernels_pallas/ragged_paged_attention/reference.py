"""Pure-jnp reference of the ragged paged attention kernels, on the kernels' own inputs.

Derives positions and token rows from ``cu_q_lens`` / ``kv_lens`` (a row's queries are the last
``q_len`` tokens of its ``kv_len``) and calls the engine's XLA implementation,
``jaxinfer.paged_attention.ragged_paged_attention_xla``. int8 pages are first dequantized whole
(``jaxinfer.quant.kv.dequantize_kv``), so the reference reads the float pages the kernels must
reproduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.paged_attention import AttentionMetadata, ragged_paged_attention_xla
from jaxinfer.quant.kv import dequantize_kv


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [L, K, P, Z, H]
    v_pages: jax.Array,  # [L, K, P, Z, H]
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, M]
    cu_q_lens: jax.Array,  # i32[B + 1]
    window: jax.Array,  # i32[]
    layer: jax.Array,  # i32[]
    k_scales: jax.Array | None = None,  # f32[L, K, P, Z]; int8 pages only
    v_scales: jax.Array | None = None,  # f32[L, K, P, Z]; int8 pages only
    *,
    num_decode: int,
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """f32[T, N, H]; the same contract as ``ragged_paged_attention``. Tokens after
    ``cu_q_lens[-1]`` (padding) are assigned to no row and get an arbitrary finite output.
    int8 pages (with ``k_scales``/``v_scales``, value = int8 * scale) are read as
    f32[L, K, P, Z, H] ``dequantize_kv(pages, scales)``."""
    k_pages, v_pages = dequantize_kv(k_pages, k_scales), dequantize_kv(v_pages, v_scales)
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    t = q.shape[0]
    b = kv_lens.shape[0]
    tok = jnp.arange(t, dtype=jnp.int32)
    seq_ids = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right").astype(jnp.int32) - 1, 0,
                       b - 1)
    positions = kv_lens[seq_ids] - cu_q_lens[seq_ids + 1] + tok
    md = AttentionMetadata(positions, jnp.zeros(t, jnp.int32), block_tables, kv_lens, cu_q_lens,
                           seq_ids, num_decode=num_decode)
    return ragged_paged_attention_xla(q, k_pages, v_pages, md, jnp.asarray(window, jnp.int32),
                                      scale=scale, softcap=softcap, layer=layer)
