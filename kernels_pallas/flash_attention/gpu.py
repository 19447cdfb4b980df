"""FlashAttention forward and backward kernels for GPU (Triton)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.flash_attention.common import (
    _NN,
    _TN,
    _dot,
    _finish,
    _grad_tile,
    _join_sinks,
    _kv_range,
    _logits,
    _q_range,
    _softmax_step,
)


def _gpu_fwd_kernel(q_ref, k_ref, v_ref, qid_ref, kvid_ref, sink_ref, o_ref, lse_ref, *, cfg, bk):
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
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    sinks = None if sink_ref is None else sink_ref[...][:, None]  # f32[bq, 1]
    out, lse = _finish(*_join_sinks(m, l, acc, sinks))
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


def gpu_forward(cfg, q, k, v, q_ids, kv_ids, sinks=None):
    """The forward pass on GPU (Triton): ``(o, lse)`` for ``kernel.flash_attention``'s
    custom_vjp (shapes as there: q f[B, N, T, H], k/v f[B, K, S, H]; sinks f32[N] or None)."""
    b, n, t, h = q.shape
    s = k.shape[2]
    hp = max(16, pl.next_power_of_2(h))
    q, k, v = (_gpu_pad(x, hp) for x in (q, k, v))
    bq, bk = cfg.block_sizes.block_q, cfg.block_sizes.block_k
    g = cfg.groups
    ids = _gpu_id_specs(q_ids, (bq, lambda bi, ni, i: (bi, i)), (s, lambda bi, ni, i: (bi, 0)))
    sink_arr = sink_spec = None
    if sinks is not None:  # each head's sink, one per query row of the tile
        sink_arr = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (n, bq))
        sink_spec = pl.BlockSpec((None, bq), lambda bi, ni, i: (ni, 0))
    o, lse = pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, cfg=cfg, bk=bk),
        grid=(b, n, t // bq),
        in_specs=[
            pl.BlockSpec((None, None, bq, hp), lambda bi, ni, i: (bi, ni, i, 0)),
            pl.BlockSpec((None, None, s, hp), lambda bi, ni, i: (bi, lax.div(ni, g), 0, 0)),
            pl.BlockSpec((None, None, s, hp), lambda bi, ni, i: (bi, lax.div(ni, g), 0, 0)),
            *ids,
            sink_spec,
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
    )(q, k, v, q_ids, kv_ids, sink_arr)
    return o[..., :h], lse  # lse: f32[B, N, T]


def gpu_backward(cfg, q, k, v, q_ids, kv_ids, o, lse, do):
    """The backward pass on GPU (Triton): ``(dq, dk, dv)`` from the forward's ``o``, ``lse``
    and the output gradient ``do`` (``kernel.flash_attention``'s custom_vjp)."""
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
