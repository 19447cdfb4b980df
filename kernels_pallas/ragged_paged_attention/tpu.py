"""Ragged paged attention, TPU variant (Mosaic): block table and lengths as scalar prefetch.

Two launches share one online-softmax body:

* decode rows (one query token each): grid ``(B_decode, K, KV blocks)``; a step holds the G query
  heads of one KV head and ``pages_per_block`` pages of K and V.
* prefill rows: the flat prefill tokens are cut into query blocks of ``q_block`` tokens; grid
  ``(K, query blocks, B_prefill, KV blocks)``; a step attends the tokens of one query block that
  belong to one row to one KV block of that row (steps of rows outside the block do nothing).

Pages are fetched from HBM by index: every page of a KV block is its own pipelined input whose
``index_map`` reads the block table from SMEM, so Pallas double-buffers the page DMAs. Index maps
clamp to the pages a step needs (below the causal/window bound, above the window start); repeated
block indices are not fetched again, so steps past a sequence's end cost no memory traffic.
An int8 pool adds one more pipelined input per page for each of K and V, its scales
``f32[Z, 1]`` (the ``[L, K, P, Z]`` scales viewed as ``[L, K, P, Z, 1]``, as jax's quantized
``paged_attention`` keeps them), fetched with the page's own index map; the tile is dequantized to
f32 (``int8 * scale``) before the dots.
A decode-only step never launches the prefill kernel (``num_decode`` is static).

Learned from jax's ``pallas/ops/tpu/paged_attention`` (one page per DMA, per-KV-head blocks) and
``ragged_paged_attention`` (cu_q_lens / kv_lens metadata); the code is our own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention.block_sizes import BlockSizes

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def check_supported(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
    """Raises ValueError naming the combination when the TPU kernel cannot tile it."""
    problems = []
    if num_heads % num_kv_heads:
        problems.append(f"num_heads={num_heads} not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim % 8 or head_dim > 512:
        problems.append(f"head_dim={head_dim} (supported: multiples of 8 up to 512)")
    if page_size % 8:
        problems.append(f"page_size={page_size} (supported: multiples of 8)")
    if problems:
        raise ValueError("pallas_tpu ragged paged attention cannot run " + "; ".join(problems))


def _load(ref, scale_ref):
    """A page tile [Z, H]; an int8 one dequantized to f32 with its scales f32[Z, 1]."""
    if scale_ref is None:
        return ref[...]
    return ref[...].astype(jnp.float32) * scale_ref[...]


def _update(
    q,
    k_refs,
    v_refs,
    ks_refs,
    vs_refs,
    m_ref,
    l_ref,
    acc_ref,
    mask_fn,
    kv_start,
    *,
    z,
    scale,
    softcap,
):
    """One KV block of the online softmax (Milakov & Gimelshein 2018; FlashAttention).

    q: [R, H]; each k/v ref: [Z, H]; ks/vs refs: f32[Z, 1] scales of int8 pages (empty for float
    pages); mask_fn(kv_pos i32[1, Z]) -> bool[R, Z].
    """
    if ks_refs:
        q = q.astype(jnp.float32)
    else:
        ks_refs = vs_refs = (None,) * len(k_refs)
    scores, masks = [], []
    for i, k_ref in enumerate(k_refs):
        s = (
            jax.lax.dot_general(
                q,
                _load(k_ref, ks_refs[i]),
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        kv_pos = kv_start + i * z + jax.lax.broadcasted_iota(jnp.int32, (1, z), 1)
        mask = mask_fn(kv_pos)
        scores.append(jnp.where(mask, s, MASK_VALUE))
        masks.append(mask)
    m_prev = m_ref[...]  # f32[R, 1]
    m_new = m_prev
    for s in scores:
        m_new = jnp.maximum(m_new, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_ref[...]
    acc = alpha * acc_ref[...]
    for s, mask, v_ref, vs_ref in zip(scores, masks, v_refs, vs_refs, strict=True):
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_new = l_new + jnp.sum(p, axis=1, keepdims=True)
        v = _load(v_ref, vs_ref)
        acc = acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_ref[...], l_ref[...], acc_ref[...] = m_new, l_new, acc


def _init(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _finish(o_ref, m_ref, l_ref, acc_ref, sink_ref=None):
    """The output tile acc / l; ``sink_ref`` f32[R, 1]: attention-sink logits joined to each
    row's max and denominator first (with no value), or None."""
    l, acc = l_ref[...], acc_ref[...]
    if sink_ref is not None:
        m, sink = m_ref[...], sink_ref[...]
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.exp(sink - m_new)
        acc = alpha * acc
    # A query that sees no key (padding) gets 0, never NaN: its K/V reach the null page.
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def _kv_span(kv_len, pos_min, pos_max, window):
    """Key tokens ``[start, end)`` that queries at positions [pos_min, pos_max] can see."""
    end = jnp.minimum(kv_len, pos_max + 1)
    start = jnp.where(window > 0, jnp.maximum(pos_min - window + 1, 0), 0)
    return start, end


