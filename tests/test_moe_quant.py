"""int8 weights (w8a16, w8a8) and int8 KV caches on mixture-of-experts models.

Three outside references:

- transformers: the tiny random MoE checkpoints (``moe_fixtures``, all four families) with every
  projection the engine quantizes (attention, dense MLP, experts, shared expert; not the router,
  the shared expert's gate, norms, embedding or LM head) replaced in the torch model by its
  numpy round trip ``round(w / s) * s`` with ``s = max|w| / 127`` per output channel (each
  expert's own rows): jaxinfer's w8a16 forward (its exact "dot" formulation) must equal
  transformers' f32 forward of those weights at ``test_hf_parity``'s f32 bound (max_rel 1e-4;
  measured 1.5e-6 to 4.2e-6). Wrong experts' scales, a quantized
  router or a lost shared expert move the logits by O(0.1-1).
- a float64 numpy grouped matmul (rows grouped by expert) for the quantized grouped matmul alone,
  w8a16 and w8a8, within the bounds ``tests/test_quant.py`` uses for the dense matmuls.
- stories260K's trained weights upcycled to a Mixtral-style MoE (``_upcycle``: 4 experts, top-2,
  every expert the dense MLP with its hidden units permuted and rescaled (up columns times a,
  down rows divided by a; the same function), renormalised top-2 weights, a random router): its
  float greedy text must be llama2.c's reference, and each int8 mode's greedy agreement with the
  float MoE is held to ``tests/test_quant.py``'s floors on the same three prompts x 40 tokens
  (``MIN_AGREEMENT``: the same metric and the same floor as the dense modes).
"""

from __future__ import annotations

import dataclasses
import re

import hf_fixtures as H
import jax
import jax.numpy as jnp
import moe_fixtures as M
import numpy as np
import pytest

from jaxinfer.loaders.hf import load_hf
from jaxinfer.models.dense import dense_logits
from jaxinfer.quant.tensor import QTensor, quantize

F32_MAX_REL = 1e-4  # as test_hf_parity / test_moe_parity
EPS = float(jnp.finfo(jnp.float32).eps)
# test_quant.MIN_AGREEMENT (measured there on dense stories260K): int8 weights 0.95, int8
# activations or an int8 KV cache 0.85; int8 weights + int8 KV held to the lower floor.
MIN_AGREEMENT = {
    ("int8", "auto"): 0.95,
    ("w8a8", "auto"): 0.85,
    (None, "int8"): 0.85,
    ("int8", "int8"): 0.85,
}
# transformers' names of the projections jaxinfer quantizes (the router "mlp.gate.weight" and
# "shared_expert_gate.weight" are not among them).
QUANTIZED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|gate_up_proj|down_proj)(\.weight)?$"
)


def _np_int8_round_trip(w: np.ndarray) -> np.ndarray:
    """``round(w / s) * s`` with ``s = max|w| / 127`` over the last (input) axis: transformers
    holds every projection [*lead, out, in] (experts: gate_up [E, 2I, D], down [E, D, I])."""
    w = np.asarray(w, np.float64)
    s = np.abs(w).max(axis=-1, keepdims=True) / 127
    q = np.clip(np.round(w / np.where(s == 0, 1, s)), -127, 127)
    return q * s


