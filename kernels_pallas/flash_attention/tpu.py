"""FlashAttention forward and backward kernels for TPU (Mosaic)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.flash_attention.common import (
    _LANES,
    _NN,
    _SUBLANES,
    _TN,
    _clamp,
    _dot,
    _finish,
    _grad_tile,
    _in_range,
    _join_sinks,
    _kv_range,
    _logits,
    _q_range,
    _softmax_step,
)


def _tpu_ids(qid_ref, kvid_ref):
    if qid_ref is None:
        return None, None
    return qid_ref[...][:, :1], kvid_ref[...][:1, :]  # i32[bq, 1], i32[1, bk]


def _tpu_fwd_kernel(
    q_ref, k_ref, v_ref, qid_ref, kvid_ref, sink_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, cfg
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
        sinks = None if sink_ref is None else sink_ref[...]  # f32[bq, 128]
        out, lse = _finish(*_join_sinks(m_sc[...], l_sc[...], acc_sc[...], sinks))
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


def tpu_forward(cfg, q, k, v, q_ids, kv_ids, sinks=None):
    """The forward pass on TPU (Mosaic): ``(o, lse)`` for ``kernel.flash_attention``'s
    custom_vjp (shapes as there: q f[B, N, T, H], k/v f[B, K, S, H]; sinks f32[N] or None)."""
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
    sink_arr = sink_spec = None
    if sinks is not None:  # each head's sink, lane-replicated like m and l
        sink_arr = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (n, bq, _LANES))
        sink_spec = pl.BlockSpec((None, bq, _LANES), lambda bi, ni, i, j: (ni, 0, 0))
    o, lse = pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, cfg=cfg),
        grid=(b, n, nq, nk),
        in_specs=[
            pl.BlockSpec((None, None, bq, h), q_map),
            pl.BlockSpec((None, None, bk, h), kv_map),
            pl.BlockSpec((None, None, bk, h), kv_map),
            qid_spec,
            kvid_spec,
            sink_spec,
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
    )(q, k, v, qid_arr, kvid_arr, sink_arr)
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


def tpu_backward(cfg, q, k, v, q_ids, kv_ids, o, lse, do):
    """The backward pass on TPU (Mosaic): ``(dq, dk, dv)`` from the forward's ``o``, ``lse``
    and the output gradient ``do`` (``kernel.flash_attention``'s custom_vjp)."""
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
