"""Attention sinks (gpt-oss: one learned logit per query head joins the softmax's max and
denominator, then is dropped) in every attention path that adds them == a numpy float64
reference written here: the dense XLA attention, the paged XLA attention (decode rows in one
pass and split-KV, prefill blocks; head-major and page-major pools), the native CPU decode
kernel, the batch-invariant attention, the Pallas kernels' reference and the engine's wiring of
the Pallas ragged paged attention kernels (interpret mode; the kernels themselves against their
reference in test_ragged_paged_attention.py), the FlashAttention kernels' reference and the dense
forward through the FlashAttention kernel (the kernels against their reference, gradients
included, in test_flash_attention.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import TOL, layout, make_batch

from jaxinfer.models import cpu_decode_kernel
from jaxinfer.models.attention import dense_attention
from jaxinfer.models.batch_invariant import tiled_attention
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import dense_logits
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.paged_attention import paged_attn_fn, ragged_paged_attention_xla
from jaxinfer.models.params import init_random
from kernels_pallas.flash_attention import mha_reference
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference


def sink_reference(q, k, v, q_pos, scale, window, sinks):
    """Numpy float64 attention of one sequence with sinks: q [Tq, N, H] at positions q_pos,
    k/v [S, K, H], sinks [N]. The sink is a last column of the logits, softmaxed with the others
    and dropped (transformers' gpt_oss ``eager_attention_forward``)."""
    n, kh = q.shape[1], k.shape[1]
    k, v = np.repeat(k, n // kh, axis=1), np.repeat(v, n // kh, axis=1)
    s = np.einsum("tnh,snh->nts", q, k) * scale
    kv_pos = np.arange(k.shape[0])
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= q_pos[:, None] - kv_pos[None, :] < window
    s = np.where(mask[None], s, -np.inf)
    col = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (*s.shape[:2], 1))
    s = np.concatenate([s, col], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nts,snh->tnh", p[..., :-1], v)


def _seqs(z):
    # decode rows (one page, a page + 1, a table wider than a split-KV chunk), prefill chunks
    return [(1, 1), (z + 1, 1), (z * 13 + 3, 1), (2 * z, 2 * z), (z + 3, 5)]


def _check_rows(out, q, rows, scale, window, sinks, tol):
    for tok, ql, pos, fk, fv in rows:
        ref = sink_reference(
            q[tok : tok + ql].astype(np.float64),
            fk.astype(np.float64),
            fv.astype(np.float64),
            pos,
            scale,
            window,
            sinks,
        )
        np.testing.assert_allclose(np.asarray(out[tok : tok + ql], np.float64), ref, **tol)


MATRIX = [
    (jnp.float32, 4, 1, 0, False),
    (jnp.float32, 8, 2, 5, False),
    (jnp.float32, 4, 4, 0, True),
    (jnp.float32, 8, 2, 9, True),
    (jnp.bfloat16, 8, 2, 0, False),
]


@pytest.mark.parametrize("dtype,page_size,gqa,window,page_major", MATRIX)
def test_paged_xla_with_sinks(dtype, page_size, gqa, window, page_major):
    rng = np.random.default_rng(page_size * 100 + gqa * 10 + window)
    kh, h = 2, 16
    k_pages, v_pages, md, rows, t = make_batch(rng, page_size, kh, h, _seqs(page_size))
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * gqa)).astype(np.float32)  # decisive against scores
    cast = lambda x: jnp.asarray(x).astype(dtype)
    attend = jax.jit(
        functools.partial(ragged_paged_attention_xla, scale=h**-0.5, page_major=page_major)
    )
    out = attend(
        cast(q),
        cast(layout(k_pages, page_major)),
        cast(layout(v_pages, page_major)),
        md,
        jnp.int32(window),
        sinks=jnp.asarray(sinks),
    )
    f = lambda x: np.asarray(cast(x).astype(jnp.float32))
    _check_rows(
        out,
        f(q),
        [(a, b, c, f(d), f(e)) for a, b, c, d, e in rows],
        h**-0.5,
        window,
        f(sinks),
        TOL[dtype],
    )


@pytest.mark.parametrize("gqa,window", [(1, 0), (2, 5)])
def test_cpu_kernel_with_sinks(gqa, window):
    cpu_decode_kernel.load()
    rng = np.random.default_rng(7 + gqa)
    z, kh, h = 4, 2, 16
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, _seqs(z), num_pages=48)
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * gqa)).astype(np.float32)
    fn = jax.jit(
        lambda q, kp, vp, md, sinks: ragged_paged_attention_xla(
            q,
            kp,
            vp,
            md,
            jnp.int32(window),
            scale=h**-0.5,
            page_major=True,
            decode_kernel=True,
            sinks=sinks,
        )
    )
    args = (q, layout(k_pages, True), layout(v_pages, True), md, jnp.asarray(sinks))
    assert "jaxinfer_cpu_decode_attention" in fn.lower(*args).as_text()
    _check_rows(fn(*args), q, rows, h**-0.5, window, sinks, TOL[jnp.float32])


def test_batch_invariant_attention_with_sinks():
    rng = np.random.default_rng(3)
    z, kh, h, gqa, window = 4, 2, 16, 2, 6
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, _seqs(z))
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * gqa)).astype(np.float32)
    cache = KVCache(jnp.asarray(k_pages)[None], jnp.asarray(v_pages)[None])
    out = tiled_attention(
        jnp.asarray(q),
        cache,
        md,
        jnp.int32(0),
        jnp.int32(window),
        scale=h**-0.5,
        softcap=None,
        sinks=jnp.asarray(sinks),
    )
    _check_rows(out, q, rows, h**-0.5, window, sinks, TOL[jnp.float32])


