"""Ragged paged attention, pure-XLA reference, and the per-step attention metadata pytree.

One engine step attends a flat ragged batch of T query tokens against the paged KV cache. Rows
(sequences) are ordered decode first: rows ``[0, num_decode)`` have exactly one query token each
(tokens ``[0, num_decode)``); the remaining rows are prefill chunks whose tokens follow,
concatenated without padding between them (``cu_q_lens``). Padding rows/tokens sit at the end of
each region, have ``kv_len == 0`` and write to the null page.

The decode region attends each token only to its own sequence's pages (``[T, S]`` scores), so a
decode-only step never pays for prefill. The prefill region cuts each row's chunk into query blocks
of Q tokens, each attending only to its own row's pages (``[NB, Q, S]`` scores). The Pallas kernels
(``kernels_pallas/``) plug in behind ``attn_impl`` with the same metadata; which implementation
runs is ``jaxinfer.models.attn_dispatch``'s choice.

Sources: vLLM PagedAttention (Kwon et al. 2023); jax's
``pallas/ops/tpu/ragged_paged_attention`` (metadata names: cu_q_lens, kv_lens, page indices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import jaxinfer.models.cpu_decode_kernel as cpu_decode_kernel
from jaxinfer.models.attention import MASK_VALUE, add_sinks, masked_softmax_av, window_mask
from jaxinfer.models.attn_dispatch import XLA_IMPLS, resolve_attn_impl
from jaxinfer.models.kv_cache import KVCache, write_kv
from jaxinfer.quant.kv import dequantize_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a ragged step sits. Shapes are padded to buckets.

    Attributes:
        positions: i32[T] position of each token in its sequence.
        slot_mapping: i32[T] flat KV slot (page * Z + offset) each token's K/V is written to.
        block_tables: i32[B, M] page ids of each row's sequence (null page beyond its length).
        kv_lens: i32[B] tokens in each row's KV cache after this step's writes (0 for padding).
        cu_q_lens: i32[B + 1] cumulative query tokens per row (row b owns tokens
            ``[cu_q_lens[b], cu_q_lens[b + 1])``).
        seq_ids: i32[T] row of each token (padding tokens: a padding row).
        num_decode: static number of decode rows (= decode tokens) at the front, padding included.
    """

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    seq_ids: jax.Array
    num_decode: int = dataclasses.field(metadata=dict(static=True), default=0)


def _num_kv_heads(pages: jax.Array, page_major: bool) -> int:
    return pages.shape[-3] if page_major else pages.shape[-4]


def _gather_pages(
    pages: jax.Array, layer, block_tables: jax.Array, page_major: bool = False
) -> jax.Array:
    """Pages [K, P, Z, H] (or [L, K, P, Z, H] with ``layer``; page-major: [(L,) P, K, Z, H]),
    i32[B, M] -> [K, B, M * Z, H].

    Indexing the layer inside the same gather avoids copying the layer's whole pool.
    """
    kh = _num_kv_heads(pages, page_major)
    z, h = pages.shape[-2:]
    b, m = block_tables.shape
    if page_major:
        g = pages[block_tables] if layer is None else pages[layer, block_tables]  # [B, M, K, Z, H]
    elif layer is None:
        return pages[:, block_tables].reshape(kh, b, m * z, h)
    else:
        g = pages[layer, :, block_tables]  # [B, M, K, Z, H]
    return g.transpose(2, 0, 1, 3, 4).reshape(kh, b, m * z, h)


