"""Batch-invariant step: every token's numbers are the same whatever else is in the batch.

In the default step a matmul's or an attention's shape follows the batch (T tokens, B rows, the
block table's bucketed width M, the prefill query blocks), and XLA picks a different algorithm
(tiling, reduction order) for different shapes: a token's logits differ in the last bits with
the batch around it, and a near-tie between two tokens can flip (on XLA CPU, for one, the
output-first projection gives every row other last bits at T = 48 than at T = 64).

Here every computation a token's numbers pass through has a shape that does not depend on the
batch: ``map_token_tiles`` runs the per-token work (embedding, norms, projections, RoPE, MLP, LM
head) over tiles of ``TOKEN_TILE`` tokens, each tile one call of the same fixed-shape function
(``lax.map``), so a token's row meets the same compiled code wherever it sits. ``tiled_attention``
is one path for prefill and decode: per query token, the pages of its sequence in order
(``0 .. position // Z``), each page's scores and values folded into an online softmax; a page the
token does not see (past its position, before its window) is skipped by selection (its state is
kept, bit for bit), so the result does not depend on chunking, on the block table's padded width
or on which physical pages hold the keys (preemption, prefix sharing). K/V are written to the
pages before any token attends and are read back from them, so a chunked prefill equals a
one-shot prefill bitwise.

The sampling step runs in tiles of rows too (``step.sample_step_padded``): a row's
penalties, filters, draws and logprobs are reductions over its own vocabulary row with its own
key (``sampling.row_keys``), but XLA CPU compiles a reduction over [B, V] differently for small
B (a row's log-softmax differs between B = 2 and B = 64), so B must not reach the code either.

Cost: the weights are read once per tile instead of once per step, decode rows are padded to a
tile, and prefill tokens gather their pages one token at a time (``scripts/bench_serving.py
--batch-invariant``; docs/reproducibility.md). Sources: H. He and Thinking Machines Lab,
"Defeating Nondeterminism in LLM Inference" (2025); vLLM's batch-invariant mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.models.attention import MASK_VALUE, add_sinks
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward
from jaxinfer.models.kv_cache import KVCache, write_kv
from jaxinfer.models.paged_attention import AttentionMetadata
from jaxinfer.models.params import Params
from jaxinfer.quant.kv import dequantize_kv

TOKEN_TILE = 8
"""C, tokens per tile: every per-token computation runs on [C, ...] arrays. Larger tiles read the
weights fewer times per step but pad small batches more (a lone decode row is one tile)."""


def map_token_tiles(fn, *xs, tile: int = TOKEN_TILE):
    """``fn`` over tiles of ``tile`` tokens (or rows).

    Every array leaf of the pytrees ``xs`` has the token axis T first; each is zero-padded to a
    multiple of ``tile`` and cut into ``[T / tile, tile, ...]``. ``fn(*tile_xs)`` runs once per
    tile (``lax.map``: the same fixed-shape function every time, whatever T is) and the leaves
    of its output pytree, token axis first, are joined back and cut to T. ``fn`` must treat
    tokens independently (a padding token's output is dropped).
    """
    t = jax.tree_util.tree_leaves(xs)[0].shape[0]
    n = -(-t // tile)

    def tiles(x):
        x = jnp.pad(x, [(0, n * tile - t)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, tile, *x.shape[1:])

    out = jax.lax.map(lambda args: fn(*args), jax.tree_util.tree_map(tiles, xs))
    return jax.tree_util.tree_map(lambda y: y.reshape(n * tile, *y.shape[2:])[:t], out)


def _gather_page(pages: jax.Array | None, layer, ids: jax.Array, page_major: bool):
    """Page ``ids [C]`` of one layer: [L, P, K, Z, ...] (page-major) or [L, K, P, Z, ...] ->
    [C, K, Z, ...]; None passes."""
    if pages is None:
        return None
    return pages[layer, ids] if page_major else pages[layer, :, ids]


def tiled_attention(
    q: jax.Array,
    cache: KVCache,
    md: AttentionMetadata,
    layer,
    window,
    *,
    scale: float,
    softcap: float | None,
    tile: int = TOKEN_TILE,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of every query token over its sequence's pages. Output f32[T, N, H].

    Args:
        q: [T, N, H] queries, RoPE applied.
        cache: the page pool, this step's K/V already written.
        md: the step's metadata; a token's sequence is its row ``md.seq_ids`` (the same for
            decode and prefill tokens), padding tokens (row -1 or ``kv_len`` 0) give zeros.
        layer: i32[] layer index; window: i32[] sliding window in tokens, 0 = global.
        scale, softcap: score scale and soft-cap (None: off).
        sinks: [N] attention-sink logits joined to each head's softmax denominator, or None.
        tile: C, query tokens per ``lax.map`` call.

    Per token at position i, pages ``j = lo .. i // Z`` of its block table in order, with
    ``lo = max(0, i - window + 1) // Z`` (0 without a window): scores f32[K, G, Z] of the page
    (masked to the keys it sees: ``j Z + z <= i``, within the window), then the online-softmax
    update of (max, sum, output). Pages outside that range leave the state as it is (selected,
    not computed into it), so only the visible pages, always the same ones in the same order,
    shape the result. Sources: online softmax (Milakov & Gimelshein 2018), FlashAttention.
    """
    t, n, h = q.shape
    z = cache.page_size
    kh = cache.k_pages.shape[2 if cache.page_major else 1]
    g = n // kh
    rows = jnp.clip(md.seq_ids, 0, md.block_tables.shape[0] - 1)
    live = (md.seq_ids >= 0) & (md.kv_lens[rows] > 0)
    tables = md.block_tables[rows]  # i32[T, M]
    hi = jnp.where(live, md.positions // z, -1)  # last page of each token (-1: none)
    lo = jnp.where(window > 0, jnp.maximum(md.positions - window + 1, 0) // z, 0)
    m_width = tables.shape[1]

    def one_tile(q, pos, tab, lo, hi):
        qc = q.reshape(tile, kh, g, h)

        def body(j, state):
            m, l, acc = state  # f32[C, K, G], f32[C, K, G], f32[C, K, G, H]
            ids = jax.lax.dynamic_index_in_dim(tab, jnp.minimum(j, m_width - 1), 1, False)  # [C]
            kp = dequantize_kv(
                _gather_page(cache.k_pages, layer, ids, cache.page_major),
                _gather_page(cache.k_scales, layer, ids, cache.page_major),
            )
            vp = dequantize_kv(
                _gather_page(cache.v_pages, layer, ids, cache.page_major),
                _gather_page(cache.v_scales, layer, ids, cache.page_major),
            )
            kv_pos = j * z + jnp.arange(z, dtype=jnp.int32)  # i32[Z]
            seen = (kv_pos[None, :] <= pos[:, None]) & (
                (window <= 0) | (pos[:, None] - kv_pos[None, :] < window)
            )  # bool[C, Z]
            s = jnp.einsum("CKGH,CKZH->CKGZ", qc, kp, preferred_element_type=jnp.float32) * scale
            if softcap is not None:
                s = jnp.tanh(s / softcap) * softcap
            mask = seen[:, None, None, :]
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            vp = jnp.where(seen[:, None, :, None], vp.astype(jnp.float32), 0.0)  # stale slots
            l_new = alpha * l + jnp.sum(p, axis=-1)
            acc_new = alpha[..., None] * acc + jnp.einsum(
                "CKGZ,CKZH->CKGH", p, vp, preferred_element_type=jnp.float32
            )
            use = ((j >= lo) & (j <= hi))[:, None, None]  # this page is visible to the token
            return (
                jnp.where(use, m_new, m),
                jnp.where(use, l_new, l),
                jnp.where(use[..., None], acc_new, acc),
            )

        init = (
            jnp.full((tile, kh, g), MASK_VALUE, jnp.float32),
            jnp.zeros((tile, kh, g), jnp.float32),
            jnp.zeros((tile, kh, g, h), jnp.float32),
        )
        # Pages past every token's last one would be skipped anyway: stop at the tile's last.
        m, l, acc = jax.lax.fori_loop(
            jnp.min(jnp.where(hi >= 0, lo, m_width)), jnp.max(hi) + 1, body, init
        )
        m, l, acc = add_sinks(m, l, acc, None if sinks is None else sinks.reshape(kh, g))
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return out.reshape(tile, n, h)

    return map_token_tiles(one_tile, q, md.positions, tables, lo, hi, tile=tile)


def invariant_attn_fn(cfg: ModelConfig, md: AttentionMetadata, tile: int = TOKEN_TILE):
    """An ``AttnFn`` for ``model.forward`` over a ``KVCache``: writes this step's K/V at
    ``md.slot_mapping``, then ``tiled_attention``."""

    def attn(q, k, v, cache: KVCache, layer, window, sinks=None):
        cache = write_kv(cache, layer, k, v, md.slot_mapping)
        out = tiled_attention(
            q,
            cache,
            md,
            layer,
            window,
            scale=cfg.attn_scale,
            softcap=cfg.attn_logit_softcap,
            tile=tile,
            sinks=sinks,
        )
        return out, cache

    return attn


def invariant_forward_logits(
    params: Params,
    cfg: ModelConfig,
    kv: KVCache,
    tokens: jax.Array,
    md: AttentionMetadata,
    logits_indices: jax.Array,
    *,
    tile: int = TOKEN_TILE,
) -> tuple[KVCache, jax.Array]:
    """``step.forward_step``'s model part in batch-invariant form.

    Args:
        params, cfg: the model.
        kv: the page pool (returned updated).
        tokens: i32[T] token ids (placeholders already resolved).
        md: the step's metadata.
        logits_indices: i32[B] token of each row whose logits are wanted.
        tile: C, tokens per tile.

    Returns:
        (updated KV cache, logits f32[B, V]); each row's logits depend only on its own sequence.
    """
    tmap = lambda fn, *xs: map_token_tiles(fn, *xs, tile=tile)  # noqa: E731
    hidden, kv = forward(
        params, cfg, tokens, md.positions, kv, invariant_attn_fn(cfg, md, tile), token_map=tmap
    )
    return kv, tmap(lambda h: compute_logits(params, cfg, h), hidden[logits_indices])
