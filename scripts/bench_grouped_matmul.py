"""Grouped matmul on CPU: XLA's ``jax.lax.ragged_dot`` (what ``kernels_pallas.grouped_matmul.gmm``
runs with ``backend="auto"`` on CPU) against two plain-XLA formulations of a mixture-of-experts
expert matmul. One JSON line on stdout.

    python scripts/bench_grouped_matmul.py                 # Qwen3-MoE-like shape, f32
    python scripts/bench_grouped_matmul.py --dtype bfloat16 --repeats 3
    python scripts/bench_grouped_matmul.py --quick         # tiny shape, seconds

Shape (defaults, Qwen3-MoE-like, scaled down): hidden size D=1024, 32 experts with MLP width
F=512, top-4 routing; ``--tokens 512,8``: a prefill-sized batch of 512 tokens (T = 512 * 4 = 2048
token copies sorted by expert) and a decode-sized one of 8 tokens (T = 32). The router is random
(Gaussian logits, seeded); ``group_sizes`` are the token copies per expert. Two projections: the
up projection ``[T, D] x [E, D, F]`` and the down projection ``[T, F] x [E, F, D]``.

Formulations (each jitted, outputs checked against ragged_dot's, max abs difference reported):

- ``ragged_dot``: ``jax.lax.ragged_dot(lhs, rhs, group_sizes)``.
- ``gmm_auto``: ``kernels_pallas.grouped_matmul.gmm(..., backend="auto")``, which on CPU is the
  tiled XLA loop (``backend="xla_tiled"``, default tiling; ``auto_backend`` in the JSON).
- ``dense_masked``: every expert on every row (``einsum("TD,EDF->TEF")``, E times the useful
  FLOPs), then each row's own expert selected.
- ``gather``: each row's expert matrix gathered (``rhs[group_of_row]``) and a batched
  matrix-vector product, in chunks of ``--gather-chunk`` rows (the whole ``[T, D, F]`` gather
  would be 4 GiB in f32).

Per formulation: wall ms per call (median and min over ``--repeats`` calls after one warm-up
call), the process's CPU ms per call (median; all threads, steadier than wall on a shared
machine), the 1-minute load average when it started (``time_call``, shared with
``bench_moe.py``), and GFLOP/s of useful work (``2 * T * D * F``) at the median wall time. Host:
the CPU model (/proc/cpuinfo), the commit, the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    def git(*a):
        return subprocess.run(
            ["git", "-C", str(REPO), *a], capture_output=True, text=True
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def time_call(fn, *args, repeats: int, budget_s: float | None = None) -> dict:
    """Times ``fn(*args)`` (a jitted function): one untimed warm-up call (compilation), then
    ``repeats`` calls, each waited for with ``block_until_ready`` (at least 3 calls, fewer than
    ``repeats`` once ``budget_s`` seconds of timed calls have passed). Returns wall ms median and
    min, the process's CPU ms per call (median, all threads: steadier than wall on a shared
    machine), the calls timed and the 1-minute load average at the start."""
    import jax

    jax.block_until_ready(fn(*args))
    load1, times, cpu, spent = os.getloadavg()[0], [], [], 0.0
    for i in range(repeats):
        if budget_s is not None and i >= 3 and spent > budget_s:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        spent += times[-1]
    return {
        "ms_median": round(float(np.median(times)) * 1e3, 3),
        "ms_min": round(min(times) * 1e3, 3),
        "cpu_ms_median": round(float(np.median(cpu)) * 1e3, 3),
        "calls": len(times),
        "load1": round(load1, 2),
    }


@functools.cache
def _shared_formulations() -> dict:
    """The formulations that do not depend on ``--gather-chunk``, jitted once per process: a
    second script run in the same process (bench_moe after this one, as tests/test_benchmarks.py
    does) reuses their compiled shapes."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.grouped_matmul import gmm

    def ragged_dot(lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    def dense_masked(lhs, rhs, group_sizes):
        every = jnp.einsum("TD,EDF->TEF", lhs, rhs)  # every expert on every row
        g = group_of_row(group_sizes, lhs.shape[0])
        return jnp.take_along_axis(every, g[:, None, None], axis=1)[:, 0]

    def gmm_auto(lhs, rhs, group_sizes):
        return gmm(lhs, rhs, group_sizes, backend="auto")

    return {
        "ragged_dot": jax.jit(ragged_dot),
        "gmm_auto": jax.jit(gmm_auto),
        "dense_masked": jax.jit(dense_masked),
    }


def group_of_row(group_sizes, t):
    import jax.numpy as jnp

    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(t), side="right").clip(0, group_sizes.shape[0] - 1)


