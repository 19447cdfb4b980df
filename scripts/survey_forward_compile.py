"""Per-key compile cost and run time of the engine's forward step under XLA CPU compile options
and layer-loop forms, each configuration in a fresh subprocess.

    python scripts/survey_forward_compile.py                               # default grid
    python scripts/survey_forward_compile.py --configs base,opt0 --loops unrolled,scan
    python scripts/survey_forward_compile.py --keys 0,512,8,32 --keys 64,0,0,32 --repeats 5

For each (layer loop, compiler options) configuration a child process loads ``--model``
(default ``benchlib``'s random llama110m, float32) into an ``LLM`` engine with the persistent
compilation cache off, and for each forward key ``(Td, Tp, Bp, M)`` lowers the engine's jitted
forward (``ModelRunner.lower``: the program depends on the shapes only) and compiles it with
``Lowered.compile(compiler_options=...)`` (per-jit XLA debug options, no ``XLA_FLAGS``). It
records the compile's CPU seconds (``time.process_time``: the machine is shared, wall is noisy)
and wall seconds, then calls the compiled step ``--repeats`` times (after one warm call) and
records the median wall and CPU milliseconds a call, on a step batch of live rows
(``live_step_batch``). One JSON line per configuration on stdout
and in ``results/survey_forward_compile.jsonl``; a table on stderr.

Layer loops: ``unrolled`` (``unroll_layers=True``, ``scan_layers_from_tokens=0``), ``scan``
(``unroll_layers=False``: stacked weights) and ``switch`` (unrolled weights with
``scan_layers_from_tokens=1``: every step a scan picking each layer's buffers by ``lax.switch``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchlib import REPO, emit, host_info, log, resolve_model

# name -> per-jit compiler options (XLA DebugOptions fields). jax 0.10.2's XLA CPU refuses
# xla_cpu_optimize_for_size and xla_cpu_disable_loop_unrolling as compile options.
CONFIGS = {
    "base": {},
    "opt0": {"xla_backend_optimization_level": 0},
    "opt1": {"xla_backend_optimization_level": 1},
    "noexp": {"xla_llvm_disable_expensive_passes": True},
    "opt1_noexp": {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True},
    "split1": {"xla_cpu_parallel_codegen_split_count": 1},
    "nounroll": {"xla_cpu_disable_loop_unrolling": True},
    "noslp": {"xla_cpu_disable_slp_vectorizer": True},
    "size": {"xla_cpu_optimize_for_size": True},
    "nofusemit": {"xla_cpu_use_fusion_emitters": False},
}
DEFAULT_KEYS = ((0, 512, 8, 32), (16, 512, 8, 32), (64, 0, 0, 32), (8, 0, 0, 64))


def live_step_batch(key: tuple[int, int, int, int], page_size: int):
    """A numpy StepBatch of bucket ``key`` = (Td, Tp, Bp, M) with live rows (unlike
    ``batch.dummy_step_batch``'s all-padding one, so the attention reads real pages): Td
    decode rows each 3/4 of its M-page table long, then Bp prefill rows sharing the Tp tokens
    as fresh prompts; every row owns its own pages (1, 2, ...)."""
    import numpy as np

    from jaxinfer.engine.batch import sample_rows
    from jaxinfer.engine.step import StepBatch
    from jaxinfer.models.paged_attention import AttentionMetadata

    td, tp, bp, m = key
    q_lens = [1] * td + ([tp // bp] * (bp - 1) + [tp - (tp // bp) * (bp - 1)] if bp else [])
    kv_lens = [max(1, m * page_size * 3 // 4)] * td + q_lens[td:]
    if max(kv_lens) > m * page_size:
        raise ValueError(f"key {key}: a prefill chunk of {max(kv_lens)} tokens exceeds {m} pages")
    tables = np.arange(1, 1 + len(q_lens) * m, dtype=np.int32).reshape(len(q_lens), m)
    pos, slots, seq = [], [], []
    for r, (q, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for p in range(kl - q, kl):
            pos.append(p)
            slots.append(int(tables[r, p // page_size]) * page_size + p % page_size)
            seq.append(r)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        positions=np.asarray(pos, np.int32),
        slot_mapping=np.asarray(slots, np.int32),
        block_tables=tables,
        kv_lens=np.asarray(kv_lens, np.int32),
        cu_q_lens=cu,
        seq_ids=np.asarray(seq, np.int32),
        num_decode=td,
    )
    li = np.zeros(sample_rows(td, bp), np.int32)
    li[: len(q_lens)] = cu[1:] - 1
    return StepBatch(tokens=np.arange(td + tp, dtype=np.int32) % 500 + 3, md=md, logits_indices=li)


def child(spec: dict) -> dict:
    """Runs one configuration in this process; returns its record."""
    os.environ["JAXINFER_COMPILATION_CACHE"] = "0"
    import jax

    from jaxinfer import LLM

    t0 = time.perf_counter()
    kw = dict(
        max_model_len=spec["max_model_len"], compilation_cache=False, skip_tokenizer_init=True
    )
    from jaxinfer.engine.runner import ModelRunner

    scan_from = {"switch": 1, "unrolled": 0}.get(spec["loop"])  # unrolled: every step unrolled
    kw["unroll_layers"] = spec["loop"] != "scan"  # switch: unrolled storage, every step a scan
    if scan_from is not None:
        orig_init = ModelRunner.__init__

        def init(self, cfg, params, ecfg, *a, **k):
            import dataclasses

            ecfg = dataclasses.replace(ecfg, scan_layers_from_tokens=scan_from)
            orig_init(self, cfg, params, ecfg, *a, **k)

        ModelRunner.__init__ = init
    llm = LLM(spec["model"], **kw)
    runner = llm.engine.runner
    load_s = time.perf_counter() - t0
    no_prev = jax.numpy.zeros(runner.num_slots, jax.numpy.int32)
    rows = []
    for key in spec["keys"]:
        key = tuple(key)
        batch = live_step_batch(key, runner.ecfg.page_size)
        c0 = time.process_time()
        lowered = runner.lower(("forward", key))
        c1, w1 = time.process_time(), time.perf_counter()
        compiled = lowered.compile(compiler_options=spec["options"] or None)
        c2, w2 = time.process_time(), time.perf_counter()
        walls, cpus = [], []
        for i in range(spec["repeats"] + 1):
            a, b = time.process_time(), time.perf_counter()
            runner.kv, logits = compiled(runner.params, runner.kv, batch, no_prev)
            jax.block_until_ready(logits)
            if i:  # the first call is a warm-up
                walls.append(time.perf_counter() - b)
                cpus.append(time.process_time() - a)
        rows.append(
            dict(
                key=list(key),
                trace_lower_cpu_s=round(c1 - c0, 3),
                compile_cpu_s=round(c2 - c1, 3),
                compile_wall_s=round(w2 - w1, 3),
                run_ms=round(1e3 * statistics.median(walls), 2),
                run_cpu_ms=round(1e3 * statistics.median(cpus), 2),
            )
        )
    return dict(load_s=round(load_s, 2), rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama110m")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument(
        "--configs",
        default="base,opt0,opt1,noexp",
        help=f"comma-separated names of {sorted(CONFIGS)}",
    )
    ap.add_argument("--loops", default="unrolled", help="comma-separated: unrolled, scan, switch")
    ap.add_argument("--keys", action="append", default=None, metavar="TD,TP,BP,M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--results-dir", default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results"))
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    keys = [tuple(int(x) for x in k.split(",")) for k in args.keys] if args.keys else DEFAULT_KEYS
    for k in keys:
        if len(k) != 4:
            ap.error(f"--keys {k}: expected TD,TP,BP,M")
    model = str(resolve_model(args.model)[0])
    for loop in args.loops.split(","):
        if loop not in ("unrolled", "scan", "switch"):
            ap.error(f"--loops: unknown {loop!r}")
        for name in args.configs.split(","):
            if name not in CONFIGS:
                ap.error(f"--configs: unknown {name!r}; known: {sorted(CONFIGS)}")
            spec = dict(
                model=model,
                max_model_len=args.max_model_len,
                loop=loop,
                options=CONFIGS[name],
                keys=keys,
                repeats=args.repeats,
            )
            load0 = os.getloadavg()[0]
            out = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
            )
            if out.returncode:
                log(f"{loop}/{name}: child failed:\n{out.stderr[-3000:]}")
                continue
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            rec.update(
                loop=loop,
                config=name,
                options=CONFIGS[name],
                load_before=load0,
                load_after=os.getloadavg()[0],
                host=host_info(),
            )
            for r in rec["rows"]:
                log(
                    f"{loop:8s} {name:10s} {str(tuple(r['key'])):18s} compile cpu "
                    f"{r['compile_cpu_s']:6.2f} s wall {r['compile_wall_s']:6.2f} s | run "
                    f"{r['run_ms']:8.1f} ms (cpu {r['run_cpu_ms']:8.1f})"
                )
            log(f"  load {load0:.1f} -> {rec['load_after']:.1f}")
            emit(rec, "survey_forward_compile", args.results_dir)


if __name__ == "__main__":
    main()
