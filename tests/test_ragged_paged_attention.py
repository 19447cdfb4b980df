"""Ragged paged attention kernels (TPU and GPU variants, interpret mode on CPU) == their reference.

The matrix dtype x page size x GQA ratio x head_dim is covered pairwise (every pair of values
meets in some case), not as the full product, to keep interpret mode fast. Each batch mixes
decode rows (a length-1 sequence, a sequence ending exactly on a page boundary, a long one) and
prefill rows (a whole prompt ending on a page boundary, a later chunk, a short prompt). An int8
pool (per-token, per-head scales) is checked against the reference on its dequantized pages.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import make_batch, numpy_int8_pages

from kernels_pallas.ragged_paged_attention import (
    BlockSizes,
    check_supported,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

# scripts/device_check_kernels.py sets this to "tpu" / "gpu": that backend's cases then run
# compiled on the device (interpret=False) and the other backend's are skipped.
DEVICE = os.environ.get("JAXINFER_KERNEL_DEVICE")
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES, PAGES, GQAS = (jnp.float32, jnp.bfloat16), (8, 16, 32), (1, 2, 4, 8)
HEAD_DIMS = {"tpu": (64, 128, 96), "gpu": (64, 128, 32)}  # the third: an unusual size supported


KINDS = ("mixed", "decode", "prefill")


def pairwise(backend):
    """12 cases covering every pair of (dtype, page size, GQA, head_dim) values: with s = gqa
    index + page index, dtype = s % 2 and head_dim = s % 3 meet every other value. The batch
    kind rotates (mixed / decode-only / prefill-only, (2 * gqa index + page index) % 3) so that
    each of the two launches (decode, prefill) sees every value of every factor in 8 cases while
    interpret mode stays within the suite's time budget."""
    out = []
    for gi, g in enumerate(GQAS):
        for zi, z in enumerate(PAGES):
            s = gi + zi
            out.append(
                (DTYPES[s % 2], z, g, HEAD_DIMS[backend][s % 3], 0, None, KINDS[(2 * gi + zi) % 3])
            )
    return out


def seqs_for(z, kind="mixed"):
    """(kv_len, q_len), decode rows first: a length-1 sequence and one ending exactly on a page
    boundary; prefill: a whole prompt ending on a page boundary and a later chunk of a prompt."""
    decode = [(1, 1), (z, 1)] if kind != "prefill" else []
    prefill = [(2 * z, 2 * z), (z + 3, 5)] if kind != "decode" else []
    if kind == "decode":
        decode.append((2 * z + 3, 1))  # spans three pages, two KV blocks
    return decode + prefill


def interpret_for(backend):
    if DEVICE is None:
        return True
    if backend != DEVICE:
        pytest.skip(f"device run on {DEVICE}")
    return False


