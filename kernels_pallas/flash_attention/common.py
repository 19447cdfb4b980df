"""FlashAttention kernels: backend-independent tile math and configuration (tpu.py, gpu.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

from kernels_pallas.flash_attention.block_sizes import BlockSizes
from kernels_pallas.flash_attention.reference import MASK_VALUE

BACKENDS = ("tpu", "gpu")
_LANES = 128  # TPU vector lane count: m/l/lse tiles are lane-replicated to this width.
_SUBLANES = 8
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static description of one call; hashable, so it is a custom_vjp nondiff argument."""

    causal: bool
    sm_scale: float
    softcap: float | None
    window: int | None
    offset: int  # S - T: query t sits at position t + offset (bottom-right alignment).
    groups: int  # G = N // K
    block_sizes: BlockSizes
    backend: str
    interpret: Any
    precision: Any  # HIGHEST for f32 inputs (no TF32 on GPU), None for bf16.


# ----------------------------------------------------------------------------- tile math


def _dot(a, b, dims, cfg):
    return lax.dot_general(a, b, dims, precision=cfg.precision, preferred_element_type=jnp.float32)


def _logits(q, k, q_start, k_start, q_ids, kv_ids, cfg):
    """Scores of one tile after scale, soft-cap and mask.

    q: [bq, H], k: [bk, H]; q_ids i32[bq, 1] / kv_ids i32[1, bk] or None.
    Returns (s f32[bq, bk] with MASK_VALUE where masked, mask bool[bq, bk] or None,
    tanh f32[bq, bk] of the soft-cap or None).
    """
    bq, bk = q.shape[0], k.shape[0]
    s = _dot(q, k, _NT, cfg) * cfg.sm_scale  # f32[bq, bk]
    t = None
    if cfg.softcap is not None:
        t = jnp.tanh(s / cfg.softcap)
        s = cfg.softcap * t
    mask = None
    if cfg.causal or cfg.window is not None:
        q_pos = q_start + cfg.offset + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        if cfg.causal:
            mask = k_pos <= q_pos
        if cfg.window is not None:
            in_window = q_pos - k_pos < cfg.window
            mask = in_window if mask is None else mask & in_window
    if q_ids is not None:
        same = q_ids == kv_ids  # bool[bq, bk]
        mask = same if mask is None else mask & same
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    return s, mask, t


def _col(x):
    """[bq, 1] view of a row statistic stored as [bq, 1] or lane-replicated [bq, 128]."""
    return x if x.shape[1] == 1 else x[:, :1]


def _softmax_step(s, mask, v, m_prev, l_prev, acc, cfg):
    """One online-softmax update; m/l are f32[bq, 1 or 128], acc f32[bq, H]."""
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - _col(m_next))  # f32[bq, bk]
    if mask is not None:  # a fully masked row so far must not count its MASK_VALUE entries
        p = jnp.where(mask, p, 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc = _col(alpha) * acc + _dot(p.astype(v.dtype), v, _NN, cfg)
    return m_next, l_next, acc


def _join_sinks(m, l, acc, sinks):
    """(m, l, acc) with attention-sink logits ``sinks`` (shaped as m) joined to the row max and
    sum, with no value (gpt-oss); None: unchanged."""
    if sinks is None:
        return m, l, acc
    m_next = jnp.maximum(m, sinks)
    alpha = jnp.exp(m - m_next)
    return m_next, alpha * l + jnp.exp(sinks - m_next), _col(alpha) * acc


def _finish(m, l, acc):
    """Output tile and log-sum-exp; rows that saw no key give 0 and lse = +inf."""
    l_col = _col(l)
    out = acc / jnp.where(l_col == 0.0, 1.0, l_col)
    lse = jnp.where(l == 0.0, jnp.inf, m + jnp.log(jnp.where(l == 0.0, 1.0, l)))
    return out, lse


def _grad_tile(q, k, v, do, lse, delta, q_start, k_start, q_ids, kv_ids, cfg):
    """Recompute one tile; return (p f32[bq, bk], ds f32[bq, bk]) with ds = dL/d(q.k)/scale."""
    s, _, t = _logits(q, k, q_start, k_start, q_ids, kv_ids, cfg)
    p = jnp.exp(s - _col(lse))  # masked entries: exp(MASK_VALUE - lse) == 0
    dp = _dot(do, v, _NT, cfg)  # f32[bq, bk]
    ds = p * (dp - _col(delta))
    if t is not None:  # d(cap * tanh(x / cap))/dx = 1 - tanh^2
        ds = ds * (1.0 - t * t)
    return p, ds


def _kv_range(i, bq, bk, nk, cfg):
    """Key tiles [lo, hi) that query tile i can see (others are fully masked)."""
    first_q = i * bq + cfg.offset
    lo, hi = 0, nk
    if cfg.causal:  # last query of the tile: first_q + bq - 1; keep k_start <= it
        hi = jnp.minimum(nk, lax.div(jnp.maximum(first_q + bq, 0) + bk - 1, bk))
    if cfg.window is not None:  # keep first_q - k_last < window
        lo = lax.div(jnp.maximum(first_q - cfg.window + 1, 0), bk)
    return lo, hi


def _q_range(j, bq, bk, nq, cfg):
    """Query tiles [lo, hi) that key tile j is visible to."""
    first_k = j * bk - cfg.offset
    lo, hi = 0, nq
    if cfg.causal:
        lo = lax.div(jnp.maximum(first_k, 0), bq)
    if cfg.window is not None:
        y = jnp.maximum(cfg.window + first_k + bk - 1, 0)
        hi = jnp.minimum(nq, lax.div(y + bq - 1, bq))
    return lo, hi


def _in_range(x, lo_hi):
    lo, hi = lo_hi
    return jnp.logical_and(x >= lo, x < hi)


def _clamp(x, lo_hi, n):
    lo, hi = lo_hi
    return jnp.clip(jnp.clip(x, lo, hi - 1), 0, n - 1)


# ----------------------------------------------------------------------------- TPU variant