def _gather_scales(
    scales: jax.Array | None, layer, block_tables: jax.Array, page_major: bool = False
) -> jax.Array | None:
    """int8-cache scales [L, K, P, Z] (or [K, P, Z] without ``layer``; page-major: [(L,) P, K, Z]),
    i32[B, M] -> [K, B, M * Z]."""
    if scales is None:
        return None
    return _gather_pages(scales[..., None], layer, block_tables, page_major)[..., 0]


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, P, Z, H], or [L, K, P, Z, H] with layer
    v_pages: jax.Array,  # [K, P, Z, H], or [L, K, P, Z, H] with layer
    md: AttentionMetadata,
    window: jax.Array,  # i32[]
    *,
    scale: float,
    softcap: float | None = None,
    layer: jax.Array | None = None,  # i32[]
    k_scales: jax.Array | None = None,  # f32[K, P, Z], or [L, K, P, Z] with layer; int8 cache
    v_scales: jax.Array | None = None,
    prefill: PrefillLayout | None = None,
    page_major: bool = False,
    decode_kernel: bool = False,
    sinks: jax.Array | None = None,  # [N] attention-sink logits
) -> jax.Array:
    """Causal attention of a ragged batch over the paged KV cache. Output f32[T, N, H].

    ``sinks``: per-head logits joined to each softmax's denominator (``masked_softmax_av``).

    ``page_major``: the pages (and scales) are in the ``[(L,) P, K, Z, H]`` layout
    (``KVCache.page_major``).

    ``decode_kernel``: the decode rows go to the native CPU kernel (``cpu_decode_kernel``;
    ``attn_impl="cpu_kernel"``), which needs a page-major float32 pool (ValueError otherwise).

    ``prefill``: the prefill region's query blocks, ``prefill_layout(md, T - num_decode)``; pass it
    to compute it once per step rather than once per layer (None: computed here).

    An int8 cache (``k_scales``/``v_scales`` given) is dequantized after the page gather.

    The K/V of this step's tokens must already be written to the pages. Sliding window
    (``window > 0``): a query at position i sees keys at j with ``i - j < window``.
    """
    t, n, h = q.shape
    kh = _num_kv_heads(k_pages, page_major)
    g = n // kh
    td = md.num_decode
    outs = []
    if td:
        out = _decode_attention(
            q[:td].reshape(td, kh, g, h),
            k_pages,
            v_pages,
            md.block_tables[:td],
            md.kv_lens[:td],
            md.positions[:td],
            window,
            scale=scale,
            softcap=softcap,
            layer=layer,
            k_scales=k_scales,
            v_scales=v_scales,
            page_major=page_major,
            decode_kernel=decode_kernel,
            sinks=None if sinks is None else sinks.reshape(kh, g),
        )
        outs.append(out.reshape(td, n, h))
    tp = t - td
    if tp:
        lay = prefill if prefill is not None else prefill_layout(md, tp)
        outs.append(
            _prefill_attention(
                q[td:],
                k_pages,
                v_pages,
                lay,
                window,
                scale=scale,
                softcap=softcap,
                layer=layer,
                k_scales=k_scales,
                v_scales=v_scales,
                page_major=page_major,
                sinks=None if sinks is None else sinks.reshape(kh, g),
            )
        )
    return jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def paged_attn_fn(cfg, md: AttentionMetadata, attn_impl: str = "xla"):
    """An ``AttnFn`` for ``model.forward`` over a ``KVCache``: writes this step's K/V at
    ``md.slot_mapping`` then attends. A float or an int8 cache (``KVCache.k_scales/v_scales``)
    works with every ``attn_impl``. Raises ValueError for an unknown or unavailable
    ``attn_impl`` (see ``resolve_attn_impl``)."""
    impl = resolve_attn_impl(attn_impl)
    tp = md.positions.shape[0] - md.num_decode
    prefill = prefill_layout(md, tp) if impl in XLA_IMPLS and tp else None

    def attn(q, k, v, cache: KVCache, layer, window, sinks=None):
        cache = write_kv(cache, layer, k, v, md.slot_mapping)
        if impl in XLA_IMPLS:
            out = ragged_paged_attention_xla(
                q,
                cache.k_pages,
                cache.v_pages,
                md,
                window,
                scale=cfg.attn_scale,
                softcap=cfg.attn_logit_softcap,
                layer=layer,
                k_scales=cache.k_scales,
                v_scales=cache.v_scales,
                prefill=prefill,
                page_major=cache.page_major,
                decode_kernel=impl == "cpu_kernel",
                sinks=sinks,
            )
        else:
            if cache.page_major:
                raise ValueError(
                    f"attn_impl={attn_impl!r} reads the head-major KV pool "
                    "[L, K, P, Z, H]; a page-major pool runs with attn_impl='xla'"
                )
            from kernels_pallas.ragged_paged_attention import ragged_paged_attention

            out = ragged_paged_attention(
                q,
                cache.k_pages,
                cache.v_pages,
                md.kv_lens,
                md.block_tables,
                md.cu_q_lens,
                window,
                layer,
                cache.k_scales,
                cache.v_scales,
                num_decode=md.num_decode,
                scale=cfg.attn_scale,
                softcap=cfg.attn_logit_softcap,
                backend="tpu" if impl.startswith("pallas_tpu") else "gpu",
                interpret=impl.endswith("_interpret"),
                sinks=sinks,
            )
        return out, cache

    return attn


