"""Tensor/data parallel sharding: partitioning rules (in process, one device) and sharded engines ==
one device on 8 fake CPU devices (one subprocess running tests/sharding_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.sharding import (
    ShardingError,
    field_spec,
    make_mesh,
    plan_sharding,
    prepare,
    qtensor_specs,
    scale_spec,
)

# stories260K's shape: N=8, K=4, F=172 (not a multiple of 8), D=64, V=512.
STORIES_LIKE = ModelConfig(
    "llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=172,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
)


def _cfg(**kw):
    return ModelConfig(**{**STORIES_LIKE.__dict__, **kw})


def test_plan_rules():
    p = plan_sharding(STORIES_LIKE, 4)
    assert (p.kv_repeat, p.ffn_size, p.cfg.num_kv_heads) == (1, 172, 4)
    p = plan_sharding(STORIES_LIKE, 8)  # K=4 < 8: each KV head twice; F=172 padded to 176
    assert (p.kv_repeat, p.ffn_size) == (2, 176)
    assert (p.cfg.num_kv_heads, p.cfg.intermediate_size) == (8, 176)
    assert (p.embed_axis, p.head_axis) == ("width", "vocab")
    p = plan_sharding(_cfg(vocab_size=510), 4)  # V not divisible: the LM head splits D
    assert p.head_axis == "width"
    assert field_spec(p, "lm_head") == P("model", None)
    assert field_spec(p, "layers.wk") == P(None, None, "model", None)
    assert field_spec(p, "layers.attn_norm") == P()


@pytest.mark.parametrize(
    "cfg_kw, tp, words",
    [
        (dict(), 3, ["num_heads=8", "tensor_parallel_size=3"]),
        (dict(num_heads=12, num_kv_heads=3), 2, ["num_kv_heads=3", "2"]),
        (
            dict(num_heads=12, num_kv_heads=4, hidden_size=66, vocab_size=30),
            4,
            ["hidden_size=66", "vocab_size=30", "4"],
        ),
    ],
)
def test_plan_errors_name_the_numbers(cfg_kw, tp, words):
    with pytest.raises(ShardingError) as e:
        plan_sharding(_cfg(**cfg_kw), tp)
    for w in words:
        assert w in str(e.value)


def test_mesh_larger_than_devices_is_an_error():
    n = len(jax.devices())
    with pytest.raises(ShardingError, match=f"only {n} are available"):
        make_mesh(n + 1, 2)


def test_replication_and_padding_are_exact():
    """KV-head repetition and zero MLP padding leave the logits unchanged (dense forward)."""
    from jaxinfer.models.dense import dense_logits
    from jaxinfer.models.params import init_random, params_from_flat

    cfg = _cfg(num_kv_heads=2, attention_bias=True)
    params = init_random(cfg, jax.random.key(0), scale=0.2)
    plan = plan_sharding(cfg, 8)
    assert (plan.kv_repeat, plan.ffn_size) == (4, 176)
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    flat.update({f"layers.{k}": v for k, v in params.layers.__dict__.items() if v is not None})
    prepared = params_from_flat(
        {k: jnp.asarray(prepare(plan, k, np.asarray(v))) for k, v in flat.items()}
    )
    assert prepared.layers.wk.shape == (2, 64, 8, 8) and prepared.layers.bv.shape == (2, 8, 8)
    assert prepared.layers.w_down.shape == (2, 176, 64)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)
    ref = np.asarray(dense_logits(params, cfg, tokens))
    got = np.asarray(dense_logits(prepared, plan.cfg, tokens))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_quantized_scales_follow_output_channels():
    p = plan_sharding(STORIES_LIKE, 2)
    assert scale_spec(p, "layers.wq") == P(None, "model", None)  # [L, N, H]
    assert scale_spec(p, "layers.w_gate") == P(None, "model")  # [L, F]
    assert scale_spec(p, "layers.w_down") == P(None, None)  # [L, D]: output D is not split
    assert scale_spec(p, "layers.wo") == P(None, None)
    # QTensor values are [*lead, *out, *in]: wq [L, N, H, D], w_down [L, D, F], lm_head [V, D].
    wq_specs = (P(None, "model", None, None), P(None, "model", None))
    assert qtensor_specs(p, "layers.wq", 1) == wq_specs
    assert qtensor_specs(p, "layers.wo", 2) == (P(None, None, "model", None), P(None, None))
    assert qtensor_specs(p, "layers.w_down", 1) == (P(None, None, "model"), P(None, None))
    assert qtensor_specs(p, "lm_head", 1) == (P("model", None), P("model"))


def _sharded_report():
    script = Path(__file__).with_name("sharding_check.py")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sharded_engines_equal_one_device():
    """One test over the one subprocess report (three tests sharing a module fixture ran the
    ~80 s subprocess once per pytest-xdist worker that got one of them): greedy outputs equal
    one device's, tensor-parallel logits equal within f32 tolerance, every device holds only its
    shard."""
    report = _sharded_report()
    # greedy outputs == one device, on every mesh
    meshes = {(r["model"], r["tp"], r["dp"]) for r in report}
    for m in [
        ("stories260K", 2, 1),
        ("stories260K", 4, 1),
        ("stories260K", 8, 1),
        ("stories260K", 2, 2),
        ("qwen2", 4, 1),
        ("gemma2", 2, 1),
    ]:
        assert m in meshes, m
    for r in report:
        if r["tp"] * r["dp"] > 1:
            assert r["same_tokens"], r
    # logits equal within the float32 tolerance (tensor parallel: the same steps as one device)
    for r in report:
        if "logits_rel_err" in r:
            assert r["logits_rel_err"] <= 1e-5, r
    # one compilation per forward step shape: the first step's "no previous tokens" input is
    # placed as the sampling step's output, so a pipelined step reuses its executable
    for r in report:
        if r["tp"] * r["dp"] > 1:
            assert r["extra_forward_compiles"] == 0, r
    # each device holds only its shard
    for r in report:
        if r["tp"] * r["dp"] > 1:
            assert r["shard_problems"] == [], r
    st8 = next(r for r in report if (r["model"], r["tp"], r["dp"]) == ("stories260K", 8, 1))
    assert st8["kv_heads"] == 8 and st8["ffn"] == 176  # K=4 replicated to 8, F=172 padded
    assert st8["kv_shard"][1] == 1 and st8["wq_heads_per_device"] == 1
