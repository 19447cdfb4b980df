"""Pure-XLA attention: the dense segment-masked reference and shared masking/softmax helpers.

The paged (KV-cache) attention lives in ``jaxinfer.models.paged_attention``; both share
``masked_softmax_av``
so the numerics (float32 scores, soft-cap, finite mask value) are identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite mask value: a fully masked row (a padding query) gives a uniform softmax, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def masked_softmax_av(
    scores: jax.Array,  # f32[..., S] raw q.k
    mask: jax.Array,  # bool[..., S], broadcastable to scores
    v_contract,
    *,
    scale: float,
    softcap: float | None,
) -> jax.Array:
    """Scales, soft-caps, masks and softmaxes ``scores`` in float32, then ``v_contract(probs)``."""
    s = scores.astype(jnp.float32) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask, s, MASK_VALUE)
    s = s - jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    return v_contract(p)


def window_mask(q_pos: jax.Array, kv_pos: jax.Array, window: jax.Array) -> jax.Array:
    """Causal + sliding-window visibility: ``kv_pos <= q_pos`` and (``window == 0`` or
    ``q_pos - kv_pos < window``). Shapes broadcast."""
    causal = kv_pos <= q_pos
    in_window = jnp.logical_or(window <= 0, q_pos - kv_pos < window)
    return jnp.logical_and(causal, in_window)


def dense_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    segment_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    window: jax.Array,  # i32[]
    *,
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention over a flat batch of whole sequences, no cache. Output f32[T, N, H].

    Tokens attend to tokens of the same segment with a position not after theirs (and within
    ``window`` when it is positive). O(T^2) memory: a reference, not a kernel.
    """
    t, n, h = q.shape
    kh = k.shape[1]
    qg = q.reshape(t, kh, n // kh, h)
    scores = jnp.einsum("TKGH,SKH->KGTS", qg, k, preferred_element_type=jnp.float32)
    mask = (segment_ids[:, None] == segment_ids[None, :]) & window_mask(
        positions[:, None], positions[None, :], window
    )
    out = masked_softmax_av(
        scores,
        mask[None, None],
        lambda p: jnp.einsum("KGTS,SKH->TKGH", p, v.astype(jnp.float32)),
        scale=scale,
        softcap=softcap,
    )
    return out.reshape(t, n, h)


def dense_attn_fn(cfg, segment_ids: jax.Array, positions: jax.Array):
    """An ``AttnFn`` for ``model.forward`` with no KV cache (cache stays None)."""

    def attn(q, k, v, cache, layer, window):
        del layer
        out = dense_attention(
            q,
            k,
            v,
            segment_ids,
            positions,
            window,
            scale=cfg.attn_scale,
            softcap=cfg.attn_logit_softcap,
        )
        return out, cache

    return attn