def prefill_query_block(num_tokens: int, num_rows: int) -> int:
    """Query block size Q of the XLA prefill attention for Tp tokens over Bp rows (static): a
    row's share of the tokens rounded up to a power of two, at least 8. Each block gathers its
    row's pages, so fewer, larger blocks gather less; smaller ones waste fewer padded queries."""
    share = -(-num_tokens // max(num_rows, 1))
    return max(8, 1 << (share - 1).bit_length())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillLayout:
    """Query blocks of a step's prefill region (``prefill_layout``), shared by every layer.

    Attributes:
        tokens: i32[NB, Q] token (index into the prefill region) of each block slot, clamped.
        valid: bool[NB, Q] the slot holds a real token of the block's row.
        positions: i32[NB, Q] position of each slot's token.
        block_tables: i32[NB, M] page ids of each block's row.
        kv_lens: i32[NB] KV length of each block's row.
        src: i32[Tp] block slot (flat ``b * Q + i``) of each token of the region.
    """

    tokens: jax.Array
    valid: jax.Array
    positions: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    src: jax.Array


def prefill_layout(md: AttentionMetadata, num_prefill_tokens: int) -> PrefillLayout:
    """The query blocks of the prefill region of ``md`` (its last ``num_prefill_tokens`` tokens).

    Row r's chunk is cut into ceil(len_r / Q) blocks of Q tokens (``prefill_query_block``);
    NB = floor((Tp + Bp (Q - 1)) / Q) >= sum over rows of ceil(len_r / Q), since sum(len_r) <= Tp.
    Blocks past the last row's are padding (all slots invalid).
    """
    tp, td = num_prefill_tokens, md.num_decode
    bt = md.block_tables[td:]
    bp = bt.shape[0]
    qb = prefill_query_block(tp, bp)
    nb = (tp + bp * (qb - 1)) // qb
    starts = md.cu_q_lens[td:] - md.cu_q_lens[td]  # i32[Bp + 1] row starts in the region
    blocks_per_row = -(-(starts[1:] - starts[:-1]) // qb)
    blk_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks_per_row)])
    blk = jnp.arange(nb, dtype=jnp.int32)
    # Row of each block / token: how many rows end at or before it (clamped for padding).
    blk_row = jnp.minimum(jnp.sum(blk_cu[1:][None, :] <= blk[:, None], axis=1), bp - 1)
    first = starts[blk_row] + (blk - blk_cu[blk_row]) * qb  # first token of each block
    tok = first[:, None] + jnp.arange(qb, dtype=jnp.int32)[None, :]  # [NB, Q]
    valid = (blk < blk_cu[-1])[:, None] & (tok < starts[blk_row + 1][:, None])
    tok = jnp.clip(tok, 0, tp - 1)
    t_idx = jnp.arange(tp, dtype=jnp.int32)
    t_row = jnp.minimum(jnp.sum(starts[1:][None, :] <= t_idx[:, None], axis=1), bp - 1)
    rel = t_idx - starts[t_row]
    src = jnp.clip((blk_cu[t_row] + rel // qb) * qb + rel % qb, 0, nb * qb - 1)
    return PrefillLayout(
        tokens=tok,
        valid=valid,
        positions=md.positions[td:][tok],
        block_tables=bt[blk_row],
        kv_lens=md.kv_lens[td:][blk_row],
        src=src,
    )


def _prefill_attention(
    q,
    k_pages,
    v_pages,
    lay: PrefillLayout,
    window,
    *,
    scale,
    softcap,
    layer,
    k_scales,
    v_scales,
    page_major: bool = False,
    sinks: jax.Array | None = None,  # [K, G]
) -> jax.Array:
    """The prefill region of ``ragged_paged_attention_xla``: f32[Tp, N, H].

    Each query block (``prefill_layout``) attends only to its own row's pages, so the scores are
    ``[NB, Q, N, S]`` with NB <= Tp/Q + Bp, rather than every token against every prefill row's
    pages (``[Tp, N, Bp * S]``). Queries and outputs move between token and block order by gathers.
    """
    _, n, h = q.shape
    kh = _num_kv_heads(k_pages, page_major)
    nb, qb = lay.tokens.shape
    # Head-major [K, NB, ...] throughout: the dots' batch dims (K, NB) lead on both operands and on
    # the result, so XLA neither transposes the gathered pages nor the scores.
    qq = q[lay.tokens].reshape(nb, qb, kh, n // kh, h).transpose(2, 0, 1, 3, 4)  # [K, NB, Q, G, H]
    kp = _gather_pages(k_pages, layer, lay.block_tables, page_major)  # [K, NB, S, H]
    vp = _gather_pages(v_pages, layer, lay.block_tables, page_major)
    kp = dequantize_kv(kp, _gather_scales(k_scales, layer, lay.block_tables, page_major))
    vp = dequantize_kv(vp, _gather_scales(v_scales, layer, lay.block_tables, page_major))
    kv_pos = jnp.arange(kp.shape[2], dtype=jnp.int32)[None, None, :]
    mask = (
        lay.valid[:, :, None]
        & (kv_pos < lay.kv_lens[:, None, None])
        & window_mask(lay.positions[:, :, None], kv_pos, window)
    )
    scores = jnp.einsum("KBQGH,KBSH->KBQGS", qq, kp, preferred_element_type=jnp.float32)
    out = masked_softmax_av(
        scores,
        mask[None, :, :, None, :],
        lambda p: jnp.einsum("KBQGS,KBSH->KBQGH", p, vp.astype(jnp.float32)),
        scale=scale,
        softcap=softcap,
        sinks=None if sinks is None else sinks[:, None, None, :],
    )  # [K, NB, Q, G, H]
    out = out.transpose(1, 2, 0, 3, 4).reshape(nb * qb, n, h)
    return out[lay.src]


# Decode rows wider than this many pages are cut into work items of this many pages (split-KV,
# flash-decoding style): each item's gathered K/V stays small, and only items holding live tokens
# are computed, so a step's cost follows its live pages rather than rows x the widest row.
# 16 items a group: a group's gathered K and V (a few MB at the 110M shapes) stay in cache for
# its dots; 32 cost more CPU (scripts/bench_decode_attention.py, docs/performance.md).
DECODE_PAGES_PER_CHUNK = 4
DECODE_ITEMS_PER_GROUP = 16


def _decode_attention(
    qd,
    k_pages,
    v_pages,
    bt,
    kv_lens,
    q_pos,
    window,
    *,
    scale,
    softcap,
    layer,
    k_scales,
    v_scales,
    pages_per_chunk: int | None = None,
    page_major: bool = False,
    decode_kernel: bool = False,
    sinks: jax.Array | None = None,  # [K, G]
) -> jax.Array:
    """The decode region of ``ragged_paged_attention_xla``: qd [Td, K, G, H] -> f32[Td, K, G, H].

    Tables of at most ``pages_per_chunk`` pages are attended in one pass. Wider ones are split:
    a work item is (row, chunk of C pages) for each chunk holding some of the row's tokens; the
    items are processed ``DECODE_ITEMS_PER_GROUP`` at a time (a ``fori_loop`` over the groups
    holding live items only), each giving a partial (max, sum, unnormalized output), and the
    partials of a row are merged by segment max / sum, the split-KV reduction of flash-decoding.
    Cost follows the live pages (rounded up to C per row), not Td x M.

    With ``decode_kernel``, the native CPU kernel computes it instead (``cpu_decode_kernel``: the
    same attention, reading a page-major float32 pool's pages in place; ValueError for another
    pool).

    Sources: flash-decoding (Dao et al. 2023), online softmax (Milakov & Gimelshein 2018).
    """
    if decode_kernel:
        if not page_major or k_scales is not None:
            raise ValueError(
                "attn_impl='cpu_kernel' reads a page-major float32 KV pool; this one "
                "is " + ("int8" if k_scales is not None else "head-major") + ": use attn_impl='xla'"
            )
        return cpu_decode_kernel.decode_attention(
            qd,
            k_pages,
            v_pages,
            bt,
            kv_lens,
            q_pos,
            window,
            scale=scale,
            softcap=softcap,
            layer=layer,
            sinks=sinks,
        )
    chunk = pages_per_chunk or DECODE_PAGES_PER_CHUNK
    k_pages, v_pages, bt, kv_lens, q_pos = map(jnp.asarray, (k_pages, v_pages, bt, kv_lens, q_pos))
    td, m = bt.shape
    z = k_pages.shape[-2]
    # Head-major [K, Td, ...] throughout: the dots' batch dims (K, Td) lead on both operands and on
    # the result, so XLA transposes neither the gathered pages nor the scores.
    qk = qd.transpose(1, 0, 2, 3)  # [K, Td, G, H]

    def scores_of(qk, btc, first_pos, kv_lens, q_pos):
        kc = dequantize_kv(
            _gather_pages(k_pages, layer, btc, page_major),
            _gather_scales(k_scales, layer, btc, page_major),
        )  # [K, Td, C * Z, H]
        vc = dequantize_kv(
            _gather_pages(v_pages, layer, btc, page_major),
            _gather_scales(v_scales, layer, btc, page_major),
        )
        kv_pos = first_pos[:, None] + jnp.arange(kc.shape[2], dtype=jnp.int32)[None, :]
        mask = (kv_pos < kv_lens[:, None]) & window_mask(q_pos[:, None], kv_pos, window)
        sc = jnp.einsum("KTGH,KTSH->KTGS", qk, kc, preferred_element_type=jnp.float32)
        return sc, mask[None, :, None, :], vc.astype(jnp.float32)

    if m <= chunk:
        sc, mask, vc = scores_of(qk, bt, jnp.zeros(td, jnp.int32), kv_lens, q_pos)
        out = masked_softmax_av(
            sc,
            mask,
            lambda p: jnp.einsum("KTGS,KTSH->KTGH", p, vc),
            scale=scale,
            softcap=softcap,
            sinks=None if sinks is None else sinks[:, None, :],
        )
        return out.transpose(1, 0, 2, 3)

    if m % chunk:  # pad the table with null pages (masked: past every kv_len)
        bt = jnp.pad(bt, ((0, 0), (0, chunk - m % chunk)), constant_values=0)
        m = bt.shape[1]
    nck = m // chunk
    gs = min(td * nck, DECODE_ITEMS_PER_GROUP)  # items per group
    ni = -(-td * nck // gs) * gs  # room for the most items a step can have, whole groups
    kh, g, h = qd.shape[1:]
    # Work items in row order: row r owns items [cu[r], cu[r + 1]), one per chunk it reaches.
    per_row = jnp.clip(-(-kv_lens // (chunk * z)), 0, nck)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_row, dtype=jnp.int32)])
    item = jnp.arange(ni, dtype=jnp.int32)
    item_row = jnp.minimum(jnp.sum(cu[1:][None, :] <= item[:, None], axis=1), td - 1)
    item_live = item < cu[-1]
    item_chunk = jnp.where(item_live, item - cu[item_row], 0)
    chunks = bt.reshape(td, nck, chunk)

    def body(grp, parts):
        m_all, l_all, acc_all = parts
        idx = grp * gs + jnp.arange(gs, dtype=jnp.int32)
        rows, cks = item_row[idx], item_chunk[idx]
        lens = jnp.where(item_live[idx], kv_lens[rows], 0)
        sc, mask, vc = scores_of(
            qk[:, rows], chunks[rows, cks], cks * (chunk * z), lens, q_pos[rows]
        )
        sc = sc * scale
        if softcap is not None:
            sc = jnp.tanh(sc / softcap) * softcap
        sc = jnp.where(mask, sc, MASK_VALUE)
        mx = jnp.max(sc, axis=-1)  # [K, Td, G]
        p = jnp.exp(sc - mx[..., None])
        part_l = jnp.sum(p, axis=-1)
        part_acc = jnp.einsum("KTGS,KTSH->KTGH", p, vc)
        at = grp * gs
        return (
            jax.lax.dynamic_update_slice(m_all, mx, (0, at, 0)),
            jax.lax.dynamic_update_slice(l_all, part_l, (0, at, 0)),
            jax.lax.dynamic_update_slice(acc_all, part_acc, (0, at, 0, 0)),
        )

    init = (
        jnp.full((kh, ni, g), MASK_VALUE, jnp.float32),
        jnp.zeros((kh, ni, g), jnp.float32),
        jnp.zeros((kh, ni, g, h), jnp.float32),
    )
    groups = jnp.clip(-(-cu[-1] // gs), 1, ni // gs)  # only groups holding live items run
    m_all, l_all, acc_all = jax.lax.fori_loop(0, groups, body, init)
    # Merge each row's partials (items past the live ones go to a dropped segment td).
    seg = jnp.where(item_live, item_row, td)
    row_max = jax.ops.segment_max(m_all.transpose(1, 0, 2), seg, num_segments=td + 1)  # [Td+1,K,G]
    w = jnp.exp(m_all.transpose(1, 0, 2) - row_max[seg])  # [NI, K, G]
    l_row = jax.ops.segment_sum(l_all.transpose(1, 0, 2) * w, seg, num_segments=td + 1)[:td]
    acc_row = jax.ops.segment_sum(
        acc_all.transpose(1, 0, 2, 3) * w[..., None], seg, num_segments=td + 1
    )[:td]
    _, l_row, acc_row = add_sinks(row_max[:td], l_row, acc_row, sinks)
    # Rows without items (padding rows, kv_len 0) have l = 0: their output is 0, not NaN.
    return jnp.where(l_row[..., None] > 0, acc_row / jnp.where(l_row > 0, l_row, 1)[..., None], 0.0)
