"""Ragged paged attention, GPU variant (Pallas on Triton).

One program per (decode row, KV head) for decode rows, and per (prefill row, KV head, query
block of that row) for prefill rows; each program loops over the KV blocks its queries can see
(causal and sliding-window bounds), loading ``pages_per_block`` pages per iteration by gathering
page ids from the block table. The decode launch pads the G query heads of a KV head to 16 rows
(the smallest ``tl.dot``); a decode-only step never launches the prefill kernel. An int8 pool's
scales (``f32[L, K, P, Z]``, flattened like the pages to ``[L * K * P, Z]``) are gathered with the
same page ids as the pages and the tiles dequantized to f32 (``int8 * scale``) before the dots,
which then run in f32 at HIGHEST precision.

Learned from jax's ``pallas/ops/gpu/paged_attention.py`` (page gather ``k_pages_ref[ids]``,
online softmax in registers); the code is our own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.ragged_paged_attention.block_sizes import BlockSizes

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _pow2(x: int) -> bool:
    return x > 0 and not x & (x - 1)


def check_supported(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pool_elems: int,
    block_sizes: BlockSizes,
) -> None:
    """Raises ValueError naming the combination when the GPU kernel cannot tile it."""
    problems = []
    if num_heads % num_kv_heads or not _pow2(num_heads // num_kv_heads):
        problems.append(
            f"num_heads={num_heads}, num_kv_heads={num_kv_heads} (supported: "
            "num_heads // num_kv_heads a power of two)"
        )
    if not _pow2(head_dim) or not 16 <= head_dim <= 256:
        problems.append(f"head_dim={head_dim} (supported: powers of two 16..256)")
    if not _pow2(page_size):
        problems.append(f"page_size={page_size} (supported: powers of two)")
    if not _pow2(block_sizes.pages_per_block) or block_sizes.pages_per_block * page_size < 16:
        problems.append(
            f"pages_per_block={block_sizes.pages_per_block} (supported: a power of "
            "two with pages_per_block * page_size >= 16)"
        )
    if pool_elems >= 2**31:
        problems.append(f"a KV pool of {pool_elems} elements (supported: < 2**31, int32 offsets)")
    if problems:
        raise ValueError("pallas_gpu ragged paged attention cannot run " + "; ".join(problems))


def _kv_span(kv_len, pos_min, pos_max, window):
    end = jnp.minimum(kv_len, pos_max + 1)
    start = jnp.where(window > 0, jnp.maximum(pos_min - window + 1, 0), 0)
    return start, end


def _attend(
    q,
    kv_refs,
    bt_ref,
    row,
    base,
    start,
    end,
    mask_fn,
    sinks=None,
    *,
    ppb,
    z,
    scale,
    softcap,
    precision,
):
    """Online softmax of q [R, H] over the KV blocks holding keys [start, end). f32[R, H].

    kv_refs: (k, v) pages [L * K * P, Z, H], or (k, v, k scales, v scales) of int8 pages with
    scales f32[L * K * P, Z]. sinks: f32[R] attention-sink logit of each query row, joined to
    its max and denominator at the end, or None.
    """
    r, h = q.shape
    bk = ppb * z
    quant = len(kv_refs) == 4
    if quant:
        q = q.astype(jnp.float32)

    def body(j, carry):
        acc, m, l = carry
        ids = base + bt_ref[row, pl.ds(j * ppb, ppb)]
        k = kv_refs[0][ids].reshape(bk, h)
        v = kv_refs[1][ids].reshape(bk, h)
        if quant:
            k = k.astype(jnp.float32) * kv_refs[2][ids].reshape(bk)[:, None]
            v = v.astype(jnp.float32) * kv_refs[3][ids].reshape(bk)[:, None]
        s = (
            jax.lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        mask = mask_fn(j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :])
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.dot(
            p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32
        )
        return acc, m_new, l

    init = (
        jnp.zeros((r, h), jnp.float32),
        jnp.full((r,), MASK_VALUE, jnp.float32),
        jnp.zeros((r,), jnp.float32),
    )
    acc, m, l = jax.lax.fori_loop(start // bk, pl.cdiv(end, bk), body, init)
    if sinks is not None:  # one more logit per row, with no value
        m_new = jnp.maximum(m, sinks)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.exp(sinks - m_new)
        acc = alpha[:, None] * acc
    # A query that sees no key (padding) gets 0, never NaN: its K/V reach the null page.
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]


def _decode_kernel(sc_ref, lens_ref, bt_ref, q_ref, *refs, kh, num_pages, has_sinks, **kw):
    *kv_refs, o_ref = refs
    sinks = None
    if has_sinks:
        *kv_refs, sink_ref = kv_refs
        sinks = sink_ref[...]
    b, hd = pl.program_id(0), pl.program_id(1)
    layer, window = sc_ref[0], sc_ref[1]
    kv_len = lens_ref[b]
    start, end = _kv_span(kv_len, kv_len - 1, kv_len - 1, window)

    def mask_fn(kv_pos):
        return (kv_pos >= start) & (kv_pos < end)

    base = (layer * kh + hd) * num_pages
    o_ref[...] = _attend(q_ref[...], kv_refs, bt_ref, b, base, start, end, mask_fn, sinks, **kw)


def _prefill_kernel(
    sc_ref, lens_ref, cu_ref, bt_ref, q_ref, *refs, kh, num_pages, g, bq, has_sinks, **kw
):
    *kv_refs, _, o_ref = refs  # the output's initial zeros, aliased to o_ref
    sink_ref = None
    if has_sinks:
        *kv_refs, sink_ref = kv_refs
    row, hd, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = sc_ref[0], sc_ref[1]
    kv_len, c1 = lens_ref[row], cu_ref[row + 1]
    t0 = cu_ref[row] + i * bq

    @pl.when(t0 < c1)
    def _():
        rows = bq * g
        tok = t0 + jnp.arange(rows, dtype=jnp.int32) // g
        valid = tok < c1
        q_pos = (kv_len - c1 + tok)[:, None]
        t1 = jnp.minimum(t0 + bq, c1)
        start, end = _kv_span(kv_len, kv_len - c1 + t0, kv_len - c1 + t1 - 1, window)

        def mask_fn(kv_pos):
            vis = valid[:, None] & (kv_pos < kv_len) & (kv_pos <= q_pos)
            return vis & ((window <= 0) | (q_pos - kv_pos < window))

        q = q_ref[pl.ds(t0 * g, rows), :]
        base = (layer * kh + hd) * num_pages
        sinks = None if sink_ref is None else sink_ref[...]
        out = _attend(q, kv_refs, bt_ref, row, base, start, end, mask_fn, sinks, **kw)
        plgpu.store(
            o_ref.at[pl.ds(t0 * g, rows), :], out, mask=jnp.broadcast_to(valid[:, None], out.shape)
        )


def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [L, K, P, Z, H]
    v_pages: jax.Array,  # [L, K, P, Z, H]
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, M]
    cu_q_lens: jax.Array,  # i32[B + 1]
    window: jax.Array,  # i32[]
    layer: jax.Array,  # i32[]
    *,
    num_decode: int,
    scale: float,
    softcap: float | None = None,
    block_sizes: BlockSizes,
    interpret: bool = False,
    num_warps: int = 4,
    k_scales: jax.Array | None = None,  # f32[L, K, P, Z]; int8 pages only
    v_scales: jax.Array | None = None,  # f32[L, K, P, Z]; int8 pages only
    sinks: jax.Array | None = None,  # f32[K, G]
) -> jax.Array:
    """GPU ragged paged attention; the contract is ``kernels_pallas.ragged_paged_attention``'s."""
    t, n, h = q.shape
    nl, kh, num_pages, z, _ = k_pages.shape
    g = n // kh
    ppb, bq = block_sizes.pages_per_block, block_sizes.q_block
    m = block_tables.shape[1]
    mp = pl.cdiv(m, ppb) * ppb
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, mp - m)))
    k_flat = k_pages.reshape(nl * kh * num_pages, z, h)
    v_flat = v_pages.reshape(nl * kh * num_pages, z, h)
    kv = [k_flat, v_flat]
    if k_scales is not None:
        kv += [k_scales.reshape(nl * kh * num_pages, z), v_scales.reshape(nl * kh * num_pages, z)]
    sc = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    kv_lens = kv_lens.astype(jnp.int32)
    f32 = q.dtype == jnp.float32 or k_scales is not None  # int8 pages: f32 dots
    precision = jax.lax.Precision.HIGHEST if f32 else None
    kw = dict(
        kh=kh,
        num_pages=num_pages,
        ppb=ppb,
        z=z,
        scale=scale,
        softcap=softcap,
        precision=precision,
        has_sinks=sinks is not None,
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    td = num_decode
    outs = []
    if td:
        gp = max(16, 1 << (g - 1).bit_length())
        qd = jnp.pad(q[:td].reshape(td, kh, g, h), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
        bt, lens = block_tables[:td], kv_lens[:td]
        spec = pl.BlockSpec((None, None, gp, h), lambda b, hd: (b, hd, 0, 0))
        extra, extra_specs = [], []
        if sinks is not None:  # each KV head's G query heads, padded like the queries
            extra = [jnp.pad(sinks, ((0, 0), (0, gp - g)))]
            extra_specs = [pl.BlockSpec((None, gp), lambda b, hd: (hd, 0))]
        out = pl.pallas_call(
            functools.partial(_decode_kernel, **kw),
            grid=(td, kh),
            in_specs=[whole(sc), whole(lens), whole(bt), spec, *map(whole, kv), *extra_specs],
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct((td, kh, gp, h), jnp.float32),
            compiler_params=params,
            interpret=interpret,
            name="ragged_paged_attention_decode",
        )(sc, lens, bt, qd, *kv, *extra)
        outs.append(out[:, :, :g].reshape(td, n, h))
    tp = t - td
    if tp:
        bt, lens = block_tables[td:], kv_lens[td:]
        cu = cu_q_lens[td:].astype(jnp.int32) - td
        bp = bt.shape[0]
        tpad = tp + bq  # a query block may start at any token: room for its tail
        qp = jnp.pad(q[td:], ((0, bq), (0, 0), (0, 0))).reshape(tpad, kh, g, h)
        qp = qp.transpose(1, 0, 2, 3).reshape(kh, tpad * g, h)
        spec = pl.BlockSpec((None, tpad * g, h), lambda r, hd, i: (hd, 0, 0))
        extra, extra_specs = [], []
        if sinks is not None:  # a query block's rows are (token, head of the group), token-major
            extra = [jnp.tile(sinks, (1, bq))]
            extra_specs = [pl.BlockSpec((None, bq * g), lambda r, hd, i: (hd, 0))]
        out = pl.pallas_call(
            functools.partial(_prefill_kernel, g=g, bq=bq, **kw),
            grid=(bp, kh, pl.cdiv(tp, bq)),
            in_specs=[
                whole(sc),
                whole(lens),
                whole(cu),
                whole(bt),
                spec,
                *map(whole, kv),
                *extra_specs,
                spec,
            ],
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct((kh, tpad * g, h), jnp.float32),
            # Tokens of no row (padding) are never stored: they keep the zeros of the input.
            input_output_aliases={5 + len(kv) + len(extra): 0},
            compiler_params=params,
            interpret=interpret,
            name="ragged_paged_attention_prefill",
        )(sc, lens, cu, bt, qp, *kv, *extra, jnp.zeros((kh, tpad * g, h), jnp.float32))
        out = out.reshape(kh, tpad, g, h).transpose(1, 0, 2, 3)[:tp].reshape(tp, n, h)
        outs.append(out)
    return jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
