"""Where a cold start's time goes: every XLA compilation of one ``jaxinfer generate`` job, per
compiled function and shape, with the persistent compilation cache off.

    python scripts/profile_compile.py                          # the README's demo (8 prompts)
    python scripts/profile_compile.py --job llama110m --num-prompts 16 --mean-output 32
    python scripts/profile_compile.py --unroll-layers 0        # layers as a lax.scan
    python scripts/profile_compile.py --scan-from-tokens 32    # steps of >= 32 tokens as a scan

The job runs in this process through ``jaxinfer.cli.main.main`` (``generate``, greedy) with
``JAXINFER_COMPILATION_CACHE=0``, so every compilation is done (``--persistent-cache DIR``
keeps the cache on instead, for a warm rerun). ``demo`` is the README's main
command (stories260K, ``examples/prompts.jsonl``); ``llama110m`` is ``benchlib``'s random ~110M
Llama on ``benchlib.make_workload`` prompts (token ids, ``ignore_eos``).

Compile times come from ``jax.monitoring``'s duration events, which carry the jitted function's
name: ``jaxpr_trace_duration`` (tracing), ``jaxpr_to_mlir_module_duration`` (lowering) and
``backend_compile_duration`` (XLA). Each is attributed to the compile key
(``ModelRunner.compile_keys``) that the step being dispatched (``ModelRunner.run``) added:
``("forward", (Td, Tp, Bp, M))`` buckets and ``("sample", rows, controls, logprobs)`` variants;
anything else is ``other:<function>``. After the job, each such key is lowered again through the
runner's public compile API (``ModelRunner.lower``, not timed in the job) for its StableHLO size
(characters and op lines of ``as_text()``).

Reported: total wall from process start, time to the first token from process start (the first
step whose tokens are read back), compilations and their seconds, and the table (stderr) sorted
by compile seconds. One JSON line on stdout, appended to ``results/profile_compile.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def process_start_epoch() -> float:
    """When this process started (Linux: /proc), as time.time() seconds; now if unknown."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat, counted after the ")" of comm
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


T0 = process_start_epoch()

