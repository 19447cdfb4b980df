"""Ragged paged attention (XLA reference) == dense causal attention, over random ragged batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.kv_cache import NULL_PAGE
from jaxinfer.models.paged_attention import AttentionMetadata, ragged_paged_attention_xla

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def dense_reference(q, k, v, q_pos, scale, window, softcap):
    """Numpy float64 attention of one sequence: q [Tq, N, H] at positions q_pos, k/v [S, K, H]."""
    n, kh = q.shape[1], k.shape[1]
    g = n // kh
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    s = np.einsum("tnh,snh->nts", q, k) * scale
    if softcap:
        s = np.tanh(s / softcap) * softcap
    kv_pos = np.arange(k.shape[0])
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= q_pos[:, None] - kv_pos[None, :] < window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nts,snh->tnh", p, v)


def numpy_int8_pages(x):
    """f32 pages [..., H] as an int8 pool in numpy, independent of ``jaxinfer.quant.kv``: per
    token and head, scale = max|x| / 127 and values = round(x / scale). Returns (i8 values,
    f32 scales [...], f32 dequantized pages values * scale)."""
    x = np.asarray(x, np.float32)
    s = np.abs(x).max(-1) / np.float32(127)
    q = np.clip(np.round(x / np.where(s == 0, 1, s)[..., None]), -127, 127).astype(np.int8)
    return q, s, q.astype(np.float32) * s[..., None]


def make_batch(rng, page_size, num_kv_heads, head_dim, seqs, num_pages=64, dtype=np.float32):
    """seqs: list of (kv_len, q_len); decode rows (q_len 1) must come first.

    Returns pages, metadata, per-sequence full K/V, and the row order."""
    k_pages = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(dtype)
    v_pages = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(dtype)
    free = list(rng.permutation(np.arange(1, num_pages)))
    nd = sum(1 for _, ql in seqs if ql == 1)
    td = 1 << max(nd - 1, 0).bit_length() if nd else 0
    prefill = [s for s in seqs if s[1] > 1]
    bp = 1 << max(len(prefill) - 1, 0).bit_length() if prefill else 0
    tp_live = sum(ql for _, ql in prefill)
    tp = max(16, 1 << max(tp_live - 1, 0).bit_length()) if prefill else 0
    max_pages = max(-(-kl // page_size) for kl, _ in seqs)
    m = 1 << max(max_pages - 1, 0).bit_length()
    t, b = td + tp, td + bp
    positions = np.zeros(t, np.int32)
    slots = np.zeros(t, np.int32)
    seq_ids = np.full(t, -1, np.int32)
    seq_ids[:td] = np.arange(td)
    block_tables = np.full((b, m), NULL_PAGE, np.int32)
    kv_lens = np.zeros(b, np.int32)
    q_lens = np.zeros(b, np.int32)
    q_lens[:td] = 1
    rows, tok = [], 0
    for i, (kl, ql) in enumerate(seqs):
        r = i if i < nd else td + i - nd
        if i == nd:
            tok = td
        pages = [free.pop() for _ in range(-(-kl // page_size))]
        block_tables[r, : len(pages)] = pages
        kv_lens[r], q_lens[r] = kl, ql
        pos = np.arange(kl - ql, kl)
        positions[tok : tok + ql] = pos
        slots[tok : tok + ql] = np.asarray(pages)[pos // page_size] * page_size + pos % page_size
        seq_ids[tok : tok + ql] = r
        kpos = np.arange(kl)
        full_k = k_pages[:, np.asarray(pages)[kpos // page_size], kpos % page_size]  # [K, S, H]
        full_v = v_pages[:, np.asarray(pages)[kpos // page_size], kpos % page_size]
        rows.append((tok, ql, pos, full_k.transpose(1, 0, 2), full_v.transpose(1, 0, 2)))
        tok += ql
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(positions, slots, block_tables, kv_lens, cu, seq_ids, num_decode=td)
    return k_pages, v_pages, md, rows, t


# dtype x page size x GQA pairwise (every pair of values meets in some case; 9 cases, not the
# full 18): each page size meets each GQA ratio once, the dtype alternating so that both dtypes
# meet every page size and every GQA ratio. The window and soft-cap cases follow.
MATRIX = [
    ((jnp.float32, jnp.bfloat16)[(zi + gi) % 2], z, g, 0, None)
    for zi, z in enumerate((4, 8, 16))
    for gi, g in enumerate((1, 2, 4))
]
MATRIX += [
    (jnp.float32, 8, 2, 5, None),
    (jnp.float32, 4, 4, 9, None),
    (jnp.float32, 8, 2, 0, 30.0),
    (jnp.bfloat16, 8, 2, 5, 30.0),
]
MATRIX = [(*case, False) for case in MATRIX]
# The page-major pool [P, K, Z, H] (KVCache.page_major, the engine's CPU layout).
MATRIX += [
    (jnp.float32, 4, 2, 0, None, True),
    (jnp.float32, 16, 1, 0, None, True),
    (jnp.bfloat16, 8, 4, 0, None, True),
    (jnp.float32, 8, 2, 5, 30.0, True),
]


def layout(pages, page_major: bool):
    """make_batch's head-major pages [K, P, Z, H] in the layout under test."""
    return np.ascontiguousarray(pages.swapaxes(0, 1)) if page_major else pages