def run_case(
    backend, dtype, z, g, h, window, softcap, kind="mixed", ppb=2, int8=False, sinks=False
):
    """``int8``: the pool is the f32 pages quantized in numpy (``numpy_int8_pages``, not the
    code's own quantizer); the kernel reads the int8 pages and scales, the reference the pages
    dequantized in numpy, compared at f32 tolerance (the kernel dequantizes to f32 and attends
    in f32 whatever the query dtype). ``sinks``: random attention-sink logits f32[N] (gpt-oss)
    given to both."""
    interpret = interpret_for(backend)
    rng = np.random.default_rng(z * 1000 + g * 100 + h + window)
    kh = 2 if g <= 2 else 1
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, seqs_for(z, kind), num_pages=16)
    q = rng.standard_normal((t, kh * g, h)).astype(np.float32)
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    # a 2-layer pool, read at layer 1 (the engine passes the whole pool and the layer)
    kp = jnp.stack([jnp.zeros_like(cast(k_pages)), cast(k_pages)])
    vp = jnp.stack([jnp.zeros_like(cast(v_pages)), cast(v_pages)])
    scales, ref_pages = (), (kp, vp)
    if int8:
        (kp, ks, kd), (vp, vs, vd) = (
            numpy_int8_pages(np.stack([0 * x, x])) for x in (k_pages, v_pages)
        )
        kp, vp, scales, ref_pages = jnp.asarray(kp), jnp.asarray(vp), (ks, vs), (kd, vd)
    meta = (
        jnp.asarray(md.kv_lens),
        jnp.asarray(md.block_tables),
        jnp.asarray(md.cu_q_lens),
        jnp.int32(window),
        jnp.int32(1),
    )
    kw = dict(num_decode=md.num_decode, scale=h**-0.5, softcap=softcap)
    if sinks:  # N(0, 2): decisive against scores ~N(0, 1)
        kw["sinks"] = jnp.asarray(2.0 * rng.standard_normal(kh * g), jnp.float32)
    kernel = jax.jit(
        lambda *a: ragged_paged_attention(
            *a, **kw, backend=backend, interpret=interpret, block_sizes=BlockSizes(ppb, 16)
        )
    )
    out = np.asarray(kernel(cast(q), kp, vp, *meta, *scales), np.float64)
    with jax.default_matmul_precision("highest"):  # on a device, an f32 reference in f32
        reference = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))
        ref = np.asarray(reference(cast(q), *ref_pages, *meta), np.float64)
    live = np.concatenate([np.arange(tok, tok + ql) for tok, ql, *_ in rows])
    np.testing.assert_allclose(out[live], ref[live], **TOL[jnp.float32 if int8 else dtype])
    assert np.isfinite(out).all()  # padding tokens too: their K/V reach the null page


def covering(cases):
    """A subset of ``cases`` in which every value of every factor (dtype, page size, GQA,
    head_dim, batch kind) still occurs: greedy, deterministic."""
    factors = (0, 1, 2, 3, 6)
    todo = {(f, c[f]) for c in cases for f in factors}
    out = []
    while todo:
        best = max(cases, key=lambda c: len(todo & {(f, c[f]) for f in factors}))
        out.append(best)
        todo -= {(f, best[f]) for f in factors}
    return out


# The full pairwise matrix (12 cases per variant) runs on a device (scripts/
# device_check_kernels.py) or with JAXINFER_FULL_KERNEL_MATRIX=1; by default interpret mode runs
# a covering subset (every value of every factor) to keep the suite's time budget.
FULL = DEVICE is not None or os.environ.get("JAXINFER_FULL_KERNEL_MATRIX") == "1"
pick = (lambda c: c) if FULL else covering
CASES = [("tpu", *c) for c in pick(pairwise("tpu"))] + [("gpu", *c) for c in pick(pairwise("gpu"))]
# sliding window and soft-cap (Gemma 2/3, Mistral)


