"""FlashAttention forward and backward Pallas kernels (TPU and GPU/Triton variants).

Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691): the forward pass tiles queries and
keys, keeps a running row max `m`, row sum `l` and f32 accumulator per query tile (online
softmax) and never materialises the [T, S] score matrix; it saves the output and the per-row
log-sum-exp. The backward pass recomputes each score tile from q, k and the log-sum-exp and
runs as two kernels, one accumulating dK/dV over query tiles, one accumulating dQ over key
tiles (as in jax's `pallas/ops/tpu/flash_attention.py`).

Two variants share the per-tile math (`_logits`, `_softmax_step`, `_grad_tile`):
- `backend="tpu"`: the key axis is the innermost ("arbitrary") grid axis; m, l and the
  accumulators live in VMEM scratch across its steps; index maps clamp skipped key tiles to a
  visible one so no DMA is issued for them. m/l are kept lane-replicated as f32[bq, 128].
- `backend="gpu"`: Triton grid programs run in parallel, so each program holds a whole
  query tile (or key tile for dK/dV) and loops over the other axis with `lax.fori_loop`,
  carrying m, l and the accumulators in registers. head_dim is zero-padded to a power of two.
Causal and sliding-window tiles that are entirely masked are skipped by both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.flash_attention.block_sizes import BlockSizes
from kernels_pallas.flash_attention.reference import MASK_VALUE, SegmentIds, split_segment_ids

__all__ = ["flash_attention", "BlockSizes", "SegmentIds"]

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


def _tpu_ids(qid_ref, kvid_ref):
    if qid_ref is None:
        return None, None
    return qid_ref[...][:, :1], kvid_ref[...][:1, :]  # i32[bq, 1], i32[1, bk]


def _tpu_fwd_kernel(
    q_ref, k_ref, v_ref, qid_ref, kvid_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, cfg
):
    i, j, nk = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_in_range(j, _kv_range(i, bq, bk, nk, cfg)))
    def _step():
        q_ids, kv_ids = _tpu_ids(qid_ref, kvid_ref)
        s, mask, _ = _logits(q_ref[...], k_ref[...], i * bq, j * bk, q_ids, kv_ids, cfg)
        m, l, acc = _softmax_step(s, mask, v_ref[...], m_sc[...], l_sc[...], acc_sc[...], cfg)
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when(j == nk - 1)
    def _store():
        out, lse = _finish(m_sc[...], l_sc[...], acc_sc[...])
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


def _tpu_id_arrays(q_ids, kv_ids):
    """Segment ids laid out as jax's TPU kernels do: i32[B, T, 128] and i32[B, 8, S]."""
    if q_ids is None:
        return None, None
    b, t = q_ids.shape
    s = kv_ids.shape[1]
    q_ids = lax.broadcast_in_dim(q_ids.astype(jnp.int32), (b, t, _LANES), (0, 1))
    kv_ids = lax.broadcast_in_dim(kv_ids.astype(jnp.int32), (b, _SUBLANES, s), (0, 2))
    return q_ids, kv_ids


def _tpu_forward(cfg, q, k, v, q_ids, kv_ids):
    b, n, t, h = q.shape
    s = k.shape[2]
    bq, bk = cfg.block_sizes.block_q, cfg.block_sizes.block_k
    nq, nk = t // bq, s // bk
    g = cfg.groups

    def q_map(bi, ni, i, j):
        return (bi, ni, i, 0)

    def kv_map(bi, ni, i, j):
        return (bi, lax.div(ni, g), _clamp(j, _kv_range(i, bq, bk, nk, cfg), nk), 0)

    qid_arr, kvid_arr = _tpu_id_arrays(q_ids, kv_ids)
    qid_spec = kvid_spec = None
    if qid_arr is not None:
        qid_spec = pl.BlockSpec((None, bq, _LANES), lambda bi, ni, i, j: (bi, i, 0))
        kvid_spec = pl.BlockSpec(
            (None, _SUBLANES, bk),
            lambda bi, ni, i, j: (bi, 0, _clamp(j, _kv_range(i, bq, bk, nk, cfg), nk)),
        )
    o, lse = pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, cfg=cfg),
        grid=(b, n, nq, nk),
        in_specs=[
            pl.BlockSpec((None, None, bq, h), q_map),
            pl.BlockSpec((None, None, bk, h), kv_map),
            pl.BlockSpec((None, None, bk, h), kv_map),
            qid_spec,
            kvid_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, h), q_map),
            pl.BlockSpec((None, None, bq, _LANES), q_map),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, n, t, _LANES), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, h), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, qid_arr, kvid_arr)
    return o, lse  # lse: f32[B, N, T, 128], lane-replicated