@pytest.mark.parametrize("dtype,page_size,gqa,window,softcap,page_major", MATRIX)
def test_paged_equals_dense(dtype, page_size, gqa, window, softcap, page_major):
    rng = np.random.default_rng(page_size * 100 + gqa * 10 + window)
    kh, h = 2, 16
    n = kh * gqa
    # decode rows (length 1, page-boundary lengths, long), then prefill chunks (whole prompts and
    # later chunks of a prompt whose earlier part is already cached).
    seqs = [
        (1, 1),
        (page_size, 1),
        (page_size * 3 + 1, 1),
        (2 * page_size, 2 * page_size),
        (page_size + 3, 5),
        (7, 7),
    ]
    k_pages, v_pages, md, rows, t = make_batch(rng, page_size, kh, h, seqs)
    q = rng.standard_normal((t, n, h)).astype(np.float32)
    scale = h**-0.5
    cast = lambda x: jnp.asarray(x).astype(dtype)
    attend = jax.jit(
        functools.partial(
            ragged_paged_attention_xla, scale=scale, softcap=softcap, page_major=page_major
        )
    )
    out = attend(
        cast(q),
        cast(layout(k_pages, page_major)),
        cast(layout(v_pages, page_major)),
        md,
        jnp.int32(window),
    )
    out = np.asarray(out, np.float64)
    f = lambda x: np.asarray(cast(x), np.float64)  # the reference sees the same rounded inputs
    for tok, ql, pos, fk, fv in rows:
        ref = dense_reference(f(q[tok : tok + ql]), f(fk), f(fv), pos, scale, window, softcap)
        np.testing.assert_allclose(out[tok : tok + ql], ref, **TOL[dtype])


@pytest.mark.parametrize(
    "window,softcap,page_major", [(0, None, False), (37, 30.0, False), (37, 30.0, True)]
)
def test_long_decode_rows_walk_pages_in_chunks(window, softcap, page_major):
    """Decode rows wider than DECODE_PAGES_PER_CHUNK pages take the online-softmax page walk."""
    from jaxinfer.models.paged_attention import DECODE_PAGES_PER_CHUNK

    rng = np.random.default_rng(7)
    z, kh, h, gqa = 4, 2, 16, 2
    long = z * (2 * DECODE_PAGES_PER_CHUNK + 3) + 1  # a table of 4 chunks, the last partly used
    seqs = [(long, 1), (z * DECODE_PAGES_PER_CHUNK + 2, 1), (3, 1), (long - 5, 6)]
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, seqs, num_pages=200)
    assert md.block_tables.shape[1] > DECODE_PAGES_PER_CHUNK
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    attend = jax.jit(
        functools.partial(
            ragged_paged_attention_xla, scale=h**-0.5, softcap=softcap, page_major=page_major
        )
    )
    out = np.asarray(
        attend(
            jnp.asarray(q),
            jnp.asarray(layout(k_pages, page_major)),
            jnp.asarray(layout(v_pages, page_major)),
            md,
            jnp.int32(window),
        ),
        np.float64,
    )
    for tok, ql, pos, fk, fv in rows:
        ref = dense_reference(
            q[tok : tok + ql].astype(np.float64),
            fk.astype(np.float64),
            fv.astype(np.float64),
            pos,
            h**-0.5,
            window,
            softcap,
        )
        np.testing.assert_allclose(out[tok : tok + ql], ref, **TOL[jnp.float32])