from benchlib import REPO, emit, host_info, log, make_workload, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--job", choices=("demo", "llama110m"), default="demo")
    ap.add_argument("--num-prompts", type=int, default=16, help="llama110m job only")
    ap.add_argument("--mean-input", type=float, default=64.0, help="llama110m job only")
    ap.add_argument("--mean-output", type=float, default=32.0, help="llama110m job only")
    ap.add_argument("--max-model-len", type=int, default=512, help="llama110m job only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--unroll-layers",
        choices=("auto", "0", "1"),
        default="auto",
        help="EngineConfig.unroll_layers (auto: the engine's default, on for CPU)",
    )
    ap.add_argument(
        "--scan-from-tokens",
        type=int,
        default=None,
        metavar="N",
        help="EngineConfig.scan_layers_from_tokens (default: the engine's; 0 = "
        "never: every step unrolled when the layers are)",
    )
    ap.add_argument(
        "--reuse-steps",
        type=int,
        default=None,
        help="bucket_reuse.REUSE_STEPS for the job (default: the engine's)",
    )
    ap.add_argument(
        "--no-bucket-reuse",
        action="store_true",
        help="never pad a step up to a compiled bucket (as reuse_compiled_buckets=False)",
    )
    ap.add_argument("--no-hlo", action="store_true", help="skip the HLO sizes")
    ap.add_argument(
        "--persistent-cache",
        metavar="DIR",
        default=None,
        help="keep JAX's persistent compilation cache on, in DIR (run twice for a "
        "warm run: its steady state without compilations)",
    )
    ap.add_argument(
        "--cli-args",
        default="",
        help="more `jaxinfer generate` flags, e.g. '--no-async-scheduling'",
    )
    ap.add_argument(
        "--results-dir", default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results"))
    )
    args = ap.parse_args()

    # Resolve the model first (its build cache lives under JAXINFER_CACHE_DIR), then turn the
    # persistent compilation cache off for the job.
    if args.job == "demo":
        path, vocab, _ = resolve_model("stories260K")
    else:
        path, vocab, _ = resolve_model("llama110m")
    if args.persistent_cache is None:
        os.environ["JAXINFER_COMPILATION_CACHE"] = "0"
    else:
        os.environ["JAXINFER_CACHE_DIR"] = args.persistent_cache

    from jax import monitoring

    from jaxinfer.cli import main as cli
    from jaxinfer.compile import buckets as bucket_reuse

    if args.reuse_steps is not None:
        bucket_reuse.REUSE_STEPS = args.reuse_steps
    if args.no_bucket_reuse:
        bucket_reuse.choose_buckets = lambda need, compiled, flags: need
    from jaxinfer.engine.core import EngineCore
    from jaxinfer.engine.runner import ModelRunner

    t_imports = time.time() - T0
    state = {"runner": None, "snap": set(), "on": True, "first_token": None}
    rows: dict[str, dict] = {}
    keys: dict[str, tuple] = {}  # label -> the compile key it names
    kinds = {
        "/jax/core/compile/jaxpr_trace_duration": "trace_s",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
        "/jax/core/compile/backend_compile_duration": "compile_s",
    }
    fun_kind = {
        "forward_step": "forward",
        "sample_step_padded": "sample",
        "forward_step_prompt_logprobs": "forward_prompt_logprobs",
    }

    def label_of(fun_name: str) -> str:
        if fun_name.startswith("jit(") and fun_name.endswith(")"):  # lower/compile events' name
            fun_name = fun_name[4:-1]
        runner, kind = state["runner"], fun_kind.get(fun_name)
        if runner is not None and kind is not None:
            new = [k for k in runner.compile_keys - state["snap"] if k[0] == kind]
            if new:
                keys[repr(new[0])] = new[0]
                return repr(new[0])
            return f"{kind} (key already seen)"
        return f"other:{fun_name}"

    def on_duration(event, duration, **kw):
        if not state["on"] or event not in kinds:
            return
        lab = label_of(kw.get("fun_name", "?"))
        r = rows.setdefault(
            lab,
            {
                "key": lab,
                "trace_s": 0.0,
                "lower_s": 0.0,
                "compile_s": 0.0,
                "compiles": 0,
                "first_at_s": round(time.time() - T0, 2),
            },
        )
        r[kinds[event]] += duration
        r["compiles"] += event == "/jax/core/compile/backend_compile_duration"

    monitoring.register_event_duration_secs_listener(on_duration)

    # Hooks on public methods: the key snapshot before each dispatch (``ModelRunner.run``); the
    # first step that returns outputs (its tokens were read back: the first token).
    orig_run, orig_step = ModelRunner.run, EngineCore.step
    unroll = None if args.unroll_layers == "auto" else args.unroll_layers == "1"

    def run(self, *a, **kw):
        state["runner"] = self
        state["snap"] = set(self.compile_keys)
        return orig_run(self, *a, **kw)

    def step(self):
        out = orig_step(self)
        real = isinstance(self.runner, ModelRunner)  # not the job plan's core (a stub runner)
        if out and real and state["first_token"] is None:
            state["first_token"] = time.time() - T0
        return out

    ModelRunner.run, EngineCore.step = run, step
    if unroll is not None or args.scan_from_tokens is not None:
        orig_init = ModelRunner.__init__
        layer_kw = {
            k: v
            for k, v in (
                ("unroll_layers", unroll),
                ("scan_layers_from_tokens", args.scan_from_tokens),
            )
            if v is not None
        }

        def init(self, cfg, params, ecfg, *a, **kw):
            import dataclasses

            orig_init(self, cfg, params, dataclasses.replace(ecfg, **layer_kw), *a, **kw)

        ModelRunner.__init__ = init

    tmp = Path(tempfile.mkdtemp(prefix="profile_compile_"))
    if args.job == "demo":
        prompts = REPO / "examples" / "prompts.jsonl"
        argv = [
            "generate",
            "--model",
            str(path),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp / "out.jsonl"),
            "--temperature",
            "0",
            "--no-progress",
        ]
    else:
        reqs = make_workload(
            args.num_prompts,
            max_model_len=args.max_model_len,
            vocab=vocab,
            seed=args.seed,
            mean_input=args.mean_input,
            mean_output=args.mean_output,
        )
        prompts = tmp / "prompts.jsonl"
        with open(prompts, "w") as f:
            for i, (ids, n) in enumerate(reqs):
                f.write(
                    json.dumps(
                        {
                            "id": f"p{i}",
                            "prompt_token_ids": ids,
                            "max_tokens": n,
                            "ignore_eos": True,
                        }
                    )
                    + "\n"
                )
        argv = [
            "generate",
            "--model",
            str(path),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp / "out.jsonl"),
            "--temperature",
            "0",
            "--no-progress",
            "--max-model-len",
            str(args.max_model_len),
        ]
    argv += args.cli_args.split()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    wall = time.time() - T0
    state["on"] = False
    cli_summary = json.loads(buf.getvalue().strip().splitlines()[-1]) if buf.getvalue() else {}

    runner = state["runner"]
    if not args.no_hlo and runner is not None:
        for lab, key in keys.items():
            try:
                text = runner.lower(key).as_text()
                rows[lab]["hlo_chars"] = len(text)
                rows[lab]["hlo_op_lines"] = sum(" = " in ln for ln in text.splitlines())
            except Exception as e:  # noqa: BLE001  a size we could not get is reported as such
                rows[lab]["hlo_error"] = f"{type(e).__name__}: {e}"[:200]

    table = sorted(rows.values(), key=lambda r: -(r["trace_s"] + r["lower_s"] + r["compile_s"]))
    for r in table:
        for k in ("trace_s", "lower_s", "compile_s"):
            r[k] = round(r[k], 3)
    tot = {k: round(sum(r[k] for r in table), 2) for k in ("trace_s", "lower_s", "compile_s")}
    summary = {
        "bench": "profile_compile",
        **host_info(),
        "job": args.job,
        "model": str(path),
        "unroll_layers": args.unroll_layers,
        "scan_from_tokens": args.scan_from_tokens,
        "cli_args": args.cli_args,
        "reuse_steps": bucket_reuse.REUSE_STEPS,
        "bucket_reuse": not args.no_bucket_reuse,
        "persistent_cache": args.persistent_cache,
        "exit_code": rc,
        "num_prompts": cli_summary.get("prompts"),
        "completion_tokens": cli_summary.get("completion_tokens"),
        "wall_from_process_start_s": round(wall, 2),
        "imports_s": round(t_imports, 2),
        "first_token_from_process_start_s": (
            round(state["first_token"], 2) if state["first_token"] else None
        ),
        "engine_compilations": cli_summary.get("compilations"),
        "xla_compilations": sum(r["compiles"] for r in table),
        "xla_compilations_engine_steps": sum(
            r["compiles"] for r in table if r["key"].startswith("(")
        ),
        **{f"total_{k}": v for k, v in tot.items()},
        "cli_wall_s": cli_summary.get("wall_s"),
        "cli_generate_s": cli_summary.get("generate_s"),
        "items": table,
    }
    log(
        f"{'key':58s} {'trace':>7s} {'lower':>7s} {'compile':>8s} {'n':>3s} {'at_s':>6s} "
        f"{'hlo_chars':>10s} {'ops':>6s}"
    )
    for r in table:
        log(
            f"{r['key'][:58]:58s} {r['trace_s']:7.2f} {r['lower_s']:7.2f} {r['compile_s']:8.2f} "
            f"{r['compiles']:3d} {r['first_at_s']:6.1f} {r.get('hlo_chars', ''):>10} "
            f"{r.get('hlo_op_lines', ''):>6}"
        )
    log(
        f"total: trace {tot['trace_s']} s, lower {tot['lower_s']} s, XLA compile "
        f"{tot['compile_s']} s over {summary['xla_compilations']} compilations; wall "
        f"{summary['wall_from_process_start_s']} s, first token at "
        f"{summary['first_token_from_process_start_s']} s from process start"
    )
    emit(summary, "profile_compile", args.results_dir)
    sys.exit(rc)


if __name__ == "__main__":
    main()