def _tpu_dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    do_ref,
    lse_ref,
    qid_ref,
    kvid_ref,
    dk_ref,
    dv_ref,
    dk_sc,
    dv_sc,
    *,
    cfg,
):
    j, gi, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    ng, nq = pl.num_programs(3), pl.num_programs(4)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(jnp.logical_and(gi == 0, i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_in_range(i, _q_range(j, bq, bk, nq, cfg)))
    def _step():
        q, do = q_ref[...], do_ref[...]
        delta = jnp.sum(
            do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1, keepdims=True
        )
        q_ids, kv_ids = _tpu_ids(qid_ref, kvid_ref)
        p, ds = _grad_tile(
            q, k_ref[...], v_ref[...], do, lse_ref[...], delta, i * bq, j * bk, q_ids, kv_ids, cfg
        )
        dv_sc[...] += _dot(p.astype(do.dtype), do, _TN, cfg)
        dk_sc[...] += _dot(ds.astype(q.dtype), q, _TN, cfg)

    @pl.when(jnp.logical_and(gi == ng - 1, i == nq - 1))
    def _store():
        dk_ref[...] = (dk_sc[...] * cfg.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_dq_kernel(
    q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, qid_ref, kvid_ref, dq_ref, dq_sc, *, cfg
):
    i, j, nk = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_in_range(j, _kv_range(i, bq, bk, nk, cfg)))
    def _step():
        do = do_ref[...]
        delta = jnp.sum(
            do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1, keepdims=True
        )
        k = k_ref[...]
        q_ids, kv_ids = _tpu_ids(qid_ref, kvid_ref)
        _, ds = _grad_tile(
            q_ref[...], k, v_ref[...], do, lse_ref[...], delta, i * bq, j * bk, q_ids, kv_ids, cfg
        )
        dq_sc[...] += _dot(ds.astype(k.dtype), k, _NN, cfg)

    @pl.when(j == nk - 1)
    def _store():
        dq_ref[...] = (dq_sc[...] * cfg.sm_scale).astype(dq_ref.dtype)


def _tpu_backward(cfg, q, k, v, q_ids, kv_ids, o, lse, do):
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    g = cfg.groups
    qid_arr, kvid_arr = _tpu_id_arrays(q_ids, kv_ids)
    params = pltpu.CompilerParams

    # dK/dV: grid (B, K, key tile j, group member gi, query tile i); accumulate over (gi, i).
    bq, bk = cfg.block_sizes.dkv
    nq, nk = t // bq, s // bk

    def q_map(bi, ki, j, gi, i):
        return (bi, ki * g + gi, _clamp(i, _q_range(j, bq, bk, nq, cfg), nq), 0)

    def kv_map(bi, ki, j, gi, i):
        return (bi, ki, j, 0)

    qo_spec = pl.BlockSpec((None, None, bq, h), q_map)
    kv_spec = pl.BlockSpec((None, None, bk, h), kv_map)
    id_specs = [None, None]
    if qid_arr is not None:
        id_specs = [
            pl.BlockSpec(
                (None, bq, _LANES),
                lambda bi, ki, j, gi, i: (bi, _clamp(i, _q_range(j, bq, bk, nq, cfg), nq), 0),
            ),
            pl.BlockSpec((None, _SUBLANES, bk), lambda bi, ki, j, gi, i: (bi, 0, j)),
        ]
    dk, dv = pl.pallas_call(
        functools.partial(_tpu_dkv_kernel, cfg=cfg),
        grid=(b, kh, nk, g, nq),
        in_specs=[
            qo_spec,
            kv_spec,
            kv_spec,
            qo_spec,
            qo_spec,
            pl.BlockSpec((None, None, bq, _LANES), q_map),
            *id_specs,
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)],
        compiler_params=params(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
        ),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, o, do, lse, qid_arr, kvid_arr)

    # dQ: grid (B, N, query tile i, key tile j); accumulate over j.
    bq, bk = cfg.block_sizes.dq
    nq, nk = t // bq, s // bk

    def q_map2(bi, ni, i, j):
        return (bi, ni, i, 0)

    def kv_map2(bi, ni, i, j):
        return (bi, lax.div(ni, g), _clamp(j, _kv_range(i, bq, bk, nk, cfg), nk), 0)

    qo_spec = pl.BlockSpec((None, None, bq, h), q_map2)
    kv_spec = pl.BlockSpec((None, None, bk, h), kv_map2)
    id_specs = [None, None]
    if qid_arr is not None:
        id_specs = [
            pl.BlockSpec((None, bq, _LANES), lambda bi, ni, i, j: (bi, i, 0)),
            pl.BlockSpec(
                (None, _SUBLANES, bk), lambda bi, ni, i, j: (bi, 0, kv_map2(bi, ni, i, j)[2])
            ),
        ]
    dq = pl.pallas_call(
        functools.partial(_tpu_dq_kernel, cfg=cfg),
        grid=(b, n, nq, nk),
        in_specs=[
            qo_spec,
            kv_spec,
            kv_spec,
            qo_spec,
            qo_spec,
            pl.BlockSpec((None, None, bq, _LANES), q_map2),
            *id_specs,
        ],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)],
        compiler_params=params(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, o, do, lse, qid_arr, kvid_arr)
    return dq, dk, dv


