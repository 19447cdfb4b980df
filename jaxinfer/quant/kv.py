"""int8 KV cache: per-token, per-head symmetric quantization of keys and values.

A token's K (or V) of one head, ``x: [H]``, is stored as ``i8[H]`` values and one f32 scale
``s = max|x| / 127``; ``|x - q * s| <= s / 2`` per element. The scales live beside the pages in
``KVCache.k_scales / v_scales: f32[L, K, P, Z]`` (None for a float cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., H] float -> (i8[..., H] values, f32[...] scales), one scale per vector of H."""
    xf = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(xf), axis=-1) / 127.0
    q = jnp.clip(jnp.round(xf / jnp.where(s == 0, 1.0, s)[..., None]), -127, 127)
    return q.astype(jnp.int8), s


def dequantize_kv(q: jax.Array, s: jax.Array | None) -> jax.Array:
    """i8[..., H] values and f32[...] scales -> f32[..., H]; float pages (``s`` None) pass."""
    if s is None:
        return q
    return q.astype(jnp.float32) * s[..., None]
