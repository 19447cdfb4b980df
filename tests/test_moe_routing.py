"""The mixture-of-experts MLP (``jaxinfer.models.moe``) against an independent float64 numpy
reference written from transformers' routing code: per token, softmax over the router logits,
the top-k experts (ties to the lower index), optional renormalisation, and each chosen expert's
SwiGLU computed densely on that token alone (no sorting, no grouping), plus the gated shared
expert.

Edge cases: an expert no token is routed to, every token routed to one expert, exact ties in the
router logits (straddling the k-th place), top-k = number of experts, ``norm_topk_prob`` on and
off, the shared expert's sigmoid gate, top-k-then-softmax with a router bias, and
``grouped_matmul`` itself with empty groups.

Tolerance: float32 computation against the float64 reference, max |diff| <= 1e-5 x max |ref|
(f32 unit roundoff 6e-8 times the few hundred terms of these sums leaves ~100x room; a wrong
routing weight or expert moves the output by O(1) of its scale).

Tie rule: ``jax.lax.top_k`` puts the lower index first. transformers calls ``torch.topk``, whose
order among equal values is not specified (measured with torch on CPU: top-2 of [1, 3, 3, 0, 3]
gives indices [2, 4]), so an exact tie at the k-th place may pick another expert there; off
exact ties the choice is the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.moe import GROUPED_MATMUL_IMPLS, grouped_matmul, moe_mlp, route
from jaxinfer.models.params import LayerParams

T, D, E, I, S = 16, 8, 4, 6, 5
REL = 1e-5


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="test_moe",
        vocab_size=16,
        hidden_size=D,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=I,
    )
    return ModelConfig(**{**base, **kw})


def _weights(seed: int = 0, e: int = E) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(
        h=rng.normal(size=(T, D)).astype(np.float32),
        router=rng.normal(size=(D, e)).astype(np.float32),
        gate_up=(0.5 * rng.normal(size=(e, D, 2 * I))).astype(np.float32),
        down=(0.5 * rng.normal(size=(e, I, D))).astype(np.float32),
        s_gate=(0.5 * rng.normal(size=(D, S))).astype(np.float32),
        s_up=(0.5 * rng.normal(size=(D, S))).astype(np.float32),
        s_down=(0.5 * rng.normal(size=(S, D))).astype(np.float32),
        s_g=rng.normal(size=(D,)).astype(np.float32),
        bias=rng.normal(size=(e,)).astype(np.float32),
    )


def _silu(x):
    return x / (1.0 + np.exp(-x))


def reference(cfg: ModelConfig, w: dict, shared: bool = False, bias: bool = False):
    """(out f64[T, D], experts i64[T, k]) computed token by token in float64."""
    f = {k: np.asarray(v, np.float64) for k, v in w.items()}
    k = cfg.num_experts_per_tok
    out = np.zeros((T, D))
    chosen = []
    for t in range(T):
        logits = f["h"][t] @ f["router"] + (f["bias"] if bias else 0.0)
        if cfg.router_order == "softmax_topk":
            p = np.exp(logits - logits.max())
            p /= p.sum()
            idx = np.argsort(-p, kind="stable")[:k]  # ties: lower index first
            wt = p[idx]
        else:
            idx = np.argsort(-logits, kind="stable")[:k]
            z = np.exp(logits[idx] - logits[idx].max())
            wt = z / z.sum()
        if cfg.norm_topk_prob:
            wt = wt / wt.sum()
        chosen.append(idx)
        for e, we in zip(idx, wt, strict=True):
            gu = f["h"][t] @ f["gate_up"][e]
            out[t] += we * ((_silu(gu[:I]) * gu[I:]) @ f["down"][e])
        if shared:
            s = (_silu(f["h"][t] @ f["s_gate"]) * (f["h"][t] @ f["s_up"])) @ f["s_down"]
            out[t] += s / (1.0 + np.exp(-(f["h"][t] @ f["s_g"])))
    return out, np.array(chosen)


def _layer(w: dict, shared: bool = False, bias: bool = False) -> LayerParams:
    none = dict.fromkeys(("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up"))
    a = {k: jnp.asarray(v) for k, v in w.items()}
    return LayerParams(
        **none,
        w_down=None,
        router=a["router"],
        router_bias=a["bias"] if bias else None,
        expert_gate_up=a["gate_up"],
        expert_down=a["down"],
        shared_w_gate=a["s_gate"] if shared else None,
        shared_w_up=a["s_up"] if shared else None,
        shared_w_down=a["s_down"] if shared else None,
        shared_expert_gate=a["s_g"] if shared else None,
    )


@functools.partial(jax.jit, static_argnums=(0, 3))
def _run(cfg, lp, h, impl):
    return moe_mlp(cfg, lp, h, impl), route(cfg, lp.router, lp.router_bias, h)[1]


def check(cfg: ModelConfig, w: dict, shared: bool = False, bias: bool = False):
    """Runs the MoE MLP (jitted, each grouped-matmul impl) and compares outputs and chosen experts
    with the reference; returns the chosen experts."""
    ref, ref_idx = reference(cfg, w, shared, bias)
    for impl in ("xla", "xla_tiled"):
        got, idx = _run(cfg, _layer(w, shared, bias), jnp.asarray(w["h"]), impl)
        np.testing.assert_array_equal(np.asarray(idx), ref_idx)
        err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
        assert err <= REL, (impl, err)
    return ref_idx


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("k", [1, 2, E])
def test_random_routing(norm, k):
    """Decisive random routing, top-k in {1, 2, E} (k = E: every expert on every token),
    with and without renormalisation of the k weights."""
    idx = check(_cfg(num_experts_per_tok=k, norm_topk_prob=norm), _weights(k))
    assert len(np.unique(idx)) == E  # every expert is used


def test_expert_with_no_tokens():
    w = _weights(1)
    w["h"] = np.abs(w["h"])
    w["router"][:, 3] = -5.0  # logits of expert 3 far below the others for positive h
    idx = check(_cfg(), w)
    assert 3 not in idx and set(np.unique(idx)) == {0, 1, 2}


def test_every_token_to_one_expert():
    w = _weights(2)
    w["h"] = np.abs(w["h"])
    w["router"][:, 2] = 5.0
    idx = check(_cfg(num_experts_per_tok=1, norm_topk_prob=True), w)
    assert (idx == 2).all()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ties_in_router_logits(k):
    """Experts 1 and 2 have identical router columns (exact ties on every token), and an
    all-zero router row block ties all four; the lower index wins the k-th place."""
    w = _weights(3)
    w["router"][:, 2] = w["router"][:, 1]
    w["h"][:4] = 0.0  # all logits 0: every expert tied
    idx = check(_cfg(num_experts_per_tok=k), w)
    assert (idx[:4] == np.arange(k)).all()
    assert not ((idx == 2).any(axis=1) & ~(idx == 1).any(axis=1)).any()  # 2 only beside 1


def test_shared_expert_gate():
    """Qwen2-MoE: routed experts (not renormalised) + sigmoid-gated shared expert."""
    cfg = _cfg(shared_expert_intermediate_size=S, shared_expert_gate=True)
    check(cfg, _weights(4), shared=True)


def test_topk_then_softmax_with_router_bias():
    """gpt-oss's order: top-k of the biased logits, then a softmax over the k."""
    cfg = _cfg(router_order="topk_softmax", router_bias=True)
    check(cfg, _weights(5), bias=True)


