"""FlashAttention kernels == pure-jnp reference (outputs and jax.grad), interpret mode on CPU.

Budget: the whole file runs in about a minute on 2 CPU cores, so the matrix
{backend} x {dtype} x {GQA ratio 1, 2, 4, 8} x {head_dim 64, 128, 80} x {mask features} is
covered pairwise, each case checking the forward output and all three gradients from one
compiled `jax.vjp`. Mosaic and Triton lowering of every kernel is checked separately
(lowering only, no device needed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.flash_attention import BlockSizes, SegmentIds, flash_attention, mha_reference

# (atol, rtol) per dtype; bf16 kernels round p and ds to bf16 before the MXU/tensor-core dots.
FWD_TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (2e-2, 2e-2)}
GRAD_TOL = {jnp.float32: (1e-4, 1e-4), jnp.bfloat16: (2e-2, 2e-2)}


@functools.partial(jax.jit, static_argnums=range(8))  # one compilation per shape, not per op
def _inputs(b, n, kh, t, s, h, dtype, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, n, t, h), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, kh, s, h), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, kh, s, h), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (b, n, t, h), jnp.float32) / np.sqrt(t)  # cotangent
    return q, k, v, w


def _ragged_ids(b, t, lengths):
    """i32[B, T]: packed sequences of the given lengths, the rest one padding segment."""
    ids = np.full((b, t), len(lengths), np.int32)
    start = 0
    for i, n in enumerate(lengths):
        ids[:, start : start + n] = i
        start += n
    return jnp.asarray(ids)


def _check(fn, q, k, v, w, dtype, **kw):
    def run(attn):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, **kw), q, k, v)
        return out, vjp(w.astype(out.dtype))

    out, grads = jax.jit(lambda q, k, v: run(fn))(q, k, v)
    ref_out, ref_grads = jax.jit(lambda q, k, v: run(mha_reference))(q, k, v)
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    atol, rtol = FWD_TOL[dtype]
    np.testing.assert_allclose(f32(out), f32(ref_out), atol=atol, rtol=rtol)
    atol, rtol = GRAD_TOL[dtype]
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == rg.dtype == dtype, name
        np.testing.assert_allclose(f32(g), f32(rg), atol=atol, rtol=rtol, err_msg=f"d{name}")


# backend, interpret ("mosaic" = pltpu.InterpretParams), dtype, G, H, (B, K, T, S), features.
# Pairwise-style cover: every dtype meets both backends and each of H 64/128/80; G 1/2/4/8 and
# segments, softcap, window and T < S each appear on both dtypes or both backends.
CASES = [
    ("gpu", True, jnp.float32, 1, 64, (1, 2, 128, 128), {}),
    ("gpu", True, jnp.bfloat16, 2, 128, (2, 1, 128, 128), {"segments": True, "softcap": 20.0}),
    ("gpu", True, jnp.float32, 4, 80, (1, 1, 128, 256), {"window": 96}),
    (
        "tpu",
        "mosaic",
        jnp.bfloat16,
        2,
        80,
        (1, 1, 128, 128),
        {"segments": True, "window": 80, "softcap": 30.0},
    ),
    ("tpu", True, jnp.bfloat16, 4, 128, (1, 1, 128, 256), {"segments": True, "softcap": 10.0}),
    ("tpu", True, jnp.float32, 8, 64, (1, 1, 128, 128), {"causal": False}),
]


def _case_id(c):
    backend, interp, dtype, g, h, (b, kh, t, s), feats = c
    mode = "mosaic-interp" if interp == "mosaic" else "interp"
    return f"{backend}-{mode}-{jnp.dtype(dtype).name}-G{g}-H{h}-T{t}S{s}-" + (
        "-".join(f"{k}={v}" for k, v in feats.items()) or "plain"
    )


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(case):
    backend, interp, dtype, g, h, (b, kh, t, s), feats = case
    q, k, v, w = _inputs(b, kh * g, kh, t, s, h, dtype)
    segment_ids = None
    if feats.get("segments"):
        q_ids = _ragged_ids(b, t, [t // 2 - 7, t // 4 + 3, t // 8])
        segment_ids = q_ids if t == s else SegmentIds(q_ids, _ragged_ids(b, s, [s // 2, s // 4]))
    kw = dict(
        segment_ids=segment_ids,
        causal=feats.get("causal", True),
        sm_scale=h**-0.5,
        logit_softcap=feats.get("softcap"),
        sliding_window=feats.get("window"),
    )
    block_k = 64 if backend == "gpu" else 128
    fn = lambda q, k, v, **kw: flash_attention(
        q,
        k,
        v,
        **kw,
        block_sizes=BlockSizes(block_q=64, block_k=block_k),
        backend=backend,
        interpret=pltpu.InterpretParams() if interp == "mosaic" else True,
    )
    _check(fn, q, k, v, w, dtype, **kw)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_attention_sinks_match_reference(backend):
    """gpt-oss sinks (N(0, 2): decisive against these scores): the output and the gradients of
    q, k, v and the sinks against ``jax.vjp`` of the reference; GQA 2, a sliding window."""
    dtype, g, h, (b, kh, t, s) = jnp.float32, 2, 64, (1, 2, 128, 128)
    q, k, v, w = _inputs(b, kh * g, kh, t, s, h, dtype, seed=3)
    sinks = 2.0 * jax.random.normal(jax.random.key(4), (kh * g,), jnp.float32)
    kw = dict(causal=True, sm_scale=h**-0.5, sliding_window=96)
    fn = lambda q, k, v, sinks: flash_attention(  # noqa: E731
        q,
        k,
        v,
        sinks=sinks,
        **kw,
        block_sizes=BlockSizes(block_q=64, block_k=64 if backend == "gpu" else 128),
        backend=backend,
        interpret=True,
    )
    ref_fn = lambda q, k, v, sinks: mha_reference(q, k, v, sinks=sinks, **kw)  # noqa: E731

    def run(attn):
        out, vjp = jax.vjp(attn, q, k, v, sinks)
        return out, vjp(w)

    out, grads = jax.jit(lambda: run(fn))()
    ref_out, ref_grads = jax.jit(lambda: run(ref_fn))()
    atol, rtol = FWD_TOL[dtype]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=atol, rtol=rtol)
    atol, rtol = GRAD_TOL[dtype]
    for name, gr, rg in zip(("q", "k", "v", "sinks"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(gr), np.asarray(rg), atol=atol, rtol=rtol, err_msg=f"d{name}"
        )
    assert np.abs(np.asarray(ref_grads[3])).max() > 1e-2  # the sinks' gradient is not trivial


@pytest.mark.parametrize("backend, platform", [("tpu", "tpu"), ("gpu", "cuda")])
def test_lowers_for_device(backend, platform):
    """The device path (interpret=False) lowers through Mosaic / Triton, forward and backward."""
    q, k, v, _ = _inputs(1, 4, 2, 256, 256, 80, jnp.bfloat16)
    ids = _ragged_ids(1, 256, [100, 100])

    def loss(q, k, v):
        out = flash_attention(
            q,
            k,
            v,
            segment_ids=ids,
            sm_scale=0.1,
            logit_softcap=30.0,
            sliding_window=128,
            block_sizes=BlockSizes(block_q=64, block_k=128),
            backend=backend,
            sinks=jnp.zeros(4, jnp.float32),  # gpt-oss attention sinks lower too
        )
        return out.astype(jnp.float32).sum()

    lowered = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(q, k, v)
        .lower(lowering_platforms=(platform,))
    )
    text = lowered.as_text()
    for name in ("flash_attention_fwd", "flash_attention_dkv", "flash_attention_dq"):
        assert name in text


def test_fully_masked_rows_are_zero():
    # T > S with bottom-right causal alignment: the first T - S queries see no key.
    q, k, v, _ = _inputs(1, 1, 1, 128, 64, 64, jnp.float32)
    # jitted: one compilation each, not one per operation of the wrapper and of the reference
    out = jax.jit(
        lambda q, k, v: flash_attention(
            q,
            k,
            v,
            sm_scale=0.125,
            block_sizes=BlockSizes(block_q=64, block_k=64),
            backend="gpu",
            interpret=True,
        )
    )(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[:, :, :64]), 0.0)
    ref = jax.jit(lambda q, k, v: mha_reference(q, k, v, sm_scale=0.125))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shapes, kw, match",
    [
        (((1, 2, 128, 60), (1, 2, 128, 60)), {}, "head_dim=60"),
        (
            ((1, 2, 128, 64), (1, 2, 128, 64)),
            {"block_sizes": BlockSizes(block_q=48)},
            "must divide",
        ),
        (
            ((1, 2, 96, 64), (1, 2, 96, 64)),
            {"backend": "gpu", "block_sizes": BlockSizes(block_q=32, block_k=48)},
            "powers of two",
        ),
        (
            ((1, 2, 256, 64), (1, 2, 256, 64)),
            {"block_sizes": BlockSizes(block_k=64)},
            "multiple of 128",
        ),
        (((1, 3, 128, 64), (1, 2, 128, 64)), {}, "multiple of KV heads"),
        (((1, 2, 128, 64), (1, 2, 128, 64)), {"backend": "cuda"}, "backend='cuda'"),
        (((1, 2, 128, 64), (1, 2, 128, 64)), {"sliding_window": 0}, "sliding_window=0"),
    ],
)
def test_unsupported_combinations_raise(shapes, kw, match):
    qs, ks = shapes
    q, k = jnp.zeros(qs, jnp.float32), jnp.zeros(ks, jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, sm_scale=1.0, **{"block_sizes": BlockSizes(), **kw})


@pytest.mark.parametrize("bad", [0, 4, 12, 100.0, True])
def test_block_sizes_validated(bad):
    with pytest.raises(ValueError, match="BlockSizes.block_q"):
        BlockSizes(block_q=bad)
