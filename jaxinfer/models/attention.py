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
    sinks: jax.Array | None = None,  # [...], broadcastable to scores[..., 0]
) -> jax.Array:
    """Scales, soft-caps, masks and softmaxes ``scores`` in float32, then ``v_contract(probs)``.

    ``sinks``: one more logit per row that joins the softmax (its max and its denominator) and
    is then dropped, so a row's probabilities sum to less than 1 (gpt-oss attention sinks, as
    transformers' ``eager_attention_forward`` of modeling_gpt_oss).
    """
    s = scores.astype(jnp.float32) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask, s, MASK_VALUE)
    mx = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.asarray(sinks, jnp.float32)[..., None]
        mx = jnp.maximum(mx, sink)
    p = jnp.exp(s - mx)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - mx)
    return v_contract(p / denom)


def add_sinks(
    m: jax.Array,  # f32[...] running max of the scaled scores
    l: jax.Array,  # f32[...] running sum of exp(score - m)
    acc: jax.Array,  # f32[..., H] running sum of exp(score - m) v
    sinks: jax.Array | None,  # [...], broadcastable to m
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An online softmax's state (m, l, acc) with the sink logits joined to its keys: the same
    state as if one more key of logit ``sinks`` and value 0 had been seen. None: unchanged."""
    if sinks is None:
        return m, l, acc
    sink = jnp.asarray(sinks, jnp.float32)
    nm = jnp.maximum(m, sink)
    corr = jnp.exp(m - nm)
    return nm, l * corr + jnp.exp(sink - nm), acc * corr[..., None]


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
    sinks: jax.Array | None = None,  # [N]
) -> jax.Array:
    """Causal attention over a flat batch of whole sequences, no cache. Output f32[T, N, H].

    Tokens attend to tokens of the same segment with a position not after theirs (and within
    ``window`` when it is positive); ``sinks`` [N] join each head's softmax denominator
    (``masked_softmax_av``). O(T^2) memory: a reference, not a kernel.
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
        sinks=None if sinks is None else sinks.reshape(kh, n // kh, 1),
    )
    return out.reshape(t, n, h)


def dense_attn_fn(cfg, segment_ids: jax.Array, positions: jax.Array):
    """An ``AttnFn`` for ``model.forward`` with no KV cache (cache stays None)."""

    def attn(q, k, v, cache, layer, window, sinks=None):
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
            sinks=sinks,
        )
        return out, cache

    return attn
