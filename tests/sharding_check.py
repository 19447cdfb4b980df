"""Sharded engines vs one device on 8 fake CPU devices; prints one JSON report for
tests/test_sharding.py (one process for everything that needs the 8 devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_check.py [--quick]
        [--checkpoints DIR] [--data-parallel WORK_DIR [--data-parallel-only]]

``meshes``: for each model (stories260K and tiny random Hugging Face checkpoints of several
families) and each mesh (tp x dp), whether the greedy outputs equal the one-device outputs, the
largest logits difference relative to the largest logit (tensor parallel runs, whose steps are the
same as on one device), and any parameter or KV-pool shard whose shape is not the expected
``global shape / tp`` on the split axis. The tiny checkpoints are DIR/qwen2 and DIR/gemma2 when
``--checkpoints DIR`` holds them (so this process need not import transformers), else built here.

``data_parallel`` (with ``--data-parallel WORK_DIR``): ``jaxinfer generate --data-parallel-size 2``
on WORK_DIR/prompts.jsonl (records written to WORK_DIR/first.jsonl, or second.jsonl with
``--data-parallel-only``, which runs nothing else), each replica's devices and compilations, the
persistent compilation cache's hits in this process; then (not with ``--data-parallel-only``) the
default sizes of an ``LLM`` given none and the refusals of quantization and speculative decoding
on a mesh.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxinfer.args import EngineArgs  # noqa: E402
from jaxinfer.engine.config import resolve  # noqa: E402
from jaxinfer.engine.core import EngineCore  # noqa: E402
from jaxinfer.engine.runner import ModelRunner  # noqa: E402
from jaxinfer.loaders import load  # noqa: E402
from jaxinfer.models.sharding import ShardedPlacer, replica_meshes, replica_view  # noqa: E402
from jaxinfer.sampling.params import SamplingParams  # noqa: E402

SHARED = Path(os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260K"


class _NoTokenizer:
    """Token ids in, token ids out (the tiny HF checkpoints have no tokenizer)."""

    eos_ids = ()
    bos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def build(path, tp: int, dp: int, enable_expert_parallel: bool = False):
    """Engines (one per replica) of the checkpoint on a tp x dp mesh, as ``LLM`` builds them."""
    placer = ShardedPlacer(tp, dp, enable_expert_parallel=enable_expert_parallel)
    loaded = load(path, dtype="float32", place=placer)
    tok = loaded.tokenizer or _NoTokenizer()
    # Layers unrolled (the CPU default) on one device and the 2 x 1 mesh; under lax.scan (the
    # TPU/GPU default) on the other meshes: both forms are checked sharded, and scan compiles
    # several times faster.
    unroll = None if (tp * dp == 1 or (tp, dp) == (2, 1)) else False
    cfg = placer.plan.cfg
    args = EngineArgs(
        path,
        max_model_len=64,
        page_size=32,
        kv_pages=12,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        unroll_layers=unroll,
    )
    ecfg = resolve(args, cfg, loaded.params.embed.dtype, mesh=placer.mesh, tp=placer.plan.tp)
    if placer.mesh is None:
        return [EngineCore(ModelRunner(cfg, loaded.params, ecfg), tok)], placer
    return [
        EngineCore(ModelRunner(cfg, replica_view(loaded.params, m), ecfg, mesh=m), tok)
        for m in replica_meshes(placer.mesh)
    ], placer


def run(engines, prompts, max_tokens):
    """Greedy token ids per prompt (prompt i on replica i % dp), the logits of every step, and
    the forward compilations beyond one per step shape (jit cache entries - compile keys)."""
    logits = []
    jitted = {}
    for eng in engines:
        fwd = eng.runner._forward  # the jitted forward (a test reaching inside the runner)
        jitted[id(fwd)] = fwd
        fwd.clear_cache()  # jit objects of equal options share one cache: count this run's only

        def recording(*a, _fwd=fwd, **k):
            kv, lg = _fwd(*a, **k)
            logits.append(np.asarray(lg))
            return kv, lg

        eng.runner._forward = recording
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engines[i % len(engines)].add_request(str(i), ids, sp)
    done = {}
    while any(e.has_unfinished() for e in engines):
        for e in engines:
            if e.has_unfinished():
                for out in e.step():
                    if out.finished:
                        done[out.request_id] = out.token_ids
    keys = sum(len([k for k in e.compile_keys if k[0] == "forward"]) for e in engines)
    extra = sum(f._cache_size() for f in jitted.values()) - keys
    return [done[str(i)] for i in range(len(prompts))], logits, extra


def shard_problems(engines, placer) -> list[str]:
    """Arrays whose addressable shards are not ``global / tp`` on the split axis (or that are not
    split at all when they should be)."""
    tp = placer.plan.tp
    bad = []
    for eng in engines:
        leaves = jax.tree_util.tree_leaves_with_path(eng.params)
        leaves += [(("kv.k_pages",), eng.kv.k_pages), (("kv.v_pages",), eng.kv.v_pages)]
        for path, x in leaves:
            name = jax.tree_util.keystr(path) if not isinstance(path[0], str) else path[0]
            if tp == 1:
                if len(x.sharding.device_set) != 1:
                    bad.append(f"{name}: on {len(x.sharding.device_set)} devices")
                continue
            spec = tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
            want = tuple(
                n // tp if i < len(spec) and spec[i] == "model" else n
                for i, n in enumerate(x.shape)
            )
            split_axes = [i for i, s in enumerate(spec) if s == "model"]
            is_norm = "norm" in name
            if not split_axes and not is_norm:
                bad.append(f"{name}: not split (spec {spec})")
            shapes = {tuple(s.data.shape) for s in x.addressable_shards}
            if shapes != {want} or len(x.addressable_shards) != tp:
                bad.append(
                    f"{name}: shards {sorted(shapes)} on {len(x.addressable_shards)} "
                    f"devices, expected {want} on {tp}"
                )
    return bad


def _wq(eng):
    """wq of the first layer (the engine may hold layers stacked or as a tuple, unstacked)."""
    layers = eng.params.layers
    return layers[0].wq if isinstance(layers, tuple) else layers.wq


def check_model(name, path, prompts, meshes, max_tokens):
    t0 = time.perf_counter()
    engines, _ = build(path, 1, 1)
    ref_tokens, ref_logits, _ = run(engines, prompts, max_tokens)
    rows = [
        {
            "model": name,
            "tp": 1,
            "dp": 1,
            "tokens": ref_tokens,
            "seconds": round(time.perf_counter() - t0, 1),
        }
    ]
    for tp, dp in meshes:
        t0 = time.perf_counter()
        engines, placer = build(path, tp, dp)
        tokens, logits, extra = run(engines, prompts, max_tokens)
        row = {
            "model": name,
            "tp": tp,
            "dp": dp,
            "same_tokens": tokens == ref_tokens,
            "extra_forward_compiles": extra,
            "kv_heads": placer.plan.cfg.num_kv_heads,
            "ffn": placer.plan.ffn_size,
            "kv_shard": list(engines[0].kv.k_pages.addressable_shards[0].data.shape),
            "wq_heads_per_device": _wq(engines[0]).addressable_shards[0].data.shape[-2],
            "shard_problems": shard_problems(engines, placer),
        }
        if dp == 1:  # same steps as one device: compare every step's logits
            assert len(logits) == len(ref_logits)
            scale = max(float(np.abs(r).max()) for r in ref_logits)
            row["logits_rel_err"] = (
                max(float(np.abs(a - r).max()) for a, r in zip(logits, ref_logits, strict=True))
                / scale
            )
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


def checkpoint(family: str, tmp: str) -> str:
    """``hf_fixtures``' tiny checkpoint of ``family``: the one built under ``--checkpoints DIR``
    (by the caller, which has transformers imported already), else built here in ``tmp``."""
    if "--checkpoints" in sys.argv:
        path = Path(sys.argv[sys.argv.index("--checkpoints") + 1]) / family
        if path.is_dir():
            return str(path)
    from hf_fixtures import build_checkpoint

    return build_checkpoint(family, os.path.join(tmp, family))


DP_ENGINE = ["--max-model-len", "256", "--page-size", "64", "--max-num-seqs", "4", "--no-progress"]


def data_parallel(work: Path, only: bool, hits: list) -> dict:
    """``jaxinfer generate --data-parallel-size 2`` in this process (see the module docstring)."""
    from jaxinfer.cli import main as cli

    report = {}
    built = []
    load_llm = cli._load_llm
    cli._load_llm = lambda args: built.append(load_llm(args)) or built[-1]
    out = work / ("second.jsonl" if only else "first.jsonl")
    argv = ["generate", "--model", str(STORIES), "--prompts", str(work / "prompts.jsonl")]
    argv += ["--out", str(out), "--data-parallel-size", "2", "--temperature", "0", *DP_ENGINE]
    report["dp_rc"] = cli.main(argv)
    cli._load_llm = load_llm
    report["dp_records"] = [json.loads(x) for x in out.read_text().splitlines()]
    report["dp_replicas"] = [
        {
            "devices": sorted(str(d) for d in e.params.embed.devices()),
            "steps_compiled": e.num_compilations,
        }
        for e in built[0].engines
    ]
    report["cache_hits"] = len(hits)
    if only:
        return report
    from jaxinfer.llm import LLM

    llm = LLM(STORIES, max_model_len=64, max_num_seqs=2, compilation_cache=False)
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
            LLM(STORIES, max_model_len=64, max_num_seqs=2, compilation_cache=False, **kw)
            report[name] = None
        except Exception as e:  # noqa: BLE001 - the report names the type
            report[name] = f"{type(e).__name__}: {e}"
    return report


def main() -> None:
    quick = "--quick" in sys.argv
    work = (
        Path(sys.argv[sys.argv.index("--data-parallel") + 1])
        if "--data-parallel" in sys.argv
        else None
    )
    assert jax.device_count() == 8, jax.devices()
    from jaxinfer.llm import enable_compilation_cache

    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None
    )
    enable_compilation_cache()  # reruns are quick (JAXINFER_COMPILATION_CACHE=0 turns it off)
    if work is not None and "--data-parallel-only" in sys.argv:
        print(json.dumps({"data_parallel": data_parallel(work, True, hits)}))
        return
    rng = np.random.default_rng(0)
    out = []
    if STORIES.is_dir():
        from jaxinfer.tokenizers import load_tokenizer

        tok = load_tokenizer(STORIES)
        texts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]
        prompts = [tok.encode(t) for t in texts]
        # 2 x 1 unrolled layers, 8 x 1 under scan with K=4 replicated and F padded, 2 x 2 data
        # parallel (tp = 4 under scan: qwen2 below, its KV heads and biases replicated)
        meshes = [(2, 1), (8, 1), (2, 2)]
        out += check_model("stories260K", STORIES, prompts, meshes, max_tokens=10)
    # qwen2: q/k/v biases (bk/bv repeated with the KV heads at tp=4 > K=2), tied embedding;
    # gemma2: untied LM head split over V, soft-caps, sandwich norms, GeGLU.
    families = {"qwen2": [(4, 1)], "gemma2": [(2, 1)]}
    if quick:
        families = {"qwen2": [(4, 1)]}
    with tempfile.TemporaryDirectory() as tmp:
        for fam, meshes in families.items():
            path = checkpoint(fam, tmp)
            prompts = [rng.integers(3, 256, n).tolist() for n in (5, 9, 3, 7)]
            out += check_model(fam, path, prompts, meshes, max_tokens=8)
    report = {"meshes": out}
    if work is not None:
        report["data_parallel"] = data_parallel(work, False, hits)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