@pytest.mark.parametrize(
    "window,softcap,gqa,page_major",
    [(0, None, 1, False), (0, None, 2, False), (21, 30.0, 2, False), (21, 30.0, 2, True)],
)
def test_decode_work_items_span_groups(window, softcap, gqa, page_major, monkeypatch):
    """Split-KV decode: rows of very different lengths give work items in several groups, and a
    row's partials (some rows' items split across groups) are merged; a padding row (kv_len 0)
    stays finite."""
    import jaxinfer.models.paged_attention as pa
    from jaxinfer.models.paged_attention import DECODE_PAGES_PER_CHUNK

    monkeypatch.setattr(pa, "DECODE_ITEMS_PER_GROUP", 4)
    rng = np.random.default_rng(11)
    z, kh, h = 4, 2, 16
    item = z * DECODE_PAGES_PER_CHUNK
    lens = [1, 4 * item + 12, 3, 2 * item + 13, item + 1, 2 * item, item, 3 * item - 1]
    seqs = [(n, 1) for n in lens[:7]]  # 7 decode rows -> Td 8, one padding row
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, seqs, num_pages=200)
    assert sum(-(-n // item) for n, _ in seqs) > 3 * 4  # four groups of items
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    attend = jax.jit(
        functools.partial(
            ragged_paged_attention_xla, scale=h**-0.5, softcap=softcap, page_major=page_major
        )
    )
    out = np.asarray(
        attend(
            jnp.asarray(q),
            jnp.asarray(layout(k_pages, page_major)),
            jnp.asarray(layout(v_pages, page_major)),
            md,
            jnp.int32(window),
        ),
        np.float64,
    )
    assert np.isfinite(out).all()
    for tok, ql, pos, fk, fv in rows:
        ref = dense_reference(
            q[tok : tok + ql].astype(np.float64),
            fk.astype(np.float64),
            fv.astype(np.float64),
            pos,
            h**-0.5,
            window,
            softcap,
        )
        np.testing.assert_allclose(out[tok : tok + ql], ref, **TOL[jnp.float32])


@pytest.mark.parametrize(
    "window,softcap,int8,page_major",
    [
        (0, None, False, False),
        (5, 30.0, False, True),
        (0, None, True, False),
        (6, 30.0, True, True),
    ],
)
def test_xla_equals_kernel_reference(window, softcap, int8, page_major):
    """The engine's XLA path == the kernels' own pure-jnp reference
    (``kernels_pallas.ragged_paged_attention.reference``, independent of it), on a 2-layer pool
    read at layer 1: decode rows (one over 4 chunks of pages: the split-KV walk) and prefill rows,
    and int8 pages with scales, which the dense comparisons above do not cover."""
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference

    rng = np.random.default_rng(23 + window)
    z, kh, h, gqa = 4, 2, 16, 2
    seqs = [(1, 1), (z * 13 + 1, 1), (z, 1), (2 * z, 2 * z), (z + 3, 5), (7, 7)]
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, seqs, num_pages=32)
    q = jnp.asarray(rng.standard_normal((t, kh * gqa, h)), jnp.float32)
    kp, vp = (jnp.stack([0 * jnp.asarray(x), jnp.asarray(x)]) for x in (k_pages, v_pages))
    (kp, ks), (vp, vs) = (
        ((jnp.asarray(a), jnp.asarray(b)) for a, b, _ in map(numpy_int8_pages, (kp, vp)))
        if int8
        else ((kp, None), (vp, None))
    )
    kw = dict(scale=h**-0.5, softcap=softcap)
    pm = (lambda x: None if x is None else x.swapaxes(1, 2)) if page_major else (lambda x: x)
    out = jax.jit(functools.partial(ragged_paged_attention_xla, page_major=page_major, **kw))(
        q,
        pm(kp),
        pm(vp),
        md,
        jnp.int32(window),
        layer=jnp.int32(1),
        k_scales=pm(ks),
        v_scales=pm(vs),
    )
    ref = jax.jit(
        functools.partial(ragged_paged_attention_reference, num_decode=md.num_decode, **kw)
    )(
        q,
        kp,
        vp,
        *map(jnp.asarray, (md.kv_lens, md.block_tables, md.cu_q_lens)),
        jnp.int32(window),
        jnp.int32(1),
        ks,
        vs,
    )
    live = np.concatenate([np.arange(tok, tok + ql) for tok, ql, *_ in rows])
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref)[live], **TOL[jnp.float32])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_page_major_pool_holds_the_same_writes(dtype):
    """write_kv into a page-major pool [L, P, K, Z, H] puts every token (and int8 scale) where the
    head-major pool [L, K, P, Z, H] has it, transposed."""
    from jaxinfer.models.config import ModelConfig
    from jaxinfer.models.kv_cache import init_kv_cache, write_kv

    cfg = ModelConfig("llama", 32, 16, 32, 2, 4, 2, 8)
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32) for _ in range(2))
    slots = jnp.asarray([4, 5, 17, 30, 9], jnp.int32)  # pages 1, 1, 4, 7, 2 at Z = 4
    pools = []
    for page_major in (False, True):
        kv = init_kv_cache(cfg, 8, 4, dtype, page_major=page_major)
        assert kv.num_pages == 8 and kv.page_size == 4 and kv.page_major == page_major
        pools.append(jax.jit(write_kv)(kv, jnp.int32(1), k, v, slots))  # one compilation
    head, page = pools
    for a, b in (
        (head.k_pages, page.k_pages),
        (head.v_pages, page.v_pages),
        (head.k_scales, page.k_scales),
    ):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a).swapaxes(1, 2), np.asarray(b))
    assert np.abs(np.asarray(page.k_pages[1])).sum() > 0 and not np.asarray(page.k_pages[0]).any()


def test_page_major_pool_refused_where_it_cannot_run():
    """The Pallas kernels read the head-major pool: asking for a page-major one with them raises."""
    from conftest import engine_config

    from jaxinfer.models.config import ModelConfig

    cfg = ModelConfig("llama", 32, 16, 32, 1, 2, 2, 8)
    with pytest.raises(ValueError, match="kv_page_major=True needs attn_impl resolving to 'xla'"):
        engine_config(
            cfg,
            max_model_len=16,
            kv_pages=8,
            page_size=8,
            attn_impl="pallas_tpu_interpret",
            kv_page_major=True,
        )