@pytest.mark.parametrize("name", list(M.CASES))
def test_int8_forward_equals_transformers_on_round_tripped_weights(name, tmp_path, monkeypatch):
    import torch

    import jaxinfer.quant.matmul as qm

    # The dense projections (attention, dense MLP, shared expert) in w8a16's exact formulation
    # ("dot", the TPU/GPU one); CPU's default "int_dot2" adds its own activation error, bounded
    # in test_quant. The experts' grouped matmul is exact either way.
    monkeypatch.setattr(qm, "choose_formulation", lambda act, rows, backend=None: "dot")

    path = M.build_checkpoint(name, str(tmp_path / name))
    model = H.hf_model(path, "float32")
    tokens = H.sample_tokens()
    float_ref = H.hf_logits(model, tokens)
    state = model.state_dict()
    changed = [k for k in state if QUANTIZED.search(k)]
    assert {"experts.gate_up_proj", "experts.down_proj"} <= {
        k[k.find("experts.") :] for k in changed
    }
    assert not any("mlp.gate.weight" in k or "shared_expert_gate" in k for k in changed)
    model.load_state_dict(
        {
            **state,
            **{
                k: torch.tensor(_np_int8_round_trip(state[k].numpy()), dtype=torch.float32)
                for k in changed
            },
        }
    )
    ref = H.hf_logits(model, tokens)

    cfg, params = load_hf(path)
    qp = quantize(params, "int8")
    assert isinstance(qp.layers.expert_gate_up, QTensor) and isinstance(
        qp.layers.expert_down, QTensor
    )
    assert not isinstance(qp.layers.router, QTensor)  # the router stays float
    logits = jax.jit(dense_logits.__wrapped__, static_argnames=("cfg", "attn_impl"))  # fresh trace
    got = np.asarray(logits(qp, cfg, jnp.asarray(tokens)))
    err = H.errors(got, ref)
    print(f"{name}: int8 vs transformers on round-tripped weights {err}")
    assert err["max_rel"] <= F32_MAX_REL, (name, err)
    # the comparison sees the quantization: the float model is far off these logits
    assert H.errors(float_ref, ref)["max_rel"] > 100 * F32_MAX_REL, name


def _np_grouped(x, values, scales, sizes, act):
    """float64 numpy: rows of x [M, K] in groups of ``sizes``, each times its group's
    dequantized weight (values [G, N, K] * scales [G, N]); w8a8 quantizes each row first."""
    x = np.asarray(x, np.float64)
    if act == "int8":
        sx = np.abs(x).max(axis=1, keepdims=True) / 127
        x = np.clip(np.round(x / np.where(sx == 0, 1, sx)), -127, 127) * sx
    w = np.asarray(values, np.float64) * np.asarray(scales, np.float64)[..., None]
    g = np.repeat(np.arange(len(sizes)), sizes)
    return np.stack([w[g[m]] @ x[m] for m in range(x.shape[0])]), x, w, g


@pytest.mark.parametrize("act", ["float", "int8"])
@pytest.mark.parametrize("impl", ["xla", "xla_tiled"])
def test_grouped_qmatmul_equals_numpy(act, impl):
    from jaxinfer.models.moe import expert_matmul
    from jaxinfer.quant.tensor import quantize_tensor

    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    sizes = np.array([5, 0, 31, 1, 3])  # an empty expert, a group across a 32-row tile
    m, k, n = int(sizes.sum()), 48, 24
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = 0.05 * jax.random.normal(kw, (len(sizes), k, n), jnp.float32)  # [E, K, N], params' layout
    q = quantize_tensor(w, 1, 1, act)
    row_experts = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes), jnp.int32)
    f = jax.jit(lambda x, q, s, r: expert_matmul(x, q, s, r, impl))
    y = np.asarray(f(x, q, jnp.asarray(sizes, jnp.int32), row_experts))
    ref, xr, wd, g = _np_grouped(x, q.values, q.scales, sizes, act)
    # float32 summation of K products (test_quant's bound), plus the w8a8 rows' own rounding
    # (the numpy reference quantizes them; a row scale's float32 rounding can move x_q by one).
    mag = np.stack([np.abs(wd[g[i]]) @ np.abs(xr[i]) for i in range(m)])
    bound = 2 * k * EPS * mag + 1e-30
    if act == "int8":
        bound = (
            bound
            + np.abs(xr).max(axis=1, keepdims=True)
            / 127
            * np.stack([np.abs(wd[g[i]]).sum(axis=1) for i in range(m)])
            * 1e-6
        )
    assert np.all(np.abs(y - ref) <= bound), np.abs(y - ref).max()


# ------------------------------------------------------------------------------------------
# stories260K upcycled to a mixture of experts: the trained model's quality floors.

NUM_EXPERTS, TOP_K = 4, 2


