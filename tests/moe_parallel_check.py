"""Mixture-of-experts models split over 8 fake CPU devices vs one device; prints one JSON report
for tests/test_moe_parallel.py (one process for everything that needs the 8 devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_parallel_check.py CKPT

``meshes``: the tiny Qwen3-MoE checkpoint CKPT (``moe_fixtures.EP_CASE``: 8 experts, a dense
and a sparse layer) on one device and on each mesh of ``MESHES`` (tp, dp, expert parallel or
the width split): greedy tokens, the largest logits difference relative to the largest logit
(tp-only meshes, whose steps are one device's), the expert weights' shard shapes, and the
forward compilations beyond one per step shape.

``layers``: one sparse layer (``expert_sharding.sharded_moe_mlp``) against the one-device
``moe.moe_mlp`` on random weights of two shapes the checkpoint lacks: gpt-oss's (router bias,
expert biases, clamped SwiGLU) and Qwen2-MoE's (a gated shared expert), with widths that do not
divide 8 (zero padding), each split of ``LAYER_SPLITS``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharding_check import build, run  # noqa: E402

from jaxinfer.models.config import ModelConfig  # noqa: E402
from jaxinfer.models.expert_sharding import sharded_moe_mlp  # noqa: E402
from jaxinfer.models.moe import moe_mlp  # noqa: E402
from jaxinfer.models.params import LayerParams  # noqa: E402
from jaxinfer.models.sharding import field_spec, make_mesh, plan_sharding, prepare  # noqa: E402

# (tp, dp, enable_expert_parallel)
# Each path once: expert parallel over 8 devices (tp only: its logits against one device's),
# expert parallel in data-parallel replicas (4 x 2), and the width split (2 x 1: unrolled layers,
# logits). The width split in replicas runs the same per-replica code as 4 x 2 (replica_view,
# replica_meshes) with the split of 2 x 1; the layer checks split the width over tp = 8 and 4.
MESHES = [(8, 1, True), (4, 2, True), (2, 1, False)]
LAYER_SPLITS = [(2, True), (8, True), (8, False), (4, False)]
PROMPTS = [[5, 17, 33, 9, 101, 7], [200, 3, 45], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
MAX_TOKENS = 6


def _first_layer(eng, name):
    layers = eng.params.layers
    return getattr(layers[0], name) if isinstance(layers, tuple) else getattr(layers, name)


def check_meshes(path: str) -> list[dict]:
    t0 = time.perf_counter()
    engines, _ = build(path, 1, 1)
    ref_tokens, ref_logits, _ = run(engines, PROMPTS, MAX_TOKENS)
    rows = [{"tp": 1, "dp": 1, "tokens": ref_tokens, "seconds": round(time.perf_counter() - t0, 1)}]
    for tp, dp, ep in MESHES:
        t0 = time.perf_counter()
        engines, placer = build(path, tp, dp, enable_expert_parallel=ep)
        tokens, logits, extra = run(engines, PROMPTS, MAX_TOKENS)
        gate_up = _first_layer(engines[0], "expert_gate_up")
        down = _first_layer(engines[0], "expert_down")
        row = {
            "tp": tp,
            "dp": dp,
            "expert_parallel": ep,
            "expert_split": placer.plan.cfg.expert_split,
            "tokens": tokens,
            "same_tokens": tokens == ref_tokens,
            "extra_forward_compiles": extra,
            # the last 3 axes: [E, D, 2I] and [E, I, D] (a stacked L axis dropped)
            "gate_up_global": list(gate_up.shape[-3:]),
            "gate_up_shards": sorted(
                {tuple(s.data.shape[-3:]) for s in gate_up.addressable_shards}
            ),
            "down_shards": sorted({tuple(s.data.shape[-3:]) for s in down.addressable_shards}),
            "devices_per_replica": len(gate_up.sharding.device_set),
        }
        if dp == 1:  # same steps as one device: compare every step's logits
            scale = max(float(np.abs(r).max()) for r in ref_logits)
            row["logits_steps"] = [len(logits), len(ref_logits)]
            row["logits_rel_err"] = (
                max(float(np.abs(a - r).max()) for a, r in zip(logits, ref_logits, strict=True))
                / scale
                if len(logits) == len(ref_logits)
                else None
            )
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


_LAYER_BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
)
LAYER_CONFIGS = {
    "gpt_oss_like": ModelConfig(
        "gpt_oss",
        **_LAYER_BASE,
        moe_intermediate_size=36,  # 36 % 8 != 0: padded to 40 for the width split over 8
        router_order="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_glu="gpt_oss_clamped",
    ),
    "qwen2_moe_like": ModelConfig(
        "qwen2_moe",
        **_LAYER_BASE,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=20,  # padded to 24 over 8
        shared_expert_gate=True,
    ),
}
_NONE_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def _layer_weights(cfg: ModelConfig, rng) -> dict[str, np.ndarray]:
    e, d, i, u = (
        cfg.num_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    )
    shapes = {"router": (d, e), "expert_gate_up": (e, d, 2 * i), "expert_down": (e, i, d)}
    if cfg.router_bias:
        shapes["router_bias"] = (e,)
    if cfg.expert_bias:
        shapes.update(expert_gate_up_bias=(e, 2 * i), expert_down_bias=(e, d))
    if u:
        shapes.update(shared_w_gate=(d, u), shared_w_up=(d, u), shared_w_down=(u, d))
    if cfg.shared_expert_gate:
        shapes["shared_expert_gate"] = (d,)
    std = {"router": 0.5, "router_bias": 0.5}
    return {
        k: rng.normal(0, std.get(k, 0.2), (1, *s)).astype(np.float32) for k, s in shapes.items()
    }


def check_layers() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, cfg in LAYER_CONFIGS.items():
        w = _layer_weights(cfg, rng)
        h = jnp.asarray(rng.normal(0, 1, (13, cfg.hidden_size)).astype(np.float32))
        none = dict.fromkeys(_NONE_FIELDS)
        lp = LayerParams(**none, **{k: jnp.asarray(v[0]) for k, v in w.items()})
        ref = np.asarray(jax.jit(moe_mlp, static_argnums=0)(cfg, lp, h))
        for tp, ep in LAYER_SPLITS:
            plan = plan_sharding(cfg, tp, ep)
            mesh = make_mesh(tp, 1)
            placed = {}
            for k, v in w.items():
                x = prepare(plan, f"layers.{k}", v)[0]  # one layer: the L axis dropped
                spec = P(*tuple(field_spec(plan, f"layers.{k}"))[1:])
                placed[k] = jax.device_put(x, NamedSharding(mesh, spec))
            with jax.set_mesh(mesh):
                got = jax.jit(sharded_moe_mlp, static_argnums=0)(
                    plan.cfg, LayerParams(**none, **placed), h
                )
            got = np.asarray(got)
            rows.append(
                {
                    "config": name,
                    "tp": tp,
                    "expert_parallel": ep,
                    "expert_split": plan.cfg.expert_split,
                    "moe_width": plan.cfg.moe_intermediate_size,
                    "rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
                }
            )
    return rows


def main() -> None:
    t0 = time.perf_counter()
    report = {"meshes": check_meshes(sys.argv[1]), "layers": check_layers()}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