@pytest.mark.parametrize(
    "backend,dtype,page_size,gqa,head_dim,window,softcap,kind",
    CASES,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_kernel_equals_reference(backend, dtype, page_size, gqa, head_dim, window, softcap, kind):
    run_case(backend, dtype, page_size, gqa, head_dim, window, softcap, kind)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sliding_window_and_softcap(backend):
    # One-page KV blocks: the window (5 tokens) starts in page 2 of the 35-token row, so the
    # kernel skips its first KV blocks; soft-cap as in Gemma 2, with a cap that bites at these
    # scores (~N(0, 1)): at Gemma 2's 50 (or 30) a skipped cap stayed within bf16 tolerance.
    # The window on prefill rows (f32 pages, GQA 2, 8-token pages, two-page KV blocks) is
    # test_attention_sinks' prefill run (the same batch and tiling, window 6) and, on int8
    # pages, test_int8_pages_equal_reference_on_dequantized_pages' (window 6): the same masking
    # and block skipping, so no run (and no kernel compilation) of its own here.
    run_case(backend, jnp.bfloat16, 16, 2, 64, 5, 3.0, kind="decode", ppb=1)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_int8_pages_equal_reference_on_dequantized_pages(backend):
    # A mixed decode + prefill batch, GQA 2 over 2 KV heads (each head's scales), a sliding
    # window of 6 tokens (8-token pages: the prefill rows skip and partly mask KV blocks), bf16
    # queries: f32 tolerance, as the kernel attends the dequantized pages in f32 like the
    # reference. One-page KV blocks on TPU (a third of the interpret time of two); the GPU
    # kernel needs >= 16 keys per block.
    run_case(
        backend,
        jnp.bfloat16,
        8,
        2,
        32,
        6,
        None,
        kind="mixed",
        int8=True,
        ppb=1 if backend == "tpu" else 2,
    )


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_attention_sinks(backend):
    # gpt-oss: a sink logit per query head; decode rows over several KV blocks and a sliding
    # window, then prefill rows (GQA 2 over 2 KV heads, 8-token pages).
    run_case(backend, jnp.float32, 8, 2, 64, 0, None, kind="decode", sinks=True)
    run_case(backend, jnp.float32, 8, 2, 64, 6, None, kind="prefill", sinks=True)


def test_int8_pages_need_both_scales():
    q = jnp.zeros((2, 4, 32), jnp.float32)
    i8, f32 = jnp.zeros((1, 2, 4, 8, 32), jnp.int8), jnp.zeros((1, 2, 4, 8, 32), jnp.float32)
    scales = jnp.ones((1, 2, 4, 8), jnp.float32)
    meta = (
        jnp.ones(2, jnp.int32),
        jnp.ones((2, 2), jnp.int32),
        jnp.arange(3, dtype=jnp.int32),
        jnp.int32(0),
        jnp.int32(0),
    )
    kw = dict(num_decode=2, scale=1.0, backend="tpu", interpret=True)
    with pytest.raises(ValueError, match="int8 pages with k_scales None.*supported are int8"):
        ragged_paged_attention(q, i8, i8, *meta, **kw)
    with pytest.raises(ValueError, match="float32 pages with k_scales given"):
        ragged_paged_attention(q, f32, f32, *meta, scales, scales, **kw)
    with pytest.raises(ValueError, match=r"v_scales is float32\[1, 2, 4\]; .*f32\[1, 2, 4, 8\]"):
        ragged_paged_attention(q, i8, i8, *meta, scales, scales[..., 0], **kw)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_decode_only_launches_no_prefill_kernel(backend):
    interpret = interpret_for(backend)
    q = jnp.zeros((8, 4, 64), jnp.float32)
    pages = jnp.zeros((1, 2, 9, 16, 64), jnp.float32)
    args = (
        q,
        pages,
        pages,
        jnp.ones(8, jnp.int32),
        jnp.ones((8, 4), jnp.int32),
        jnp.arange(9, dtype=jnp.int32),
        jnp.int32(0),
        jnp.int32(0),
    )

    def calls(num_decode):
        jaxpr = jax.make_jaxpr(
            lambda *a: ragged_paged_attention(
                *a, num_decode=num_decode, scale=1.0, backend=backend, interpret=interpret
            )
        )(*args)
        return [
            str(e.params.get("name", e.params.get("name_and_src_info", "")))
            for e in jaxpr.eqns
            if e.primitive.name == "pallas_call"
        ]

    assert len(calls(8)) == 1 and len(calls(4)) == 2 and len(calls(0)) == 1


@pytest.mark.parametrize(
    "backend,kw,match",
    [
        ("tpu", dict(head_dim=12, page_size=16), "head_dim=12 .*multiples of 8"),
        ("tpu", dict(head_dim=64, page_size=4), "page_size=4 .*multiples of 8"),
        ("gpu", dict(head_dim=96, page_size=16), "head_dim=96 .*powers of two"),
        ("gpu", dict(head_dim=64, page_size=12), "page_size=12"),
        ("cuda", dict(head_dim=64, page_size=16), "backend='cuda'.*supported"),
    ],
)
def test_unsupported_combination_names_it(backend, kw, match):
    with pytest.raises(ValueError, match=match):
        check_supported(backend, num_heads=8, num_kv_heads=2, **kw)


def test_gpu_rejects_non_power_of_two_gqa():
    with pytest.raises(ValueError, match="num_heads=6, num_kv_heads=2"):
        check_supported("gpu", num_heads=6, num_kv_heads=2, head_dim=64, page_size=16)
