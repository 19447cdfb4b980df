"""Ragged paged attention kernels (Pallas): the engine's mixed decode + prefill step in one call.

Queries of many sequences are flattened (``cu_q_lens``); keys/values are read from the page pool
through the block table (``block_tables``, ``kv_lens``); attention is causal within each sequence,
with GQA, an optional sliding window (dynamic, per layer) and an optional logit soft-cap. Rows
``[0, num_decode)`` are decode rows with one query token each; the prefill rows follow. A row's
queries are the last ``q_len`` tokens of its ``kv_len`` (its K/V are already in the pages).

Variants: ``tpu.py`` (Mosaic, ``PrefetchScalarGridSpec``), ``gpu.py`` (Triton). ``reference.py``
is the pure-jnp reference on the same inputs; ``block_sizes.py`` the tiling.
"""

from __future__ import annotations

import jax

from kernels_pallas.ragged_paged_attention.block_sizes import BlockSizes, default_block_sizes
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("tpu", "gpu")

__all__ = ["BACKENDS", "BlockSizes", "check_supported", "default_block_sizes",
           "ragged_paged_attention", "ragged_paged_attention_reference"]


def check_supported(backend: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                    page_size: int, pool_elems: int = 0, block_sizes: BlockSizes | None = None,
                    max_pages: int = 1) -> None:
    """Static checks of a combination. Raises ValueError naming it and what is supported."""
    if backend == "tpu":
        from kernels_pallas.ragged_paged_attention import tpu

        tpu.check_supported(num_heads, num_kv_heads, head_dim, page_size)
    elif backend == "gpu":
        from kernels_pallas.ragged_paged_attention import gpu

        bs = block_sizes or default_block_sizes(page_size, max_pages, "gpu")
        gpu.check_supported(num_heads, num_kv_heads, head_dim, page_size, pool_elems, bs)
    else:
        raise ValueError(f"backend={backend!r} is not a Pallas backend; supported: {BACKENDS}")


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [L, K, P, Z, H] (or [K, P, Z, H] with layer=0)
    v_pages: jax.Array,  # [L, K, P, Z, H] (or [K, P, Z, H] with layer=0)
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, M]
    cu_q_lens: jax.Array,  # i32[B + 1]
    window: jax.Array,  # i32[]
    layer: jax.Array,  # i32[]
    *,
    num_decode: int,
    scale: float,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str,
    interpret: bool = False,
) -> jax.Array:
    """Causal ragged paged attention. Output f32[T, N, H].

    Args:
        q: [T, N, H] queries (RoPE applied); decode tokens first, then prefill tokens.
        k_pages, v_pages: the page pool; this step's K/V already written.
        kv_lens: i32[B] tokens in each row's cache (0 for padding rows).
        block_tables: i32[B, M] page ids of each row.
        cu_q_lens: i32[B + 1] cumulative query tokens per row.
        window: i32[] sliding window in tokens (0 = none): a query at i sees keys j with
            ``i - j < window``.
        layer: i32[] layer of the pool to read.
        num_decode: static count of decode rows (= tokens) at the front.
        scale: score scale; softcap: ``cap * tanh(s / cap)`` on scores, or None.
        block_sizes: tiling; None for ``default_block_sizes``.
        backend: "tpu" or "gpu".
        interpret: run the kernel's semantics on CPU (TPU: ``pltpu.InterpretParams``).

    Padding tokens (no row, or a row with kv_len 0) get 0.

    Raises:
        ValueError: a combination the backend cannot tile (message names it and what is
            supported), or an unknown backend.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    _, kh, _, z, h = k_pages.shape
    bs = block_sizes or default_block_sizes(z, block_tables.shape[1], backend)
    check_supported(backend, num_heads=q.shape[1], num_kv_heads=kh, head_dim=h, page_size=z,
                    pool_elems=k_pages.size, block_sizes=bs)
    kw = dict(num_decode=num_decode, scale=scale, softcap=softcap, block_sizes=bs,
              interpret=interpret)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, window, layer)
    if backend == "tpu":
        from kernels_pallas.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, **kw)
    from kernels_pallas.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*args, **kw)