def _upcycle(cfg, params, seed=0):
    """stories260K as a Mixtral-style MoE computing the same function (module docstring)."""
    rng = np.random.default_rng(seed)
    lp = params.layers
    wg, wu, wd = (np.asarray(a, np.float32) for a in (lp.w_gate, lp.w_up, lp.w_down))
    L, D, F = wg.shape
    gate_up = np.zeros((L, NUM_EXPERTS, D, 2 * F), np.float32)
    down = np.zeros((L, NUM_EXPERTS, F, D), np.float32)
    for layer in range(L):
        for e in range(NUM_EXPERTS):
            perm = rng.permutation(F)
            a = rng.uniform(0.5, 2.0, F).astype(np.float32)
            gate_up[layer, e] = np.concatenate([wg[layer][:, perm], wu[layer][:, perm] * a], 1)
            down[layer, e] = wd[layer][perm, :] / a[:, None]
    router = rng.normal(0, 1.0, (L, D, NUM_EXPERTS)).astype(np.float32)
    mcfg = dataclasses.replace(
        cfg,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=F,
        norm_topk_prob=True,
        sparse_layers=(True,) * L,
    )
    layers = dataclasses.replace(
        lp,
        w_gate=None,
        w_up=None,
        w_down=None,
        router=jnp.asarray(router),
        expert_gate_up=jnp.asarray(gate_up),
        expert_down=jnp.asarray(down),
    )
    return mcfg, dataclasses.replace(params, layers=layers)


def _greedy(cfg, params, tokenizer, prompts, kv_cache_dtype="auto", max_tokens=40):
    from conftest import engine_config

    from jaxinfer.engine.core import EngineCore
    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.sampling.sampler import SamplingParams

    # One engine shape for every mode (quality floors are what is tested, not the engine's
    # forms): KV pages of 16 tokens hold the longest row (7 + 40 tokens) in the smallest block
    # table bucket (4 pages), so each engine compiles one prefill and one decode step (pages of 8
    # added a second decode step at 33 tokens); the layers under lax.scan, which compiles faster
    # than the unrolled loop (the unrolled MoE engine: test_moe_parity, test_moe_parallel).
    ecfg = engine_config(
        cfg,
        "float32",
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_dtype=kv_cache_dtype,
        page_size=16,
        unroll_layers=False,
    )
    eng = EngineCore(ModelRunner(cfg, params, ecfg), tokenizer)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def stories_moe(stories_dir):
    """(cfg, params, tokenizer, prompts, float greedy tokens) of upcycled stories260K."""
    from conftest import stories_reference

    from jaxinfer.loaders import load

    loaded = load(stories_dir)
    cfg, params = _upcycle(loaded.config, loaded.params)
    refs = stories_reference()[:3]
    prompts = [loaded.tokenizer.encode(r["prompt"]) for r in refs]
    ref = _greedy(cfg, params, loaded.tokenizer, prompts)
    for r, p, g in zip(refs, prompts, ref, strict=True):  # the trained model's text
        text = loaded.tokenizer.decode(p + g)
        assert r["expected"].startswith(text.strip()), (text, r["expected"][:200])
    return cfg, params, loaded.tokenizer, prompts, ref


@pytest.mark.parametrize(
    "quant, kv", list(MIN_AGREEMENT), ids=[f"{q}-kv_{k}" for q, k in MIN_AGREEMENT]
)
def test_upcycled_stories_agreement(stories_moe, quant, kv):
    from jaxinfer.quant.tensor import apply_quantization

    cfg, params, tok, prompts, ref = stories_moe
    qp = apply_quantization(params, quant) if quant else params
    got = _greedy(cfg, qp, tok, prompts, kv_cache_dtype=kv)
    agree = np.mean(
        [a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=False)]
    )
    print(f"agreement {quant} kv={kv}: {agree:.3f}")
    for r, g in zip(ref, got, strict=True):
        assert g[:8] == r[:8], (quant, kv)
    assert agree >= MIN_AGREEMENT[quant, kv], (quant, kv, agree)


def test_quantized_moe_checkpoint_round_trip(tmp_path):
    """``save_quantized`` / ``load``: the int8 experts ([L, E, out, in] values, [L, E, out]
    scales), shared expert and float router come back bit for bit, in the same pytree."""
    from jaxinfer.loaders import load
    from jaxinfer.quant.checkpoint import save_quantized

    path = M.build_checkpoint("qwen2_moe", str(tmp_path / "src"))
    cfg, params = load_hf(path)
    qp = quantize(params, "w8a8")
    out = save_quantized(tmp_path / "q", cfg, qp, path)
    loaded = load(out, skip_tokenizer_init=True)
    assert loaded.config == cfg
    assert jax.tree.structure(loaded.params) == jax.tree.structure(qp)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(qp), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.params.layers.expert_down.scales.shape == (3, 4, 64)  # [L, E, D]
    assert isinstance(loaded.params.layers.shared_w_down, QTensor)
