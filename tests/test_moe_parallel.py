"""Mixture-of-experts models on a mesh (``models.expert_sharding``): the sharding plan's rules
and refusals in process, then on 8 fake CPU devices (one subprocess running
tests/moe_parallel_check.py, as ``XLA_FLAGS`` must be set before jax is imported) greedy tokens
and logits equal to one device's with the experts split over tp = 8 (expert parallel), over
tp = 4 in each of 2 data-parallel replicas, and with each expert's width split over tp = 2;
sparse layers of gpt-oss's and Qwen2-MoE's shapes (expert biases, a shared expert, widths
zero-padded) against the one-device layer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ShardingError
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.sharding import field_spec, plan_sharding, prepare

# The shape of moe_fixtures.EP_CASE: N=8, K=2, E=8 experts of width I=32, layer 0 dense.
EP_LIKE = ModelConfig(
    "qwen3_moe",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    sparse_layers=(False, True),
)


def _cfg(**kw):
    return ModelConfig(**{**EP_LIKE.__dict__, **kw})


def test_plan_splits_experts_or_their_width():
    assert plan_sharding(EP_LIKE, 1).cfg.expert_split == "none"
    ep = plan_sharding(EP_LIKE, 4, enable_expert_parallel=True)
    assert ep.cfg.expert_split == "experts" and ep.cfg.moe_intermediate_size == 32
    assert field_spec(ep, "layers.expert_gate_up") == P(None, "model", None, None)
    assert field_spec(ep, "layers.expert_down") == P(None, "model", None, None)
    assert field_spec(ep, "layers.router") == P()
    assert field_spec(ep, "layers.w_gate") == P(None, None, "model")  # the dense layer
    width = plan_sharding(_cfg(moe_intermediate_size=30), 4)  # 30 % 4: padded to 32
    assert width.cfg.expert_split == "width" and width.cfg.moe_intermediate_size == 32
    assert field_spec(width, "layers.expert_gate_up") == P(None, None, None, "model")
    assert field_spec(width, "layers.expert_down") == P(None, None, "model", None)


def test_width_split_lays_gate_and_up_out_per_shard():
    """Shard s of the [gate | up] columns holds [gate_s | up_s], I zero-padded to tp's multiple:
    written out by hand for I = 3 over tp = 2 (padded to 4, 2 columns of each per shard)."""
    plan = plan_sharding(_cfg(moe_intermediate_size=3), 2)
    gate = np.array([1.0, 2.0, 3.0])
    up = np.array([10.0, 20.0, 30.0])
    x = np.concatenate([gate, up]).reshape(1, 1, 1, 6)  # [L, E, D, 2I]
    got = prepare(plan, "layers.expert_gate_up", x).reshape(-1)
    np.testing.assert_array_equal(got, [1, 2, 10, 20, 3, 0, 30, 0])
    down = np.ones((1, 1, 3, 2))
    assert prepare(plan, "layers.expert_down", down).shape == (1, 1, 4, 2)
    assert prepare(plan, "layers.expert_down", down)[0, 0, 3].tolist() == [0, 0]


@pytest.mark.parametrize(
    "cfg, tp, ep, words",
    [
        (_cfg(num_experts=6), 4, True, ["num_experts=6", "tensor_parallel_size=4", "[2, 3, 6]"]),
        (EP_LIKE, 1, True, ["tensor_parallel_size=1"]),
        (
            _cfg(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, sparse_layers=()),
            2,
            True,
            ["needs a mixture-of-experts model"],
        ),
    ],
)
def test_plan_refuses_what_cannot_split(cfg, tp, ep, words):
    with pytest.raises(ShardingError) as e:
        plan_sharding(cfg, tp, enable_expert_parallel=ep)
    for w in words:
        assert w in str(e.value)


def test_moe_on_eight_devices_equals_one_device(tmp_path):
    """One test over the one subprocess report: every mesh's greedy tokens equal one device's,
    tp-only meshes' logits within the float32 tolerance, no extra compilation, each device holds
    E / tp experts (expert parallel) or I / tp of each expert's width; the sparse layers of the
    other shapes within the float32 tolerance of one device's."""
    import moe_fixtures as M

    ckpt = M.build_checkpoint("ep", str(tmp_path / "ep"))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAXINFER_CACHE_DIR": str(tmp_path / "cache"),
    }
    script = Path(__file__).with_name("moe_parallel_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), ckpt], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    meshes = report["meshes"]
    ref = meshes[0]
    assert (ref["tp"], ref["dp"]) == (1, 1)
    seen = {(r["tp"], r["dp"], r["expert_parallel"]) for r in meshes[1:]}
    assert seen == {(8, 1, True), (4, 2, True), (2, 1, False)}
    e, d, i = 8, 64, 32
    for r in meshes[1:]:
        assert r["same_tokens"], r
        assert r["extra_forward_compiles"] == 0, r
        tp = r["tp"]
        assert r["devices_per_replica"] == tp, r
        assert r["gate_up_global"] == [e, d, 2 * i], r
        if r["expert_parallel"]:
            assert r["expert_split"] == "experts", r
            assert r["gate_up_shards"] == [[e // tp, d, 2 * i]], r
            assert r["down_shards"] == [[e // tp, i, d]], r
        else:
            assert r["expert_split"] == "width", r
            assert r["gate_up_shards"] == [[e, d, 2 * i // tp]], r
            assert r["down_shards"] == [[e, i // tp, d]], r
        if r["dp"] == 1:  # the same steps as one device: float32 tolerance
            assert r["logits_steps"][0] == r["logits_steps"][1], r
            assert r["logits_rel_err"] <= 1e-5, r

    layers = report["layers"]
    assert len(layers) == 8
    for r in layers:
        assert r["rel_err"] <= 1e-5, r
    padded = [r for r in layers if r["config"] == "gpt_oss_like" and r["expert_split"] == "width"]
    assert {r["moe_width"] for r in padded} == {36, 40}  # 36 over 4; padded to 40 over 8
