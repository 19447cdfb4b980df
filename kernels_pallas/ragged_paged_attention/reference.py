"""Pure-jnp reference of the ragged paged attention kernels, on the kernels' own inputs.

Self-contained (imports nothing of the engine), and written for plain readability, not speed: each
query token finds its row from ``cu_q_lens``, gathers that row's whole block table of pages,
dequantizes int8 pages (``int8 * scale``), and attends with a dense causal / sliding-window mask
in float32. A row's queries are the last ``q_len`` tokens of its ``kv_len``. Memory is
O(T * N * M * Z): a test reference, not a kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _layer_pages(pages: jax.Array, scales: jax.Array | None, layer: jax.Array) -> jax.Array:
    """Pages [L, K, P, Z, H] (or [K, P, Z, H]) and int8 scales f32[L, K, P, Z] (or [K, P, Z]) or
    None -> f32[K, P, Z, H] of ``layer`` (4-d pages: the only layer), int8 values times scale."""
    if pages.ndim == 5:
        pages = pages[layer]
        scales = None if scales is None else scales[layer]
    pages = pages.astype(jnp.float32)
    return pages if scales is None else pages * scales[..., None]


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [L, K, P, Z, H] (or [K, P, Z, H])
    v_pages: jax.Array,  # [L, K, P, Z, H] (or [K, P, Z, H])
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
    sinks: jax.Array | None = None,  # [N]
) -> jax.Array:
    """f32[T, N, H]; the same contract as ``ragged_paged_attention``.

    Token t belongs to row b with ``cu_q_lens[b] <= t < cu_q_lens[b + 1]`` and sits at position
    ``kv_lens[b] - cu_q_lens[b + 1] + t``; it sees key j of its row when ``j < kv_lens[b]``,
    ``j <= position`` and (``window <= 0`` or ``position - j < window``). Query head i reads KV
    head ``i // (N // K)``. Scores are ``q . k * scale``, soft-capped to
    ``softcap * tanh(s / softcap)`` when ``softcap`` is given, softmaxed in f32. int8 pages (with
    ``k_scales``/``v_scales``) are read as ``int8 * scale``. ``sinks`` (gpt-oss): one more
    logit per query head, joined to the softmax's max and denominator, with no value. Tokens
    after ``cu_q_lens[-1]`` (padding) belong to no row and get an arbitrary finite output; a
    token seeing no key gets 0.
    ``num_decode`` only tells the kernels how rows are laid out; the reference needs no such
    hint.
    """
    del num_decode
    k = _layer_pages(k_pages, k_scales, layer)  # f32[K, P, Z, H]
    v = _layer_pages(v_pages, v_scales, layer)
    t, n, h = q.shape
    kh, _, z, _ = k.shape
    b, m = block_tables.shape
    tok = jnp.arange(t, dtype=jnp.int32)
    # Row of each token: the rows that end at or before it; padding tokens clamp to the last row.
    row = jnp.minimum(jnp.sum(cu_q_lens[1:][None, :] <= tok[:, None], axis=1), b - 1)  # i32[T]
    pos = kv_lens[row] - cu_q_lens[row + 1] + tok  # i32[T]
    # Each token's row, all M pages: [K, T, M, Z, H] -> [K, T, S = M * Z, H].
    kt = k[:, block_tables[row]].reshape(kh, t, m * z, h)
    vt = v[:, block_tables[row]].reshape(kh, t, m * z, h)
    kv_head = jnp.arange(n) // (n // kh)  # i32[N]
    kt, vt = kt[kv_head], vt[kv_head]  # [N, T, S, H]
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("TNH,NTSH->TNS", q.astype(jnp.float32), kt, precision=hi) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    j = jnp.arange(m * z, dtype=jnp.int32)[None, :]  # key position within the row
    p_, len_ = pos[:, None], kv_lens[row][:, None]
    sees = (j < len_) & (j <= p_) & ((window <= 0) | (p_ - j < window))  # bool[T, S]
    sees = sees[:, None, :]  # [T, 1, S]
    s_max = jnp.max(jnp.where(sees, s, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[None, :, None]  # [1, N, 1]
        s_max = jnp.maximum(s_max, sink)
    e = jnp.where(sees, jnp.exp(s - jnp.where(jnp.isfinite(s_max), s_max, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - s_max)
    p = e / jnp.where(denom > 0, denom, 1.0)  # all-zero where the token sees no key
    return jnp.einsum("TNS,NTSH->TNH", p, vt, precision=hi)