@pytest.mark.parametrize("impl", ["xla", "xla_tiled"])
@pytest.mark.parametrize(
    "sizes",
    [
        [3, 0, 5, 0, 1, 0],  # empty groups first, middle and last; M < one tile
        [32, 0, 32, 64],  # group ends on tile edges (tiles of 32)
        [31, 2, 0, 40, 27],  # groups straddling tile edges, one spanning three tiles
        [0, 100, 0],  # one group over 4 tiles, M not a multiple of the tile
        [0, 0, 0],  # no rows at all
    ],
)
def test_grouped_matmul(impl, sizes):
    """Both XLA formulations against the per-row product in float64."""
    rng = np.random.default_rng(6)
    sizes = np.array(sizes, np.int32)
    lhs = rng.normal(size=(sizes.sum(), 8)).astype(np.float32)
    rhs = rng.normal(size=(len(sizes), 8, 5)).astype(np.float32)
    got = np.asarray(
        jax.jit(grouped_matmul, static_argnums=3)(
            jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), impl
        )
    )
    group = np.repeat(np.arange(len(sizes)), sizes)
    ref = np.einsum("mk,mkn->mn", lhs.astype(np.float64), rhs[group].astype(np.float64))
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=REL * max(1.0, np.abs(ref).max(initial=0.0)))


def test_grouped_matmul_impl_checked():
    assert {"auto", "xla", "xla_tiled"} <= set(GROUPED_MATMUL_IMPLS)
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="backend='nope' is not available"):
        grouped_matmul(x, jnp.zeros((1, 3, 4)), jnp.array([2], jnp.int32), impl="nope")


def test_config_checks():
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be in \\[1, num_experts=4\\]"):
        _cfg(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="router_order"):
        _cfg(router_order="sigmoid")
    with pytest.raises(ValueError, match="sparse_layers has 2 entries"):
        _cfg(sparse_layers=(True, False))
    with pytest.raises(ValueError, match="shared_expert_gate=True needs"):
        _cfg(shared_expert_gate=True)
    with pytest.raises(ValueError, match="hidden_act='gelu_tanh' with experts"):
        _cfg(hidden_act="gelu_tanh")
    cfg = _cfg()
    assert cfg.is_moe and not cfg.has_dense_mlp and cfg.sparse_layers == (True,)
    with pytest.raises(ValueError, match="num_experts=0 \\(a dense model\\) but sparse_layers"):
        dataclasses.replace(cfg, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