def formulations(gather_chunk: int):
    import jax
    import jax.numpy as jnp

    def gather(lhs, rhs, group_sizes):
        t, d = lhs.shape
        g = group_of_row(group_sizes, t)
        c = math.gcd(gather_chunk, t)

        def chunk(args):
            x, gi = args
            return jnp.einsum("TD,TDF->TF", x, rhs[gi])

        out = jax.lax.map(chunk, (lhs.reshape(t // c, c, d), g.reshape(t // c, c)))
        return out.reshape(t, -1)

    return {**_shared_formulations(), "gather": jax.jit(gather)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,8", help="comma list of batch sizes in tokens")
    ap.add_argument("--hidden", type=int, default=1024, help="D, the model width")
    ap.add_argument("--moe-intermediate", type=int, default=512, help="F, each expert's MLP width")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=5, help="timed calls (median reported)")
    ap.add_argument("--gather-chunk", type=int, default=64, help="rows per gather step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny shape: a smoke test")
    ap.add_argument(
        "--results-dir",
        default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results")),
        help="where bench_grouped_matmul.jsonl is appended (default: results/ in the repo)",
    )
    args = ap.parse_args()
    if args.quick:  # D = F = 64, E = 8, top-2 of 8 and 1 tokens: bench_moe --quick's gate/up shapes
        args.tokens, args.hidden, args.moe_intermediate, args.experts = "8,1", 64, 64, 8
        args.repeats, args.gather_chunk, args.top_k = 2, 16, 2

    import jax
    import jax.numpy as jnp

    from kernels_pallas.grouped_matmul import resolve_backend

    load_before = loadavg()
    rng = np.random.default_rng(args.seed)
    d, f, e, k = args.hidden, args.moe_intermediate, args.experts, args.top_k
    dtype = jnp.dtype(args.dtype)
    w_up = jnp.asarray(rng.standard_normal((e, d, f)) / np.sqrt(d), dtype)
    w_down = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), dtype)
    fns = formulations(args.gather_chunk)
    results, sizes_seen = {}, {}
    for n in [int(v) for v in args.tokens.split(",")]:
        t = n * k
        logits = rng.standard_normal((n, e))
        chosen = np.argsort(-logits, axis=1)[:, :k].reshape(-1)  # expert of each token copy
        group_sizes = np.bincount(chosen, minlength=e).astype(np.int32)
        sizes_seen[f"tokens{n}"] = dict(
            rows=t,
            min=int(group_sizes.min()),
            max=int(group_sizes.max()),
            empty=int((group_sizes == 0).sum()),
        )
        x = jnp.asarray(rng.standard_normal((t, d)) / np.sqrt(d), dtype)
        h = jnp.asarray(rng.standard_normal((t, f)) / np.sqrt(f), dtype)
        gs = jnp.asarray(group_sizes)
        for proj, lhs, rhs in (("up", x, w_up), ("down", h, w_down)):
            key = f"tokens{n}/{proj}"
            want = np.asarray(fns["ragged_dot"](lhs, rhs, gs).astype(jnp.float32))
            useful = 2 * t * lhs.shape[1] * rhs.shape[2]
            for name, fn in fns.items():
                out = fn(lhs, rhs, gs)
                r = results[f"{key}/{name}"] = time_call(fn, lhs, rhs, gs, repeats=args.repeats)
                r["useful_gflop_s"] = round(useful / r["ms_median"] / 1e6, 2)
                r["max_abs_diff_vs_ragged_dot"] = float(
                    np.abs(np.asarray(out.astype(jnp.float32)) - want).max()
                )
                print(f"{key}/{name}: {r}", file=sys.stderr, flush=True)
            base = results[f"{key}/ragged_dot"]["ms_median"]
            for name in fns:
                r = results[f"{key}/{name}"]
                r["x_ragged_dot"] = round(r["ms_median"] / base, 3)
    summary = {
        "script": "bench_grouped_matmul",
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "commit": commit(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "shape": dict(hidden=d, moe_intermediate=f, experts=e, top_k=k),
        "group_sizes": sizes_seen,
        "auto_backend": resolve_backend("auto"),
        "quick": args.quick,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "results": results,
    }
    from benchlib import emit

    emit(summary, "bench_grouped_matmul", args.results_dir)


if __name__ == "__main__":
    main()
