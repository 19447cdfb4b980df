"""Output-first projection weights (``params.out_in_projections``, the engine's CPU layout) give the
same products as the input-first ones: checked against a float64 numpy einsum, and the whole
forward pass against the unconverted params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.attention import dense_attn_fn
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward, linear, linear_parts
from jaxinfer.models.params import OutInWeight, init_random, out_in_projections, unstack_layers

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(
    "spec,w_shape,num_in",
    [("TD,DNH->TNH", (32, 4, 8), 1), ("TNH,NHD->TD", (4, 8, 32), 2), ("TD,DF->TF", (32, 48), 1)],
)
def test_out_in_linear_equals_einsum(rows, spec, w_shape, num_in):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal(w_shape).astype(np.float32)
    x = rng.standard_normal((rows, *w_shape[:num_in])).astype(np.float32)
    ref = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
    axes = list(range(num_in, w.ndim)) + list(range(num_in))
    out = linear(jnp.asarray(x), OutInWeight(jnp.asarray(w.transpose(axes)), num_in), spec)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, **TOL[jnp.float32])


@pytest.mark.parametrize("rows", [1, 5])
def test_fused_linear_parts_equal_einsums(rows):
    rng = np.random.default_rng(rows)
    ws = [rng.standard_normal(s).astype(np.float32) for s in ((32, 4, 8), (32, 2, 8), (32, 2, 8))]
    x = rng.standard_normal((rows, 32)).astype(np.float32)
    fused = OutInWeight(
        jnp.asarray(np.concatenate([w.reshape(32, -1).T for w in ws])), 1, ((4, 8), (2, 8), (2, 8))
    )
    outs = linear_parts(jnp.asarray(x), fused)
    for out, w in zip(outs, ws, strict=False):
        ref = np.einsum("TD,DKH->TKH", x.astype(np.float64), w.astype(np.float64))
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, **TOL[jnp.float32])


@pytest.mark.parametrize(
    "dtype,unroll", [(jnp.float32, True), (jnp.bfloat16, True), (jnp.float32, False)]
)
def test_forward_with_out_in_projections(dtype, unroll):
    cfg = ModelConfig("llama", 96, 32, 64, 2, 4, 2, 8, tie_word_embeddings=True)
    # Under jit: one compilation (eagerly, each op of each weight shape compiles its own).
    params = jax.jit(init_random, static_argnums=0, static_argnames=("dtype", "scale"))(
        cfg, jax.random.PRNGKey(0), dtype=dtype, scale=0.2
    )
    # The layout changes move the weights exactly: each under jit, one compilation.
    params = jax.jit(unstack_layers)(params) if unroll else params
    conv = jax.jit(out_in_projections)(params)
    lp = conv.layers[0] if unroll else jax.tree.map(lambda a: a[0], conv.layers)
    assert lp.wq is None and lp.wqkv.parts == ((4, 8), (2, 8), (2, 8))
    assert lp.wqkv.shape == (64, 32) and lp.w_gate_up.shape == (128, 32)
    assert lp.w_gate is None and lp.wo.shape == (32, 4, 8)
    again = out_in_projections(conv)  # idempotent
    assert jax.tree.structure(again) == jax.tree.structure(conv)
    tokens = jnp.asarray([5, 17, 3, 9, 40, 2], jnp.int32)
    pos = jnp.asarray([0, 1, 2, 0, 1, 2], jnp.int32)
    seg = jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32)

    @jax.jit  # one compilation per layout (op by op: ~120 small ones)
    def logits(p):
        h, _ = forward(p, cfg, tokens, pos, None, dense_attn_fn(cfg, seg, pos))
        return compute_logits(p, cfg, h)

    np.testing.assert_allclose(
        np.asarray(logits(conv), np.float64), np.asarray(logits(params), np.float64), **TOL[dtype]
    )


def test_quantize_refuses_engine_layout():
    from jaxinfer.quant import quantize

    cfg = ModelConfig("llama", 96, 32, 64, 1, 4, 2, 8, tie_word_embeddings=True)
    params = jax.jit(lambda k: out_in_projections(unstack_layers(init_random(cfg, k))))(
        jax.random.PRNGKey(0)
    )
    with pytest.raises(ValueError, match="output-first"):
        quantize(params, "int8")
