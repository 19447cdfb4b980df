"""README claims that need a fresh process (issue 16): ``--data-parallel-size`` (outputs equal
llama2.c's greedy reference), the tensor-parallel default (one device when the weights fit), the
refusals of quantization and speculative decoding on a mesh, and the persistent compilation cache
(a first run writes it, a second identical run hits it and adds nothing).

Runs this file as a script twice on 8 fake CPU devices (``XLA_FLAGS`` must be set before jax is
imported): ``first`` does everything, ``second`` repeats the data-parallel run over the first's
cache. The default-size rule itself is checked in process with stand-in devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = "--xla_force_host_platform_device_count=8"
BOS = 1
ENGINE = ["--max-model-len", "256", "--page-size", "64", "--max-num-seqs", "4", "--no-progress"]


def _records(path: Path, stories: Path) -> None:
    """llama2.c's two 64-step cases as records (BOS-prefixed ids, run.c's step count)."""
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(stories / "tok512.model", vocab_size=512)
    cases = json.loads((stories / "greedy_reference.json").read_text())
    lines = []
    for i, c in enumerate(cases):
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


def _script(mode: str, work: Path, stories: Path) -> dict:
    """The subprocess side: returns the report printed as the last stdout line."""
    import jax

    from jaxinfer.cli import main as cli

    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None
    )
    report = {"devices": jax.device_count()}
    built = []
    load = cli._load_llm
    cli._load_llm = lambda args: built.append(load(args)) or built[-1]
    out = work / f"{mode}.jsonl"
    report["dp_rc"] = cli.main(
        [
            "generate",
            "--model",
            str(stories),
            "--prompts",
            str(work / "prompts.jsonl"),
            "--out",
            str(out),
            "--data-parallel-size",
            "2",
            "--temperature",
            "0",
            *ENGINE,
        ]
    )
    report["dp_records"] = [json.loads(x) for x in out.read_text().splitlines()]
    report["dp_replicas"] = [
        {
            "devices": sorted(str(d) for d in e.params.embed.devices()),
            "steps_compiled": e.num_compilations,
        }
        for e in built[0].engines
    ]
    report["cache_hits"] = len(hits)
    if mode == "second":
        return report
    from jaxinfer.llm import LLM

    llm = LLM(stories, max_model_len=64, max_num_seqs=2, compilation_cache=False)
    report["default"] = {
        "mesh": llm.mesh is not None,
        "engines": len(llm.engines),
        "tp": llm.sharding_plan.tp,
        "embed_devices": len(llm.engine.params.embed.devices()),
    }
    refusals = {
        "quant_tp": dict(tensor_parallel_size=2, quantization="int8"),
        "quant_dp": dict(data_parallel_size=2, quantization="w8a8"),
        "spec_tp": dict(tensor_parallel_size=2, speculative="ngram"),
        "spec_dp": dict(data_parallel_size=2, speculative="draft-model", draft_model="self"),
    }
    for name, kw in refusals.items():
        try:
            LLM(stories, max_model_len=64, max_num_seqs=2, compilation_cache=False, **kw)
            report[name] = None
        except Exception as e:  # noqa: BLE001 - the report names the type
            report[name] = f"{type(e).__name__}: {e}"
    return report


def _run(mode: str, work: Path, stories: Path, cache: Path) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": FLAGS,
        "JAXINFER_CACHE_DIR": str(cache),
        "JAXINFER_COMPILATION_CACHE": "1",
        "JAXINFER_SHARED": str(stories.parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(work), str(stories)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cache_files(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def test_data_parallel_default_sizes_refusals_and_compilation_cache(tmp_path, stories_dir):
    from tests.conftest import stories_reference

    _records(tmp_path / "prompts.jsonl", stories_dir)
    cache = tmp_path / "cache"
    first = _run("first", tmp_path, stories_dir, cache)
    assert first["devices"] == 8

    # --data-parallel-size 2: two replicas on two devices, each ran (one prompt each), and the
    # outputs are run.c's.
    replicas = first["dp_replicas"]
    assert len(replicas) == 2 and replicas[0]["devices"] != replicas[1]["devices"], replicas
    assert all(len(r["devices"]) == 1 and r["steps_compiled"] > 0 for r in replicas), replicas
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(stories_dir / "tok512.model", vocab_size=512)
    cases = stories_reference()
    prompts = {
        json.loads(x)["id"]: json.loads(x)["prompt_token_ids"]
        for x in (tmp_path / "prompts.jsonl").read_text().splitlines()
    }
    assert first["dp_rc"] == 0 and len(first["dp_records"]) == len(prompts) == 2
    for r in first["dp_records"]:
        assert "error" not in r, r
        text = tok.decode(prompts[r["id"]] + r["token_ids"], skip_special_tokens=True)
        assert text == cases[int(r["id"])]["expected"], r["id"]

    # No sizes given and the weights fit one device: one device, no mesh, 8 devices present.
    assert first["default"] == {"mesh": False, "engines": 1, "tp": 1, "embed_devices": 1}

    # Quantization and speculative decoding on a mesh are refused, saying what is unsupported.
    for name in ("quant_tp", "quant_dp"):
        assert first[name] == (
            "ValueError: quantization with tensor/data parallel is not supported yet"
        ), first[name]
    for name in ("spec_tp", "spec_dp"):
        assert first[name] == (
            "ValueError: speculative decoding does not support sharded engines yet"
        ), first[name]

    # The persistent cache: the first run wrote it; a second identical run hits it, adds no
    # forward-step file, and gives the same records. (The cache keeps compiles over 0.5 s: a
    # forward step takes seconds, but the sampling step ~0.5 s, so whether the second run writes
    # a sampling entry the first did not depends on the machine's load.)
    written = _cache_files(cache / "xla")
    assert any("forward" in f for f in written), written
    second = _run("second", tmp_path, stories_dir, cache)
    assert second["cache_hits"] >= 2, second["cache_hits"]
    after = _cache_files(cache / "xla")
    assert written <= after and not {f for f in after - written if "forward" in f}, after - written
    tokens = {r["id"]: r["token_ids"] for r in first["dp_records"]}
    assert {r["id"]: r["token_ids"] for r in second["dp_records"]} == tokens


class _Device:
    """A stand-in device reporting ``bytes_limit`` as TPU/GPU devices do (CPU reports none)."""

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_default_parallelism_uses_all_devices_only_when_the_weights_do_not_fit():
    import jax.numpy as jnp

    from jaxinfer.models.config import ModelConfig
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


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    mode, work, stories = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    print(json.dumps(_script(mode, work, stories)))
