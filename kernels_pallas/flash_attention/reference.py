"""Pure-jnp multi-head attention with the exact semantics of the FlashAttention kernel."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Finite "minus infinity": keeps masked logits out of the softmax without creating NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class SegmentIds(NamedTuple):
    """Segment ids of queries and keys; a query attends only to keys with its id.

    A ragged prefill batch packs many sequences into one row with one id per sequence
    (padding gets an id of its own).
    """

    q: jax.Array  # i32[B, T]
    kv: jax.Array  # i32[B, S]


def split_segment_ids(segment_ids) -> tuple[jax.Array | None, jax.Array | None]:
    """`None`, one i32[B, T] array (used for queries and keys, T == S) or `SegmentIds`."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, SegmentIds):
        return segment_ids.q, segment_ids.kv
    return segment_ids, segment_ids


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    q_segment_ids: jax.Array | None = None,  # i32[B, T]
    kv_segment_ids: jax.Array | None = None,  # i32[B, S]
    causal: bool = True,
    sliding_window: int | None = None,
) -> jax.Array:  # bool[B or 1, T, S]
    """Which (query, key) pairs may attend, as the kernel decides it.

    Positions are bottom-right aligned: query t sits at position `t + S - T`, key s at `s`
    (T == S for a plain prefill; T < S for a chunk that follows a cached prefix).
    Causal keeps `k_pos <= q_pos`; the sliding window keeps `q_pos - k_pos < sliding_window`;
    segment ids keep pairs whose ids are equal.
    """
    q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)  # i32[T, 1]
    k_pos = jnp.arange(kv_len)[None, :]  # i32[1, S]
    mask = jnp.ones((1, q_len, kv_len), bool)
    if causal:
        mask &= (k_pos <= q_pos)[None]
    if sliding_window is not None:
        mask &= (q_pos - k_pos < sliding_window)[None]
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def mha_reference(
    q: jax.Array,  # f32/bf16[B, N, T, H]
    k: jax.Array,  # f32/bf16[B, K, S, H]
    v: jax.Array,  # f32/bf16[B, K, S, H]
    *,
    segment_ids=None,
    causal: bool = True,
    sm_scale: float,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,  # f32[N]
) -> jax.Array:  # q.dtype[B, N, T, H]
    """Materialises the full f32 score matrix; the judge for `flash_attention`.

    Arguments and semantics as in `kernel.flash_attention`: GQA maps query head n to KV
    head `n // (N // K)`; logits are `sm_scale * q.k`, then `cap * tanh(logits / cap)` when
    `logit_softcap` is set, then masked; a row with no visible key outputs zeros. `sinks`
    (gpt-oss): one more logit per query head in every row's max and denominator, with no
    value. Differentiable with plain `jax.grad` (with respect to the sinks too).
    """
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    g = n // kh
    q_ids, kv_ids = split_segment_ids(segment_ids)
    qg = q.reshape(b, kh, g, t, h)
    logits = jnp.einsum(
        "bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32
    )  # f32[B, K, G, T, S]
    logits = logits * sm_scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    mask = attention_mask(
        t,
        s,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        causal=causal,
        sliding_window=sliding_window,
    )[:, None, None]  # bool[B or 1, 1, 1, T, S]
    logits = jnp.where(mask, logits, MASK_VALUE)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, kh, g, 1, 1)
        m = jnp.maximum(m, sink)
    p = jnp.where(mask, jnp.exp(logits - jax.lax.stop_gradient(m)), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)  # f32[B, K, G, T, 1]
    if sinks is not None:
        l = l + jnp.exp(sink - jax.lax.stop_gradient(m))
    p = p / jnp.where(l == 0.0, 1.0, l)
    out = jnp.einsum("bkgts,bksh->bkgth", p, v.astype(jnp.float32))
    return out.reshape(b, n, t, h).astype(q.dtype)
