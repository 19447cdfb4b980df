"""The sampling step's variants for an all-greedy batch without logprobs (issue 21), each through
``step.sample_step_padded`` as the engine calls it (no controls, num_logprobs 0, the tokens padded
to ``num_slots``):
  * ``before``: what the engine ran for such a batch before the all-greedy variant: ``general``
    with its greedy tokens from ``jnp.argmax`` (``sampling.argmax_lowest`` swapped for it while
    tracing; the only other change to that path).
  * ``general``: ``sampling.sample`` now (mixed batches): argmax, the random rows' ``lax.cond``
    and a log-softmax over [B, V] for the sampled tokens' logprobs.
  * ``greedy``: ``sampling.sample_greedy``, what an all-greedy batch runs now: an argmax only.

    python scripts/bench_sample_step.py                    # V = 32000, B in 1 8 16 32 64 128
    python scripts/bench_sample_step.py --vocab 512 --rows 1 8 --calls 50   # quick

For each B the variants are measured one after the other (before, general, greedy), in one
process:
  * compile: CPU seconds of the process (``time.process_time``, every thread) for
    ``jax.jit(partial(sample_step_padded, ...)).lower(...)`` (trace + lower) and ``.compile()``,
    a fresh function object per measurement and the persistent compilation cache off, so each
    one traces and compiles; also the wall seconds of the compile.
  * call: ``--calls`` calls of the compiled function on random f32 logits, each waited for
    (``block_until_ready``) after one warm-up call; median wall ms and median process-CPU ms.
The variants' tokens are checked equal (all numpy's argmax). One JSON line on stdout,
appended to ``results/bench_sample_step.jsonl``; load (``os.getloadavg``) before and after.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from benchlib import add_common_args, emit, host_info, log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000, help="V (default: the 110M Llama's)")
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 8, 16, 32, 64, 128],
        help="batch rows B (the engine's sampled-row buckets)",
    )
    ap.add_argument(
        "--num-slots", type=int, default=0, help="padded token slots (default: the largest B)"
    )
    ap.add_argument("--calls", type=int, default=200, help="timed calls per variant and B")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.rows, args.calls = 512, [1, 8], 20

    os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    import jaxinfer.sampling.sampler as sampling
    from jaxinfer.engine.step import sample_step_padded
    from jaxinfer.sampling.sampler import SamplingParams, SamplingTensors

    slots = args.num_slots or max(args.rows)
    load0 = os.getloadavg()
    rows_out = []
    rng = np.random.default_rng(args.seed)
    for b in args.rows:
        logits = jnp.asarray(rng.normal(size=(b, args.vocab)).astype(np.float32))
        st = SamplingTensors.from_params(
            [SamplingParams(temperature=0.0)] * b, [0] * b, [0] * b, pad_to=b
        )
        st = jax.tree.map(jnp.asarray, st)
        row = {"rows": b}
        tokens = {}
        for variant in ("before", "general", "greedy"):
            kw = dict(num_logprobs=0, num_slots=slots)
            if variant == "greedy":  # (absent before the variant existed)
                kw["greedy"] = True
            # a new function object each time: no trace or compile cache entry to hit
            f = jax.jit(functools.partial(sample_step_padded, **kw))
            c0 = time.process_time()
            fast = sampling.argmax_lowest
            if variant == "before":
                sampling.argmax_lowest = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
            try:
                lowered = f.lower(logits, st, None)
            finally:
                sampling.argmax_lowest = fast
            c1, w1 = time.process_time(), time.perf_counter()
            compiled = lowered.compile()
            c2, w2 = time.process_time(), time.perf_counter()
            out = jax.block_until_ready(compiled(logits, st, None))
            tokens[variant] = np.asarray(out[0].tokens)
            wall, cpu = [], []
            for _ in range(args.calls):
                cc, ww = time.process_time(), time.perf_counter()
                jax.block_until_ready(compiled(logits, st, None))
                wall.append(time.perf_counter() - ww)
                cpu.append(time.process_time() - cc)
            row[variant] = {
                "trace_lower_cpu_s": round(c1 - c0, 3),
                "compile_cpu_s": round(c2 - c1, 3),
                "compile_wall_s": round(w2 - w1, 3),
                "call_ms_p50": round(1e3 * statistics.median(wall), 3),
                "call_cpu_ms_p50": round(1e3 * statistics.median(cpu), 3),
            }
        if not all(np.array_equal(t, np.asarray(logits).argmax(-1)) for t in tokens.values()):
            raise SystemExit(f"B={b}: a variant's tokens are not numpy's argmax")
        g, q = row["before"], row["greedy"]
        row["compile_cpu_ratio_before_greedy"] = round(
            g["compile_cpu_s"] / max(q["compile_cpu_s"], 1e-9), 2
        )
        row["call_ratio_before_greedy"] = round(g["call_ms_p50"] / max(q["call_ms_p50"], 1e-9), 2)
        log(
            f"B={b:4d}  compile cpu s "
            + " ".join(f"{v} {row[v]['compile_cpu_s']:.3f}" for v in tokens)
            + "  call ms "
            + " ".join(f"{v} {row[v]['call_ms_p50']:.3f}" for v in tokens)
        )
        rows_out.append(row)
    summary = {
        "bench": "sample_step",
        **host_info(),
        "vocab": args.vocab,
        "num_slots": slots,
        "calls": args.calls,
        "load_before": [round(x, 2) for x in load0],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows_out,
        "compile_cpu_s_total": {
            v: round(sum(r[v]["compile_cpu_s"] for r in rows_out), 3)
            for v in ("before", "general", "greedy")
        },
    }
    emit(summary, "bench_sample_step", args.results_dir)


if __name__ == "__main__":
    main()
