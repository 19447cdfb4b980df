"""Forward-step time of float32 / int8 / w8a8 at every decode batch size and a prefill (issue 21).

    python scripts/bench_quant_batch.py                      # rows 1,4,16,64 decode + 256 prefill
    python scripts/bench_quant_batch.py --batch-sizes 1,64 --prefill 512 --repeats 9
    python scripts/bench_quant_batch.py --modes float32,int8:dot,int8:int_dot2,w8a8:int_dot

The random ~110M Llama (D 768, L 12, 12 heads, F 2048, V 32000, tied LM head: the ``llama110m``
shape), its params prepared as the engine prepares them on CPU: layers unstacked, projections
output-first with q/k/v and gate/up fused (``params.out_in_projections``); ``int8`` / ``w8a8`` as
``LLM(quantization=...)`` quantizes them (layer projections; embedding and LM head stay float).
A mode may force a formulation of ``jaxinfer.quant.matmul`` (``int8:dot``) to compare them.

One step is one jitted ``model.forward`` + ``compute_logits``:
- ``decode B``: B tokens, each its own sequence (attention over itself only: decode attention is
  the same in every mode, so it is left out), logits of all B rows -- the projections of an
  engine decode step of B rows (the engine runs batch 1 as 1 row, 4 / 16 / 64 as such buckets);
- ``prefill T``: one causal sequence of T tokens, logits of its last row.

Every repeat runs each (mode, shape) once, modes alternating, so load drifts hit all modes alike;
the figures are medians (``ms_p50``; also the minimum and the median process CPU time, all
threads, ``cpu_ms_p50``: steadier than wall time on a loaded machine). ``uptime`` load averages
are recorded before and after. Prints one JSON
line and appends it to results/bench_quant_batch.jsonl.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def prepared_params(mode: str, fp):
    """The engine's CPU params for ``mode`` (``float32``, ``int8``, ``w8a8``) from float ``fp``;
    ``int8+unfused`` / ``w8a8+unfused``: the int8 projections left unfused (one dot each, the
    layout before the engine fused q/k/v and gate/up int8 weights); ``+embed``: the (tied)
    embedding / LM head quantized too (``jaxinfer quantize --embed``)."""
    from jaxinfer.models.params import out_in_projections, unstack_layers
    from jaxinfer.quant.tensor import quantize

    name, _, variant = mode.partition("+")
    if variant not in ("", "unfused", "embed"):
        raise SystemExit(f"--modes: unknown variant {variant!r} in {mode!r} (unfused, embed)")
    p = fp if name == "float32" else quantize(fp, name, embed=variant == "embed")
    p = unstack_layers(p)
    return p if variant == "unfused" else out_in_projections(p)


def step_fn(cfg, rows: int, prefill: bool):
    from jaxinfer.models.attention import dense_attn_fn
    from jaxinfer.models.forward import compute_logits, forward

    def step(params, tokens):
        pos = jnp.arange(rows, dtype=jnp.int32) if prefill else jnp.zeros(rows, jnp.int32)
        seg = jnp.zeros(rows, jnp.int32) if prefill else jnp.arange(rows, dtype=jnp.int32)
        h, _ = forward(params, cfg, tokens, pos, None, dense_attn_fn(cfg, seg, pos))
        return compute_logits(params, cfg, h[-1:] if prefill else h)

    return jax.jit(step)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--modes",
        default="float32,int8,w8a8",
        help="comma-separated float32 | int8 | w8a8 (+unfused | +embed), optionally :formulation",
    )
    ap.add_argument("--batch-sizes", default="1,4,16,64", help="decode rows")
    ap.add_argument("--prefill", default="256", help="prefill lengths (tokens); '' for none")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results", default=str(REPO / "results" / "bench_quant_batch.jsonl"))
    args = ap.parse_args()
    for m in args.modes.split(","):
        name, _, variant = m.split(":")[0].partition("+")
        if name not in ("float32", "int8", "w8a8") or variant not in ("", "unfused", "embed"):
            ap.error(
                f"--modes: {m!r} is not float32 | int8 | w8a8 [+unfused | +embed][:formulation]"
            )

    sys.path.insert(0, str(REPO))
    from benchlib import emit  # scripts/ is on sys.path when run as a script

    from jaxinfer.llm import enable_compilation_cache
    from jaxinfer.models.config import ModelConfig
    from jaxinfer.models.params import init_random
    from jaxinfer.quant import matmul as qm

    enable_compilation_cache()
    cfg = ModelConfig("llama", 32000, 768, 2048, 12, 12, 12, 64, tie_word_embeddings=True)
    fp = init_random(cfg, jax.random.PRNGKey(0))
    shapes = [("decode", int(b)) for b in args.batch_sizes.split(",") if b]
    shapes += [("prefill", int(t)) for t in args.prefill.split(",") if t]
    modes = args.modes.split(",")
    base = {}
    for m in modes:
        b = m.split(":")[0]
        if b not in base:
            base[b] = prepared_params(b, fp)
    del fp
    load_before = uptime()
    original = qm.choose_formulation

    def forced(mode):
        form = mode.split(":")[1] if ":" in mode else None
        return (lambda act, r, backend=None: form) if form else original

    fns, times = {}, {}
    t_compile = time.perf_counter()
    try:
        for kind, n in shapes:
            for m in modes:
                qm.choose_formulation = forced(m)
                f = step_fn(cfg, n, kind == "prefill")
                tokens = jnp.arange(n, dtype=jnp.int32) % 500 + 3
                # Each (mode, shape) its own compiled executable (the formulation is chosen at
                # trace time, so compile now, while its choose_formulation is in place).
                c = f.lower(base[m.split(":")[0]], tokens).compile()
                jax.block_until_ready(c(base[m.split(":")[0]], tokens))
                fns[(m, kind, n)] = (c, tokens)
                times[(m, kind, n)] = []
                print(f"compiled {m} {kind} {n}", file=sys.stderr, flush=True)
    finally:
        qm.choose_formulation = original
    compile_s = time.perf_counter() - t_compile
    for rep in range(args.repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        for kind, n in shapes:
            for m in order:
                c, tokens = fns[(m, kind, n)]
                p = base[m.split(":")[0]]
                t, tc = time.perf_counter(), time.process_time()
                jax.block_until_ready(c(p, tokens))
                times[(m, kind, n)].append((time.perf_counter() - t, time.process_time() - tc))
    load_after = uptime()
    table = {}
    for (m, kind, n), tt in times.items():
        ts, cs = np.asarray(tt).T * 1e3
        ms = float(np.median(ts))
        row = table.setdefault(f"{kind}{n}", {})
        row[m] = {
            "ms_p50": round(ms, 2),
            "ms_min": round(float(ts.min()), 2),
            "cpu_ms_p50": round(float(np.median(cs)), 2),
            "tok_s": round(n / ms * 1e3, 1),
        }
    for row in table.values():
        f32 = row.get("float32")
        for m, r in row.items():
            if f32 and m != "float32":
                r["speedup_vs_f32"] = round(f32["ms_p50"] / r["ms_p50"], 3)
                r["cpu_speedup_vs_f32"] = round(f32["cpu_ms_p50"] / r["cpu_ms_p50"], 3)
    res = {
        "bench": "quant_batch",
        "backend": jax.default_backend(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "git": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "repeats": args.repeats,
        "compile_s": round(compile_s, 1),
        "uptime_before": load_before,
        "uptime_after": load_after,
        "cpus": os.cpu_count(),
        "steps": table,
    }
    emit(res, Path(args.results).stem, Path(args.results).parent)


if __name__ == "__main__":
    main()
