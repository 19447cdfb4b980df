"""Ragged paged attention kernels (Pallas): the engine's mixed decode + prefill step in one call.

Queries of many sequences are flattened (``cu_q_lens``); keys/values are read from the page pool
through the block table (``block_tables``, ``kv_lens``); attention is causal within each sequence,
with GQA, an optional sliding window (dynamic, per layer), an optional logit soft-cap and
optional attention sinks (gpt-oss: a learned logit per query head in each softmax). The
pages are float, or int8 with per-token, per-head f32 scales (``jaxinfer.quant.kv``), dequantized
in the kernel. Rows
``[0, num_decode)`` are decode rows with one query token each; the prefill rows follow. A row's
queries are the last ``q_len`` tokens of its ``kv_len`` (its K/V are already in the pages).

Variants: ``tpu.py`` (Mosaic, ``PrefetchScalarGridSpec``), ``gpu.py`` (Triton). ``reference.py``
is the pure-jnp reference on the same inputs; ``block_sizes.py`` the tiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.ragged_paged_attention.block_sizes import BlockSizes, default_block_sizes
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("tpu", "gpu")

__all__ = [
    "BACKENDS",
    "BlockSizes",
    "check_kv_scales",
    "check_supported",
    "default_block_sizes",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]


def check_supported(
    backend: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pool_elems: int = 0,
    block_sizes: BlockSizes | None = None,
    max_pages: int = 1,
) -> None:
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


def check_kv_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """int8 pages need both scales, f32[*pages.shape[:-1]]; float pages take none. Raises
    ValueError saying which is which."""
    quant = k_pages.dtype == jnp.int8
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ")
    if (k_scales is None) != (v_scales is None) or (k_scales is not None) != quant:
        raise ValueError(
            f"{k_pages.dtype} pages with k_scales {'given' if k_scales is not None else 'None'}, "
            f"v_scales {'given' if v_scales is not None else 'None'}: supported are int8 pages "
            "with both scales (f32[L, K, P, Z]) or float pages with neither"
        )
    if quant:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s.shape != k_pages.shape[:-1] or s.dtype != jnp.float32:
                raise ValueError(
                    f"{name} is {s.dtype}{list(s.shape)}; int8 pages of shape "
                    f"{list(k_pages.shape)} need f32{list(k_pages.shape[:-1])}"
                )


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [L, K, P, Z, H] (or [K, P, Z, H] with layer=0)
    v_pages: jax.Array,  # [L, K, P, Z, H] (or [K, P, Z, H] with layer=0)
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, M]
    cu_q_lens: jax.Array,  # i32[B + 1]
    window: jax.Array,  # i32[]
    layer: jax.Array,  # i32[]
    k_scales: jax.Array | None = None,  # f32[L, K, P, Z] (or [K, P, Z]); int8 pages only
    v_scales: jax.Array | None = None,  # f32[L, K, P, Z] (or [K, P, Z]); int8 pages only
    *,
    num_decode: int,
    scale: float,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str,
    interpret: bool = False,
    sinks: jax.Array | None = None,  # [N]
) -> jax.Array:
    """Causal ragged paged attention. Output f32[T, N, H].

    Args:
        q: [T, N, H] queries (RoPE applied); decode tokens first, then prefill tokens.
        k_pages, v_pages: bf16/f32[L, K, P, Z, H] (or [K, P, Z, H], read at layer 0) the page
            pool, this step's K/V already written; or i8[L, K, P, Z, H] with scales.
        kv_lens: i32[B] tokens in each row's cache (0 for padding rows).
        block_tables: i32[B, M] page ids of each row.
        cu_q_lens: i32[B + 1] cumulative query tokens per row.
        window: i32[] sliding window in tokens (0 = none): a query at i sees keys j with
            ``i - j < window``.
        layer: i32[] layer of the pool to read.
        k_scales, v_scales: f32[L, K, P, Z] (or [K, P, Z] with 4-d pages) for int8 pages, None
            for float pages: the scale of each token's K (V) of each KV head, the value being
            ``int8 * scale`` (``jaxinfer.quant.kv``); same page ids and offsets as the pages.
            The kernel fetches each page's scales beside the page and dequantizes to f32 before
            the dots (the queries are then taken as f32 too).
        num_decode: static count of decode rows (= tokens) at the front.
        scale: score scale; softcap: ``cap * tanh(s / cap)`` on scores, or None.
        block_sizes: tiling; None for ``default_block_sizes``.
        backend: "tpu" or "gpu".
        interpret: run the kernel's semantics on CPU (TPU: ``pltpu.InterpretParams``).
        sinks: [N] attention-sink logits (gpt-oss), or None: each query head's softmax takes one
            more term ``exp(sink)`` in its max and denominator, with no value.

    Padding tokens (no row, or a row with kv_len 0) get 0.

    Raises:
        ValueError: a combination the backend cannot tile (message names it and what is
            supported), an unknown backend, int8 pages without both scales (or scales with
            float pages), scales not of shape ``k_pages.shape[:-1]``, or sinks not of shape
            [N].
    """
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
        if k_scales is not None:
            k_scales, v_scales = k_scales[None], v_scales[None]
    _, kh, _, z, h = k_pages.shape
    bs = block_sizes or default_block_sizes(z, block_tables.shape[1], backend)
    check_supported(
        backend,
        num_heads=q.shape[1],
        num_kv_heads=kh,
        head_dim=h,
        page_size=z,
        pool_elems=k_pages.size,
        block_sizes=bs,
    )
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"sinks has shape {tuple(sinks.shape)}; expected ({q.shape[1]},), one a head"
        )
    kw = dict(
        num_decode=num_decode,
        scale=scale,
        softcap=softcap,
        block_sizes=bs,
        interpret=interpret,
        k_scales=k_scales,
        v_scales=v_scales,
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(kh, -1),
    )
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, window, layer)
    if backend == "tpu":
        from kernels_pallas.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, **kw)
    from kernels_pallas.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*args, **kw)