# ----------------------------------------------------------------------------- GPU variant


def _gpu_fwd_kernel(q_ref, k_ref, v_ref, qid_ref, kvid_ref, o_ref, lse_ref, *, cfg, bk):
    i = pl.program_id(2)
    bq, hp = q_ref.shape
    nk = k_ref.shape[0] // bk
    q = q_ref[...]
    q_ids = None if qid_ref is None else qid_ref[...][:, None]  # i32[bq, 1]

    def body(j, carry):
        m, l, acc = carry
        ks = pl.ds(j * bk, bk)
        kv_ids = None if kvid_ref is None else kvid_ref[ks][None, :]  # i32[1, bk]
        s, mask, _ = _logits(q, k_ref[ks, :], i * bq, j * bk, q_ids, kv_ids, cfg)
        return _softmax_step(s, mask, v_ref[ks, :], m, l, acc, cfg)

    lo, hi = _kv_range(i, bq, bk, nk, cfg)
    init = (
        jnp.full((bq, 1), -jnp.inf, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, hp), jnp.float32),
    )
    out, lse = _finish(*lax.fori_loop(lo, hi, body, init))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(bq)


def _gpu_dkv_kernel(
    q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, qid_ref, kvid_ref, dk_ref, dv_ref, *, cfg, bq
):
    # q/o/do refs: [G, T, Hp] (the query heads of this KV head); lse: [G, T].
    j = pl.program_id(2)
    bk, hp = k_ref.shape
    ng, nq = q_ref.shape[0], q_ref.shape[1] // bq
    k, v = k_ref[...], v_ref[...]
    kv_ids = None if kvid_ref is None else kvid_ref[...][None, :]
    lo, hi = _q_range(j, bq, bk, nq, cfg)

    def head_body(gi, carry):
        def body(i, carry):
            dk, dv = carry
            qs = pl.ds(i * bq, bq)
            q, do = q_ref[gi, qs, :], do_ref[gi, qs, :]
            delta = jnp.sum(
                do.astype(jnp.float32) * o_ref[gi, qs, :].astype(jnp.float32),
                axis=1,
                keepdims=True,
            )
            lse = lse_ref[gi, qs][:, None]
            q_ids = None if qid_ref is None else qid_ref[qs][:, None]
            p, ds = _grad_tile(q, k, v, do, lse, delta, i * bq, j * bk, q_ids, kv_ids, cfg)
            dv = dv + _dot(p.astype(do.dtype), do, _TN, cfg)
            dk = dk + _dot(ds.astype(q.dtype), q, _TN, cfg)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros((bk, hp), jnp.float32)
    dk, dv = lax.fori_loop(0, ng, head_body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _gpu_dq_kernel(
    q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, qid_ref, kvid_ref, dq_ref, *, cfg, bk
):
    i = pl.program_id(2)
    bq, hp = q_ref.shape
    nk = k_ref.shape[0] // bk
    q, do = q_ref[...], do_ref[...]
    delta = jnp.sum(do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1, keepdims=True)
    lse = lse_ref[...][:, None]
    q_ids = None if qid_ref is None else qid_ref[...][:, None]

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k = k_ref[ks, :]
        kv_ids = None if kvid_ref is None else kvid_ref[ks][None, :]
        _, ds = _grad_tile(q, k, v_ref[ks, :], do, lse, delta, i * bq, j * bk, q_ids, kv_ids, cfg)
        return dq + _dot(ds.astype(k.dtype), k, _NN, cfg)

    lo, hi = _kv_range(i, bq, bk, nk, cfg)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, hp), jnp.float32))
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _gpu_pad(x, hp):
    h = x.shape[-1]
    return x if h == hp else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, hp - h)])


