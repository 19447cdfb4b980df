"""Tensor/data parallel sharding: partitioning rules and the default sizes (in process, one device),
and on 8 fake CPU devices (one subprocess running tests/sharding_check.py, as ``XLA_FLAGS`` must be
set before jax is imported): sharded engines == one device; ``--data-parallel-size 2`` reproduces
llama2.c's greedy outputs; an ``LLM`` given no sizes uses one device when the weights fit;
quantization and speculative decoding on a mesh are refused; and the persistent compilation cache
that process wrote is hit by a second process running the same data-parallel job, which adds no
forward step to it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import stories_reference
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
    with pytest.raises(ShardingError, match=f"only {n} are available") as e:
        make_mesh(n + 1, 2)
    # how to get more devices on CPU (issue 29's new-user trial)
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={2 * (n + 1)}" in str(e.value)


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


BOS = 1


def _records(path: Path, stories: Path) -> None:
    """llama2.c's two 64-step cases as records (BOS-prefixed ids, run.c's step count)."""
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(stories / "tok512.model", vocab_size=512)
    lines = []
    for i, c in enumerate(stories_reference()):
        ids = tok.encode(c["prompt"])
        if c["max_steps"] == 64:
            lines.append(
                {
                    "id": str(i),
                    "prompt_token_ids": ids,
                    "stop_token_ids": [BOS],
                    "max_tokens": c["max_steps"] - (len(ids) - 1),
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def _eight_devices(work: Path, cache: Path, stories: Path, *flags: str) -> dict:
    """tests/sharding_check.py's report (its last stdout line), run with the persistent
    compilation cache in ``cache``."""
    script = Path(__file__).with_name("sharding_check.py")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAXINFER_CACHE_DIR": str(cache),
        "JAXINFER_COMPILATION_CACHE": "1",
        "JAXINFER_SHARED": str(stories.parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, str(script), "--data-parallel", str(work), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cache_files(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def test_sharded_and_data_parallel_engines_then_the_disk_cache_in_a_second_process(
    tmp_path, stories_dir
):
    """One test over the one subprocess report (tests sharing a module fixture ran the
    subprocess once per pytest-xdist worker that got one of them): greedy outputs equal one
    device's, tensor-parallel logits equal within f32 tolerance, every device holds only its
    shard; the data-parallel job's outputs are run.c's; then the second process over the first's
    compilation cache."""
    from hf_fixtures import build_checkpoint

    _records(tmp_path / "prompts.jsonl", stories_dir)
    for family in ("qwen2", "gemma2"):  # built here: the subprocess then imports no transformers
        build_checkpoint(family, str(tmp_path / "ckpts" / family))
    cache = tmp_path / "cache"
    first = _eight_devices(
        tmp_path, cache, stories_dir, "--checkpoints", str(tmp_path / "checkpoints")
    )
    report = first["meshes"]
    # greedy outputs == one device, on every mesh
    meshes = {(r["model"], r["tp"], r["dp"]) for r in report}
    for m in [
        ("stories260K", 2, 1),
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

    # --data-parallel-size 2: two replicas on two devices, each ran (one prompt each), and the
    # outputs are run.c's.
    dp = first["data_parallel"]
    replicas = dp["dp_replicas"]
    assert len(replicas) == 2 and replicas[0]["devices"] != replicas[1]["devices"], replicas
    assert all(len(r["devices"]) == 1 and r["steps_compiled"] > 0 for r in replicas), replicas
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(stories_dir / "tok512.model", vocab_size=512)
    cases = stories_reference()
    prompts = {
        json.loads(x)["id"]: json.loads(x)["prompt_token_ids"]
        for x in (tmp_path / "prompts.jsonl").read_text().splitlines()
    }
    assert dp["dp_rc"] == 0 and len(dp["dp_records"]) == len(prompts) == 2
    for r in dp["dp_records"]:
        assert "error" not in r, r
        text = tok.decode(prompts[r["id"]] + r["token_ids"], skip_special_tokens=True)
        assert text == cases[int(r["id"])]["expected"], r["id"]

    # No sizes given and the weights fit one device: one device, no mesh, 8 devices present.
    assert dp["default"] == {"mesh": False, "engines": 1, "tp": 1, "embed_devices": 1}

    # Quantization and speculative decoding on a mesh are refused, saying what is unsupported.
    for name in ("quant_tp", "quant_dp"):
        assert dp[name] == (
            "ValueError: quantization with tensor/data parallel is not supported yet"
        ), dp[name]
    for name in ("spec_tp", "spec_dp"):
        assert dp[name] == (
            "ValueError: speculative decoding does not support sharded engines yet"
        ), dp[name]

    # The persistent cache: the first process wrote it; a second running the same data-parallel
    # job hits it, adds no forward-step file, and gives the same records. (The cache keeps
    # compiles over 0.5 s: a forward step takes seconds, but the sampling step ~0.5 s, so whether
    # the second run writes a sampling entry the first did not depends on the machine's load.)
    written = _cache_files(cache / "xla")
    assert any("forward" in f for f in written), written
    second = _eight_devices(tmp_path, cache, stories_dir, "--data-parallel-only")["data_parallel"]
    assert second["cache_hits"] >= 2, second["cache_hits"]
    after = _cache_files(cache / "xla")
    assert written <= after and not {f for f in after - written if "forward" in f}, after - written
    tokens = {r["id"]: r["token_ids"] for r in dp["dp_records"]}
    assert {r["id"]: r["token_ids"] for r in second["dp_records"]} == tokens


class _Device:
    """A stand-in device reporting ``bytes_limit`` as TPU/GPU devices do (CPU reports none)."""

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_default_parallelism_uses_all_devices_only_when_the_weights_do_not_fit():
    from jaxinfer.models.sharding import default_parallelism

    cfg = ModelConfig(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_layers=5,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        tie_word_embeddings=True,
    )
    # Independent count: embedding, per layer q/k/v/o + gate/up/down + two norms, final norm.
    per_layer = 64 * (8 + 4 + 4) * 8 + 8 * 8 * 64 + 3 * 64 * 172 + 2 * 64
    need = (512 * 64 + 5 * per_layer + 64) * 4  # float32 bytes, tied head
    assert cfg.num_params() * 4 == need
    fits = [_Device(int(need / 0.9) + 64)] * 8
    too_big = [_Device(int(need / 0.9) - 64)] * 8
    assert default_parallelism(cfg, jnp.float32, fits) == (1, 1)
    assert default_parallelism(cfg, jnp.float32, too_big) == (8, 1)
    assert default_parallelism(cfg, jnp.bfloat16, too_big) == (1, 1)  # half the bytes fit
    assert default_parallelism(cfg, jnp.float32, [_Device(None)] * 8) == (1, 1)  # CPU