def _page(j, i, start, end, *, ppb, z):
    """Page slot (within the row's block table) of page ``i`` of KV block ``j``, clamped to the
    pages holding ``[start, end)`` so steps outside re-use the last fetched page."""
    first = start // z
    last = jnp.maximum(jnp.maximum(end - 1, 0) // z, first)
    return jnp.clip(j * ppb + i, first, last)


# ---------------------------------------------------------------- decode


def _split_refs(refs, ppb, quant, has_sinks=False):
    """Kernel refs after q: K pages, V pages, [K scales, V scales,] [sinks,] then output and
    scratch. Returns (k, v, k scales, v scales, sinks ref or None, (output, m, l, acc))."""
    n = 4 if quant else 2
    k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
    ks_refs, vs_refs = (refs[2 * ppb : 3 * ppb], refs[3 * ppb : 4 * ppb]) if quant else ((), ())
    rest = refs[n * ppb :]
    sink_ref = rest[0] if has_sinks else None
    return k_refs, v_refs, ks_refs, vs_refs, sink_ref, tuple(rest[1:] if has_sinks else rest)


def _decode_kernel(
    layer_ref, window_ref, lens_ref, bt_ref, q_ref, *refs, ppb, z, scale, softcap, quant, has_sinks
):
    del layer_ref, bt_ref
    k_refs, v_refs, ks_refs, vs_refs, sink_ref, (o_ref, m_ref, l_ref, acc_ref) = _split_refs(
        refs, ppb, quant, has_sinks
    )
    b, j = pl.program_id(0), pl.program_id(2)
    kv_len, window = lens_ref[b], window_ref[0]
    q_pos = kv_len - 1
    start, end = _kv_span(kv_len, q_pos, q_pos, window)
    kv_start = j * ppb * z

    @pl.when(j == 0)
    def _():
        _init(m_ref, l_ref, acc_ref)

    @pl.when((kv_start < end) & (kv_start + ppb * z > start))
    def _():
        def mask_fn(kv_pos):
            return (kv_pos >= start) & (kv_pos < end)

        _update(
            q_ref[...],
            k_refs,
            v_refs,
            ks_refs,
            vs_refs,
            m_ref,
            l_ref,
            acc_ref,
            mask_fn,
            kv_start,
            z=z,
            scale=scale,
            softcap=softcap,
        )

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        _finish(o_ref, m_ref, l_ref, acc_ref, sink_ref)


def _scale_inputs(k_scales, v_scales, page_map, ppb, z):
    """BlockSpecs and operands of the scales of int8 pages (none for float pages): per page of a
    KV block, a f32[Z, 1] tile of the scales viewed as [L, K, P, Z, 1], at the page's index."""
    if k_scales is None:
        return [], []
    specs = [
        pl.BlockSpec((None, None, None, z, 1), functools.partial(page_map, i)) for i in range(ppb)
    ]
    return specs + specs, [k_scales[..., None]] * ppb + [v_scales[..., None]] * ppb


def _decode(
    q,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    kv_lens,
    block_tables,
    window,
    layer,
    sinks,
    *,
    scale,
    softcap,
    ppb,
    interpret,
):
    td, n, h = q.shape
    _, kh, _, z, _ = k_pages.shape
    g = n // kh
    m = block_tables.shape[1]
    nkb = pl.cdiv(m, ppb)

    def page_map(i, b, hd, j, layer_ref, window_ref, lens_ref, bt_ref):
        kv_len = lens_ref[b]
        start, end = _kv_span(kv_len, kv_len - 1, kv_len - 1, window_ref[0])
        p = _page(j, i, start, end, ppb=ppb, z=z)
        return (layer_ref[0], hd, bt_ref[b * m + jnp.minimum(p, m - 1)], 0, 0)

    page_specs = [
        pl.BlockSpec((None, None, None, z, h), functools.partial(page_map, i)) for i in range(ppb)
    ]
    scale_specs, scale_args = _scale_inputs(k_scales, v_scales, page_map, ppb, z)
    qo_spec = pl.BlockSpec((None, None, g, h), lambda b, hd, j, *_: (b, hd, 0, 0))
    sink_specs, sink_args = [], []
    if sinks is not None:  # f32[K, G, 1]: the G heads of KV head hd, one a row of the q tile
        sink_specs = [pl.BlockSpec((None, g, 1), lambda b, hd, j, *_: (hd, 0, 0))]
        sink_args = [sinks[..., None]]
    kernel = functools.partial(
        _decode_kernel,
        ppb=ppb,
        z=z,
        scale=scale,
        softcap=softcap,
        quant=k_scales is not None,
        has_sinks=sinks is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(td, kh, nkb),
            in_specs=[qo_spec] + page_specs + page_specs + scale_specs + sink_specs,
            out_specs=qo_spec,
            scratch_shapes=[
                pltpu.VMEM((g, 1), jnp.float32),
                pltpu.VMEM((g, 1), jnp.float32),
                pltpu.VMEM((g, h), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((td, kh, g, h), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(
        layer,
        window,
        kv_lens,
        block_tables.reshape(-1),
        q.reshape(td, kh, g, h),
        *([k_pages] * ppb),
        *([v_pages] * ppb),
        *scale_args,
        *sink_args,
    )
    return out.reshape(td, n, h)


# ---------------------------------------------------------------- prefill


def _row_span(i, r, lens_ref, cu_ref, window, bq):
    """Tokens ``[t0, t1)`` of query block ``i`` owned by row ``r`` and the keys they see."""
    kv_len, c0, c1 = lens_ref[r], cu_ref[r], cu_ref[r + 1]
    t0 = jnp.maximum(c0, i * bq)
    t1 = jnp.minimum(c1, (i + 1) * bq)
    # The queries of a row are the last q_len tokens of its kv_len (positions kv_len - q_len ...).
    start, end = _kv_span(kv_len, kv_len - c1 + t0, kv_len - c1 + t1 - 1, window)
    return t0, t1, start, end


def _prefill_kernel(
    layer_ref,
    window_ref,
    lens_ref,
    cu_ref,
    bt_ref,
    lo_ref,
    hi_ref,
    q_ref,
    *refs,
    ppb,
    z,
    g,
    bq,
    scale,
    softcap,
    quant,
    has_sinks,
):
    del layer_ref, bt_ref, lo_ref, hi_ref
    k_refs, v_refs, ks_refs, vs_refs, sink_ref, (o_ref, m_ref, l_ref, acc_ref) = _split_refs(
        refs, ppb, quant, has_sinks
    )
    i, r, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    window = window_ref[0]
    t0, t1, start, end = _row_span(i, r, lens_ref, cu_ref, window, bq)
    kv_start = j * ppb * z

    @pl.when((r == 0) & (j == 0))
    def _():
        _init(m_ref, l_ref, acc_ref)

    @pl.when((t0 < t1) & (kv_start < end) & (kv_start + ppb * z > start))
    def _():
        kv_len, c1 = lens_ref[r], cu_ref[r + 1]
        row = jax.lax.broadcasted_iota(jnp.int32, (bq * g, 1), 0)
        tok = i * bq + (row // g if g & (g - 1) else row >> (g.bit_length() - 1))
        q_pos = kv_len - c1 + tok  # [R, 1]
        in_row = (tok >= t0) & (tok < t1)

        def mask_fn(kv_pos):
            vis = in_row & (kv_pos < kv_len) & (kv_pos <= q_pos)
            return vis & ((window <= 0) | (q_pos - kv_pos < window))

        _update(
            q_ref[...],
            k_refs,
            v_refs,
            ks_refs,
            vs_refs,
            m_ref,
            l_ref,
            acc_ref,
            mask_fn,
            kv_start,
            z=z,
            scale=scale,
            softcap=softcap,
        )

    @pl.when((r == pl.num_programs(2) - 1) & (j == pl.num_programs(3) - 1))
    def _():
        _finish(o_ref, m_ref, l_ref, acc_ref, sink_ref)


def _prefill(
    q,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    kv_lens,
    block_tables,
    cu_q_lens,
    window,
    layer,
    sinks,
    *,
    scale,
    softcap,
    ppb,
    bq,
    interpret,
):
    tp, n, h = q.shape
    _, kh, _, z, _ = k_pages.shape
    g = n // kh
    bp, m = block_tables.shape
    nqb = pl.cdiv(tp, bq)
    nkb = pl.cdiv(m, ppb)
    # Rows meeting each query block: [lo, hi] (clamped to valid rows; steps outside them only
    # repeat a fetched block index).
    starts = jnp.arange(nqb, dtype=jnp.int32) * bq
    lo = jnp.sum(cu_q_lens[None, 1:] <= starts[:, None], axis=1).astype(jnp.int32)
    hi = jnp.sum(cu_q_lens[None, :-1] < starts[:, None] + bq, axis=1).astype(jnp.int32) - 1
    lo = jnp.clip(lo, 0, bp - 1)
    hi = jnp.clip(hi, lo, bp - 1)

    def page_map(p_i, hd, i, r, j, layer_ref, window_ref, lens_ref, cu_ref, bt_ref, lo_ref, hi_ref):
        # Rows before the block's first row take its KV block 0; after its last row, the last one.
        j = jnp.where(r < lo_ref[i], 0, jnp.where(r > hi_ref[i], nkb - 1, j))
        r = jnp.clip(r, lo_ref[i], hi_ref[i])
        _, _, start, end = _row_span(i, r, lens_ref, cu_ref, window_ref[0], bq)
        p = _page(j, p_i, start, end, ppb=ppb, z=z)
        return (layer_ref[0], hd, bt_ref[r * m + jnp.minimum(p, m - 1)], 0, 0)

    page_specs = [
        pl.BlockSpec((None, None, None, z, h), functools.partial(page_map, p)) for p in range(ppb)
    ]
    scale_specs, scale_args = _scale_inputs(k_scales, v_scales, page_map, ppb, z)
    qo_spec = pl.BlockSpec((None, bq * g, h), lambda hd, i, r, j, *_: (hd, i, 0))
    tpad = nqb * bq
    qt = jnp.pad(q, ((0, tpad - tp), (0, 0), (0, 0))).reshape(tpad, kh, g, h)
    qt = qt.transpose(1, 0, 2, 3).reshape(kh, tpad * g, h)
    sink_specs, sink_args = [], []
    if sinks is not None:  # f32[K, Q * G, 1]: rows (token, head of the group), token-major
        sink_specs = [pl.BlockSpec((None, bq * g, 1), lambda hd, i, r, j, *_: (hd, 0, 0))]
        sink_args = [jnp.tile(sinks, (1, bq))[..., None]]
    kernel = functools.partial(
        _prefill_kernel,
        ppb=ppb,
        z=z,
        g=g,
        bq=bq,
        scale=scale,
        softcap=softcap,
        quant=k_scales is not None,
        has_sinks=sinks is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(kh, nqb, bp, nkb),
            in_specs=[qo_spec] + page_specs + page_specs + scale_specs + sink_specs,
            out_specs=qo_spec,
            scratch_shapes=[
                pltpu.VMEM((bq * g, 1), jnp.float32),
                pltpu.VMEM((bq * g, 1), jnp.float32),
                pltpu.VMEM((bq * g, h), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((kh, tpad * g, h), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
    )(
        layer,
        window,
        kv_lens,
        cu_q_lens,
        block_tables.reshape(-1),
        lo,
        hi,
        qt,
        *([k_pages] * ppb),
        *([v_pages] * ppb),
        *scale_args,
        *sink_args,
    )
    out = out.reshape(kh, tpad, g, h).transpose(1, 0, 2, 3).reshape(tpad, n, h)
    return out[:tp]


def ragged_paged_attention_tpu(
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
    interpret=False,
    k_scales: jax.Array | None = None,  # f32[L, K, P, Z]; int8 pages only
    v_scales: jax.Array | None = None,  # f32[L, K, P, Z]; int8 pages only
    sinks: jax.Array | None = None,  # f32[K, G]
) -> jax.Array:
    """TPU ragged paged attention; see ``kernels_pallas.ragged_paged_attention`` for the contract.

    ``interpret``: False, or ``pltpu.InterpretParams()`` (True is taken as the latter) to run the
    Mosaic semantics on CPU.
    """
    if interpret is True:
        interpret = pltpu.InterpretParams()
    t = q.shape[0]
    ppb = min(block_sizes.pages_per_block, block_tables.shape[1])
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    window = jnp.asarray(window, jnp.int32).reshape(1)
    kv_lens, block_tables = kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32)
    td = num_decode
    outs = []
    if td:
        outs.append(
            _decode(
                q[:td],
                k_pages,
                v_pages,
                k_scales,
                v_scales,
                kv_lens[:td],
                block_tables[:td],
                window,
                layer,
                sinks,
                scale=scale,
                softcap=softcap,
                ppb=ppb,
                interpret=interpret,
            )
        )
    if t > td:
        cu = cu_q_lens[td:].astype(jnp.int32) - td
        outs.append(
            _prefill(
                q[td:],
                k_pages,
                v_pages,
                k_scales,
                v_scales,
                kv_lens[td:],
                block_tables[td:],
                cu,
                window,
                layer,
                sinks,
                scale=scale,
                softcap=softcap,
                ppb=ppb,
                bq=block_sizes.q_block,
                interpret=interpret,
            )
        )
    return jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
