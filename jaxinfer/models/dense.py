"""Cache-less forward and greedy decoding over whole sequences: the simple path used by the
model-parity tests (the engine's paged path is checked against it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.attention import dense_attn_fn
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward
from jaxinfer.models.params import Params


@functools.partial(jax.jit, static_argnames=("cfg",))
def dense_logits(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits f32[B, S, V] of every position of i32[B, S] token sequences (no padding)."""
    b, s = tokens.shape
    segment_ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), s)
    positions = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)
    hidden, _ = forward(
        params,
        cfg,
        tokens.reshape(-1),
        positions,
        None,
        dense_attn_fn(cfg, segment_ids, positions),
    )
    return compute_logits(params, cfg, hidden).reshape(b, s, -1)


def dense_greedy(
    params: Params,
    cfg: ModelConfig,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy continuation of ``prompt`` by full recomputation each step (slow, simple, exact).

    The sequence is padded to a fixed length so it compiles once; padding sits after the live
    tokens, so causal masking keeps it invisible.
    """
    total = len(prompt) + max_new_tokens
    buf = np.zeros((1, total), np.int32)
    buf[0, : len(prompt)] = prompt
    out = []
    n = len(prompt)
    for _ in range(max_new_tokens):
        logits = dense_logits(params, cfg, jnp.asarray(buf))
        tok = int(jnp.argmax(logits[0, n - 1]))
        out.append(tok)
        if tok in stop_ids:
            break
        buf[0, n] = tok
        n += 1
    return out
