"""The mixture-of-experts layer on CPU: its time against a dense MLP of the same active FLOPs, and
its grouped matmul against a dense masked formulation. One JSON line on stdout.

    python scripts/bench_moe.py                        # qwen3moe1b's layer, T = 1, 8, 64, 512
    python scripts/bench_moe.py --shape qwen3moe250m --tokens 1,64
    python scripts/bench_moe.py --quick                # tiny layer, seconds (a smoke test)

Shape: one layer of a random checkpoint of ``moe_models.RANDOM_QWEN3_MOES`` (default
``qwen3moe1b``: hidden D = 1024, E = 64 experts of width I = 256, top-A = 8, ``norm_topk_prob``),
float32, weights drawn as ``moe_models.redraw`` draws them (router normal(0, 2/sqrt(D)):
decisive routing, experts used about evenly). Tokens: T normal(0, 1) rows (a normed residual
stream), seeded.

(a) ``layer``: the engine's MLP dispatch ``jaxinfer.models.forward.mlp`` (what every layer of the
forward calls), jitted, on T tokens:

- ``moe``: the sparse layer (``moe.moe_mlp``, grouped matmul ``impl="auto"``): router, top-k,
  (token, expert) pairs sorted by expert, the gate/up and down grouped matmuls, unsort and
  weighted combine.
- ``dense``: a dense SwiGLU MLP of width F = A * I (2048 for qwen3moe1b), the same FLOPs per
  token as the A experts a token runs (6 * D * A * I; the router's 2 * D * E, 1 %, comes on top),
  in the layout the engine uses on CPU (``params.out_in_projections``: gate and up fused,
  output-first).
- ``dense_input_first``: the same dense MLP with input-first weights (three plain einsums).
- ``route``: the router and top-k alone (``moe.route``), the part of ``moe`` before the experts.

``moe_over_dense`` = moe / dense, median wall times (the issue's aim: at most 1.5).

(b) ``grouped_matmul``: the gate/up projection ``[T*A, D] x [E, D, 2I]`` and the down projection
``[T*A, I] x [E, I, D]`` on the rows of the routing in (a) (group sizes = the router's expert
counts), with the formulations of ``bench_grouped_matmul.formulations``: ``gmm_auto`` (what the
engine runs: on CPU the tiled XLA loop), ``ragged_dot`` (``jax.lax.ragged_dot``, which XLA:CPU
expands into a dense matmul over every expert) and ``dense_masked`` (every expert on every row,
E times the useful FLOPs, then each row's own expert selected); and the Pallas TPU kernel
(``backend="tpu"``, interpreted) on the first ``--pallas-tokens`` sizes only: interpret mode runs
the kernel's grid step by step in Python and says nothing about its speed on a TPU, it is only a
check here that the kernel runs on these shapes (wall times given for completeness). ``x_gmm_auto``
= a formulation's median over gmm_auto's.

Every figure: wall ms per call (median and min after one warm-up call; ``--repeats`` calls, at
least 3, fewer once ``--budget`` seconds are spent), the process's CPU ms per call, the 1-minute
load average when it started (``bench_grouped_matmul.time_call``). Ratios come from one run,
measured minutes apart on the same machine. Host: CPU model (/proc/cpuinfo), commit, load
averages before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_grouped_matmul import commit, cpu_name, formulations, loadavg, time_call  # noqa: E402
from moe_models import RANDOM_QWEN3_MOES, ROUTER_SPREAD  # noqa: E402

GMM_FORMULATIONS = ("gmm_auto", "ragged_dot", "dense_masked")


def layer_setup(spec: dict, rng: np.random.Generator):
    """(moe config, moe layer params, dense config, dense params in the engine's CPU layout,
    dense params input-first) of one layer of ``spec``, float32."""
    import jax.numpy as jnp

    from jaxinfer.models.config import ModelConfig
    from jaxinfer.models.params import LayerParams, Params, out_in_projections

    d, e, a, i = spec["D"], spec["E"], spec["A"], spec["I"]
    f = a * i
    common = dict(
        model_type="qwen3_moe",
        vocab_size=spec["V"],
        hidden_size=d,
        num_layers=1,
        num_heads=spec["N"],
        num_kv_heads=spec["K"],
        head_dim=spec["H"],
    )
    moe_cfg = ModelConfig(
        **common,
        intermediate_size=f,
        num_experts=e,
        num_experts_per_tok=a,
        moe_intermediate_size=i,
        norm_topk_prob=True,
    )
    dense_cfg = ModelConfig(**common, intermediate_size=f)

    def w(*shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(fan_in))

    none = dict(attn_norm=None, wq=None, wk=None, wv=None, wo=None, mlp_norm=None)
    moe_lp = LayerParams(
        **none,
        w_gate=None,
        w_up=None,
        w_down=None,
        router=jnp.asarray(rng.standard_normal((d, e), np.float32) * ROUTER_SPREAD / np.sqrt(d)),
        expert_gate_up=w(e, d, 2 * i, fan_in=d),
        expert_down=w(e, i, d, fan_in=i),
    )
    dense_lp = LayerParams(
        **none, w_gate=w(d, f, fan_in=d), w_up=w(d, f, fan_in=d), w_down=w(f, d, fan_in=f)
    )
    one = Params(embed=None, layers=(dense_lp,), final_norm=None)
    dense_engine = out_in_projections(one).layers[0]  # gate/up fused, output-first
    return moe_cfg, moe_lp, dense_cfg, dense_engine, dense_lp


def bench_layer(spec, tokens, args, rng) -> tuple[dict, dict]:
    """(a) per T, and the routing of each T for (b): {T: (weights, experts, h)}."""
    import jax

    from jaxinfer.models.forward import mlp
    from jaxinfer.models.moe import route

    moe_cfg, moe_lp, dense_cfg, dense_engine, dense_lp = layer_setup(spec, rng)
    fns = {
        "moe": jax.jit(lambda lp, h: mlp(moe_cfg, lp, h, None)),
        "dense": jax.jit(lambda lp, h: mlp(dense_cfg, lp, h, None)),
        "dense_input_first": jax.jit(lambda lp, h: mlp(dense_cfg, lp, h, None)),
        "route": jax.jit(lambda lp, h: route(moe_cfg, lp.router, None, h)),
    }
    params = {"moe": moe_lp, "dense": dense_engine, "dense_input_first": dense_lp, "route": moe_lp}
    d, a, i, e = spec["D"], spec["A"], spec["I"], spec["E"]
    out, routing = {}, {}
    for t in tokens:
        h = jax.numpy.asarray(rng.standard_normal((t, d), np.float32))
        row = {"tokens": t}
        for name, fn in fns.items():
            row[name] = time_call(fn, params[name], h, repeats=args.repeats, budget_s=args.budget)
            log(f"layer T={t} {name}: {row[name]}")
        weights, experts = fns["route"](moe_lp, h)
        counts = np.bincount(np.asarray(experts).reshape(-1), minlength=e)
        row["experts_used"] = int((counts > 0).sum())
        row["max_rows_per_expert"] = int(counts.max())
        row["moe_over_dense"] = round(row["moe"]["ms_median"] / row["dense"]["ms_median"], 3)
        row["moe_over_dense_cpu"] = round(
            row["moe"]["cpu_ms_median"] / row["dense"]["cpu_ms_median"], 3
        )
        row["flops"] = {"moe": t * (6 * d * a * i + 2 * d * e), "dense": t * 6 * d * a * i}
        out[f"T{t}"] = row
        routing[t] = (np.asarray(experts), np.asarray(h))
    return out, {"moe_lp": moe_lp, "routing": routing}


def bench_gmm(spec, state, args) -> dict:
    """(b): the grouped matmul's formulations on the rows of each T's routing."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.grouped_matmul import gmm

    fns = {k: v for k, v in formulations(64).items() if k in GMM_FORMULATIONS}
    pallas = jax.jit(
        lambda lhs, rhs, gs: gmm(lhs, rhs, gs, backend="tpu", interpret=True),
    )
    lp, e, a = state["moe_lp"], spec["E"], spec["A"]
    out = {}
    for n, (t, (experts, h)) in enumerate(state["routing"].items()):
        pallas_ok = n < args.pallas_tokens
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        gs = jnp.asarray(np.bincount(flat, minlength=e).astype(np.int32))
        rows = jnp.asarray(h[order // a])  # [T*A, D] sorted by expert
        hidden = jnp.asarray(
            np.random.default_rng(n).standard_normal((t * a, spec["I"]), np.float32)
        )
        for proj, lhs, rhs in (
            ("gate_up", rows, lp.expert_gate_up),
            ("down", hidden, lp.expert_down),
        ):
            want = np.asarray(fns["gmm_auto"](lhs, rhs, gs))
            row = {}
            cases = dict(fns, pallas_tpu_interpret=pallas) if pallas_ok else fns
            for name, fn in cases.items():
                row[name] = time_call(fn, lhs, rhs, gs, repeats=args.repeats, budget_s=args.budget)
                got = np.asarray(fn(lhs, rhs, gs))
                row[name]["max_abs_diff_vs_gmm_auto"] = float(np.abs(got - want).max())
                log(f"gmm T={t} {proj} {name}: {row[name]}")
            base = row["gmm_auto"]["ms_median"]
            for name in cases:
                row[name]["x_gmm_auto"] = round(row[name]["ms_median"] / base, 3)
            if not pallas_ok:
                row["pallas_tpu_interpret"] = {
                    "skipped": f"interpret mode on CPU: run only for the first {args.pallas_tokens}"
                    " token counts (--pallas-tokens)"
                }
            out[f"T{t}/{proj}"] = {
                "rows": t * a,
                "useful_flops": 2 * t * a * lhs.shape[1] * rhs.shape[2],
                **row,
            }
    return out


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3moe1b", choices=sorted(RANDOM_QWEN3_MOES))
    ap.add_argument("--tokens", default="1,8,64,512", help="comma list of token counts T")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls at most (median)")
    ap.add_argument(
        "--budget", type=float, default=5.0, help="seconds of timed calls per figure (>= 3 calls)"
    )
    ap.add_argument(
        "--pallas-tokens",
        type=int,
        default=2,
        help="run the interpreted Pallas kernel for this many of the first token counts",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny layer: a smoke test")
    ap.add_argument(
        "--results-dir",
        default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results")),
        help="where bench_moe.jsonl is appended (default: results/ in the repo)",
    )
    args = ap.parse_args()
    if args.quick:
        args.shape, args.tokens, args.repeats, args.budget = "qwen3moe_tiny", "1,8", 3, 1.0

    import jax

    from kernels_pallas.grouped_matmul import resolve_backend

    load_before, started = loadavg(), time.strftime("%Y-%m-%dT%H:%M:%S")
    spec = RANDOM_QWEN3_MOES[args.shape]
    tokens = [int(v) for v in args.tokens.split(",")]
    rng = np.random.default_rng(args.seed)
    layer, state = bench_layer(spec, tokens, args, rng)
    load_mid = loadavg()
    grouped = bench_gmm(spec, state, args)
    summary = {
        "script": "bench_moe",
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "commit": commit(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "started": started,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": args.quick,
        "shape": {
            "name": args.shape,
            **{k: spec[k] for k in "DEAI"},
            "dense_F": spec["A"] * spec["I"],
        },
        "dtype": "float32",
        "auto_backend": resolve_backend("auto"),
        "repeats": args.repeats,
        "budget_s": args.budget,
        "loadavg_before": load_before,
        "loadavg_between": load_mid,
        "loadavg_after": loadavg(),
        "layer": layer,
        "grouped_matmul": grouped,
        "aim_moe_over_dense": 1.5,
    }
    from benchlib import emit

    emit(summary, "bench_moe", args.results_dir)


if __name__ == "__main__":
    main()