@pytest.mark.parametrize("window", [0, 3])
def test_dense_attention_with_sinks(window):
    rng = np.random.default_rng(11)
    kh, g, h = 2, 2, 8
    lens = [5, 9, 1]
    t = sum(lens)
    q = rng.standard_normal((t, kh * g, h)).astype(np.float32)
    k = rng.standard_normal((t, kh, h)).astype(np.float32)
    v = rng.standard_normal((t, kh, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * g)).astype(np.float32)
    seg = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    out = dense_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(seg),
        jnp.asarray(pos),
        jnp.int32(window),
        scale=h**-0.5,
        sinks=jnp.asarray(sinks),
    )
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        ref = sink_reference(q[sl], k[sl], v[sl], np.arange(n), h**-0.5, window, sinks)
        np.testing.assert_allclose(np.asarray(out[sl]), ref, **TOL[jnp.float32])
        start += n


CFG = ModelConfig(
    model_type="gpt_oss",
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_sinks=True,
)


def test_kernel_reference_with_sinks():
    """The Pallas kernels' reference (kernels_pallas/ragged_paged_attention/reference.py), which
    the kernels are tested against, with sinks == the numpy reference here."""
    rng = np.random.default_rng(5)
    z, kh, h, gqa, window = 4, 2, 16, 2, 7
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, _seqs(z))
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * gqa)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        out = ragged_paged_attention_reference(
            jnp.asarray(q),
            jnp.asarray(k_pages),
            jnp.asarray(v_pages),
            md.kv_lens,
            md.block_tables,
            md.cu_q_lens,
            jnp.int32(window),
            jnp.int32(0),
            num_decode=md.num_decode,
            scale=h**-0.5,
            sinks=jnp.asarray(sinks),
        )
    _check_rows(out, q, rows, h**-0.5, window, sinks, TOL[jnp.float32])


def test_engine_attention_fn_passes_sinks_to_the_kernels():
    """``paged_attn_fn`` with a Pallas implementation: this layer's sinks reach the kernel (the
    GPU kernel interpreted; the TPU one takes the same argument, and both kernels are checked
    with sinks in test_ragged_paged_attention.py)."""
    impl = "pallas_gpu_interpret"
    rng = np.random.default_rng(9)
    z, kh, h, gqa = 8, 2, 64, 2
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, [(3, 1), (2 * z + 1, 1), (9, 9)])
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * gqa)).astype(np.float32)
    cfg = dataclasses.replace(
        CFG, num_heads=kh * gqa, num_kv_heads=kh, head_dim=h, num_layers=1, layer_windows=(0,)
    )
    cache = KVCache(jnp.asarray(k_pages)[None], jnp.asarray(v_pages)[None])
    # the K/V already at each token's slot: writing them back leaves the pool as it is
    page, off = md.slot_mapping // z, md.slot_mapping % z
    k = cache.k_pages[0][:, page, off].transpose(1, 0, 2)
    v = cache.v_pages[0][:, page, off].transpose(1, 0, 2)
    attn = paged_attn_fn(cfg, md, impl)
    out, _ = attn(jnp.asarray(q), k, v, cache, jnp.int32(0), jnp.int32(0), jnp.asarray(sinks))
    _check_rows(out, q, rows, h**-0.5, 0, sinks, TOL[jnp.float32])


def test_flash_reference_with_sinks():
    """The FlashAttention kernels' reference (kernels_pallas/flash_attention/reference.py), which
    the kernels are tested against, with sinks == the numpy reference here."""
    rng = np.random.default_rng(6)
    kh, g, h, t, window = 2, 2, 8, 12, 5
    q = rng.standard_normal((1, kh * g, t, h)).astype(np.float32)
    k = rng.standard_normal((1, kh, t, h)).astype(np.float32)
    v = rng.standard_normal((1, kh, t, h)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(kh * g)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        out = mha_reference(
            *(jnp.asarray(x) for x in (q, k, v)),
            sm_scale=h**-0.5,
            sliding_window=window,
            sinks=jnp.asarray(sinks),
        )
    ref = sink_reference(
        q[0].transpose(1, 0, 2),
        k[0].transpose(1, 0, 2),
        v[0].transpose(1, 0, 2),
        np.arange(t),
        h**-0.5,
        window,
        sinks,
    )
    np.testing.assert_allclose(np.asarray(out)[0].transpose(1, 0, 2), ref, **TOL[jnp.float32])


def test_dense_forward_flash_kernel_with_sinks():
    """``dense_logits`` of a tiny random model with sinks (a sliding and a full layer): the
    FlashAttention kernel (interpreted) == the XLA attention."""
    cfg = dataclasses.replace(CFG, layer_windows=(5, 0), head_dim=16)
    params = init_random(cfg, jax.random.PRNGKey(0), scale=0.3)
    sinks = 2.0 * jax.random.normal(jax.random.PRNGKey(1), params.layers.sinks.shape)
    params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, sinks=sinks))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 11)), jnp.int32)
    xla = dense_logits(params, cfg, tokens, "xla")
    flash = dense_logits(params, cfg, tokens, "pallas_gpu_interpret")
    np.testing.assert_allclose(np.asarray(flash), np.asarray(xla), **TOL[jnp.float32])