def _gpu_params(hp):
    return plgpu.CompilerParams(num_warps=4 if hp <= 64 else 8, num_stages=2)


def _gpu_id_specs(q_ids, q_block, kv_block):
    """BlockSpecs for i32[B, T] / i32[B, S] segment ids; q/kv blocks are (size, index fn)."""
    if q_ids is None:
        return [None, None]
    return [
        pl.BlockSpec((None, q_block[0]), q_block[1]),
        pl.BlockSpec((None, kv_block[0]), kv_block[1]),
    ]


def _gpu_forward(cfg, q, k, v, q_ids, kv_ids):
    b, n, t, h = q.shape
    s = k.shape[2]
    hp = max(16, pl.next_power_of_2(h))
    q, k, v = (_gpu_pad(x, hp) for x in (q, k, v))
    bq, bk = cfg.block_sizes.block_q, cfg.block_sizes.block_k
    g = cfg.groups
    ids = _gpu_id_specs(q_ids, (bq, lambda bi, ni, i: (bi, i)), (s, lambda bi, ni, i: (bi, 0)))
    o, lse = pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, cfg=cfg, bk=bk),
        grid=(b, n, t // bq),
        in_specs=[
            pl.BlockSpec((None, None, bq, hp), lambda bi, ni, i: (bi, ni, i, 0)),
            pl.BlockSpec((None, None, s, hp), lambda bi, ni, i: (bi, lax.div(ni, g), 0, 0)),
            pl.BlockSpec((None, None, s, hp), lambda bi, ni, i: (bi, lax.div(ni, g), 0, 0)),
            *ids,
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, hp), lambda bi, ni, i: (bi, ni, i, 0)),
            pl.BlockSpec((None, None, bq), lambda bi, ni, i: (bi, ni, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, n, t), jnp.float32),
        ],
        compiler_params=_gpu_params(hp),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, q_ids, kv_ids)
    return o[..., :h], lse  # lse: f32[B, N, T]


def _gpu_backward(cfg, q, k, v, q_ids, kv_ids, o, lse, do):
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    hp = max(16, pl.next_power_of_2(h))
    q, k, v, o, do = (_gpu_pad(x, hp) for x in (q, k, v, o, do))
    g = cfg.groups

    bq, bk = cfg.block_sizes.dkv
    grp = pl.BlockSpec((None, g, t, hp), lambda bi, ki, j: (bi, ki, 0, 0))
    kv_spec = pl.BlockSpec((None, None, bk, hp), lambda bi, ki, j: (bi, ki, j, 0))
    ids = _gpu_id_specs(q_ids, (t, lambda bi, ki, j: (bi, 0)), (bk, lambda bi, ki, j: (bi, j)))
    dk, dv = pl.pallas_call(
        functools.partial(_gpu_dkv_kernel, cfg=cfg, bq=bq),
        grid=(b, kh, s // bk),
        in_specs=[
            grp,
            kv_spec,
            kv_spec,
            grp,
            grp,
            pl.BlockSpec((None, g, t), lambda bi, ki, j: (bi, ki, 0)),
            *ids,
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_gpu_params(hp),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, o, do, lse, q_ids, kv_ids)

    bq, bk = cfg.block_sizes.dq
    qo_spec = pl.BlockSpec((None, None, bq, hp), lambda bi, ni, i: (bi, ni, i, 0))
    kv_spec = pl.BlockSpec((None, None, s, hp), lambda bi, ni, i: (bi, lax.div(ni, g), 0, 0))
    ids = _gpu_id_specs(q_ids, (bq, lambda bi, ni, i: (bi, i)), (s, lambda bi, ni, i: (bi, 0)))
    dq = pl.pallas_call(
        functools.partial(_gpu_dq_kernel, cfg=cfg, bk=bk),
        grid=(b, n, t // bq),
        in_specs=[
            qo_spec,
            kv_spec,
            kv_spec,
            qo_spec,
            qo_spec,
            pl.BlockSpec((None, None, bq), lambda bi, ni, i: (bi, ni, i)),
            *ids,
        ],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_gpu_params(hp),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, o, do, lse, q_ids, kv_ids)
    return dq[..., :h], dk[..., :h], dv[..., :h]


# ----------------------------------------------------------------------------- custom_vjp


def _forward(cfg, q, k, v, q_ids, kv_ids):
    impl = _tpu_forward if cfg.backend == "tpu" else _gpu_forward
    return impl(cfg, q, k, v, q_ids, kv_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, q_ids, kv_ids):
    return _forward(cfg, q, k, v, q_ids, kv_ids)[0]


def _flash_fwd(cfg, q, k, v, q_ids, kv_ids):
    o, lse = _forward(cfg, q, k, v, q_ids, kv_ids)
    return o, (q, k, v, q_ids, kv_ids, o, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, q_ids, kv_ids, o, lse = residuals
    impl = _tpu_backward if cfg.backend == "tpu" else _gpu_backward
    dq, dk, dv = impl(cfg, q, k, v, q_ids, kv_ids, o, lse, do)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public API


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check(
    q, k, v, q_ids, kv_ids, block_sizes: BlockSizes, backend: str, sliding_window, logit_softcap
):
    """Static checks; every message names the offending combination and what is supported."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {BACKENDS}")
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q [B, N, T, H] and k, v [B, K, S, H] of equal shape; got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    b, n, t, h = q.shape
    kb, kh, s, kh_dim = k.shape
    if kb != b or kh_dim != h:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of KV heads K={kh} (GQA/MQA)")
    for x in (q, k, v):
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"dtype {x.dtype} is not supported; use float32 or bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q_ids is not None and (q_ids.shape != (b, t) or kv_ids.shape != (b, s)):
        raise ValueError(
            f"segment ids must be i32[B, T]={(b, t)} and i32[B, S]={(b, s)}; got "
            f"{q_ids.shape} and {kv_ids.shape}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 token")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap={logit_softcap} must be > 0")
    if h % 8:
        raise ValueError(f"head_dim={h} is not supported: it must be a multiple of 8")
    for name, (bq, bk) in (
        ("forward", (block_sizes.block_q, block_sizes.block_k)),
        ("dkv", block_sizes.dkv),
        ("dq", block_sizes.dq),
    ):
        if t % bq or s % bk:
            raise ValueError(
                f"{name} blocks (block_q={bq}, block_k={bk}) must divide the query length "
                f"T={t} and key length S={s}; pick blocks that divide them or pad the sequence"
            )
        if backend == "gpu" and not (_is_pow2(bq) and _is_pow2(bk) and bq >= 16 and bk >= 16):
            raise ValueError(
                f"backend='gpu' {name} blocks (block_q={bq}, block_k={bk}) must be powers of "
                "two >= 16 (Triton tile shapes)"
            )
        if backend == "tpu" and bk % _LANES and bk != s:
            raise ValueError(
                f"backend='tpu' {name} block_k={bk} must be a multiple of {_LANES} (TPU lanes) "
                f"or equal the key length S={s}"
            )


_DEFAULT_BLOCK_SIZES = BlockSizes()


def flash_attention(
    q: jax.Array,  # f32/bf16[B, N, T, H]
    k: jax.Array,  # f32/bf16[B, K, S, H]
    v: jax.Array,  # f32/bf16[B, K, S, H]
    *,
    segment_ids: jax.Array | SegmentIds | None = None,
    causal: bool = True,
    sm_scale: float,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: BlockSizes = _DEFAULT_BLOCK_SIZES,
    backend: str = "tpu",
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # q.dtype[B, N, T, H]
    """Exact attention without materialising the [T, S] score matrix (FlashAttention-2).

    Args:
      q: f32/bf16[B, N, T, H] queries (RoPE applied).
      k: f32/bf16[B, K, S, H] keys; N % K == 0, query head n reads KV head n // (N // K)
        (K == N: MHA, 1 < K < N: GQA, K == 1: MQA).
      v: f32/bf16[B, K, S, H] values; same dtype as q and k.
      segment_ids: None; i32[B, T] ids for queries and keys (needs T == S), which makes a
        ragged prefill batch of many packed sequences one call; or `SegmentIds(q, kv)`.
        Query and key attend only when their ids are equal.
      causal: keep key positions <= query position. Positions are bottom-right aligned:
        query t is at `t + S - T`, key s at `s`.
      sm_scale: logit scale, usually H ** -0.5.
      logit_softcap: if set, logits become `cap * tanh(sm_scale * q.k / cap)` (Gemma 2).
      sliding_window: if set, keep `q_pos - k_pos < sliding_window` (Mistral, Gemma), tokens.
      block_sizes: tile sizes of the forward and the two backward kernels.
      backend: "tpu" (Mosaic: BlockSpecs + VMEM scratch for m, l, acc) or "gpu" (Triton:
        in-kernel loop over tiles; head_dim zero-padded to a power of two >= 16).
      interpret: False runs the compiled kernel on the device. True runs Pallas' generic
        interpreter (any backend, CPU included). For backend="tpu",
        `pltpu.InterpretParams()` runs the TPU interpreter instead (Mosaic semantics: VMEM
        scratch, DMAs, grid order; slower).

    Returns:
      q.dtype[B, N, T, H]; a row with no visible key is 0. Accumulation is in float32.
      Differentiable: a `jax.custom_vjp` saves (q, k, v, out, log-sum-exp) and recomputes
      score tiles in a dK/dV kernel and a dQ kernel.

    Raises:
      ValueError: unknown backend; shapes/dtypes that do not match; head_dim not a multiple
        of 8; blocks that do not divide T and S; gpu blocks that are not powers of two >= 16;
        tpu block_k neither a multiple of 128 nor equal to S; sliding_window < 1;
        logit_softcap <= 0.
    """
    q_ids, kv_ids = split_segment_ids(segment_ids)
    _check(q, k, v, q_ids, kv_ids, block_sizes, backend, sliding_window, logit_softcap)
    if q_ids is not None:
        q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    cfg = _Config(
        causal=bool(causal),
        sm_scale=float(sm_scale),
        softcap=None if logit_softcap is None else float(logit_softcap),
        window=None if sliding_window is None else int(sliding_window),
        offset=k.shape[2] - q.shape[2],
        groups=q.shape[1] // k.shape[1],
        block_sizes=block_sizes,
        backend=backend,
        interpret=interpret,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    return _flash(cfg, q, k, v, q_ids, kv_ids)
