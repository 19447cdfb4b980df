"""Compile cost: time to first token of a fresh process, compilations over a run and its repeat,
with and without JAX's persistent compilation cache.

    python scripts/bench_compile.py                        # stories260K and llama110m
    python scripts/bench_compile.py --models llama110m
    python scripts/bench_compile.py --quick

For each model, three fresh subprocesses (this script with ``--child``) run the same thing:

- ``disabled``: ``JAXINFER_COMPILATION_CACHE=0`` (every compilation done);
- ``cold``: the cache on, in a fresh temporary ``JAXINFER_CACHE_DIR`` (compiles and writes it);
- ``warm``: the cache on, reusing that directory (reads what ``cold`` wrote).

Each child builds ``LLM``, streams one prompt (``--first-prompt-len`` tokens) until its first
token, finishes it, then runs a mixed-length workload (``benchlib.make_workload``, seeded) and the
same workload again (``--attn-impl``: the attention of every child's ``LLM``; ``--quick``'s
children run the XLA attention, so the cold child builds no native kernel). Reported per mode:
time to first token from the parent's spawn (``ttft_process_s``: Python start, imports,
loading, compilation) and from the ``generate_stream`` call (``ttft_in_process_s``);
``llm.num_compilations`` after the first request, after the workload and after the repeat
(``grew_after_warmup`` = repeat - workload, which must be 0); XLA backend compilations and
their seconds, and persistent-cache hits, from ``jax.monitoring`` events. The engine's threshold
for caching (``jax_persistent_cache_min_compile_time_secs``) is left as the engine sets it unless
``--cache-min-compile-secs`` overrides it. One JSON line on stdout, appended to
``results/bench_compile.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchlib import SCRIPTS, add_common_args, emit, host_info, log, resolve_model


def child(args) -> None:
    """One fresh process: prints a JSON line of its measurements."""
    import jax
    from jax import monitoring

    events = {"backend_compiles": 0, "backend_compile_s": 0.0, "cache_hits": 0, "cache_misses": 0}

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            events["backend_compiles"] += 1
            events["backend_compile_s"] += duration

    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            events["cache_hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            events["cache_misses"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    t_import = time.time()

    from benchlib import greedy, make_workload

    from jaxinfer import LLM

    path, vocab = args.models, args.vocab  # resolved by the parent (the cache dir is redirected)
    t = time.perf_counter()
    llm = LLM(
        path,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        attn_impl=args.attn_impl,
    )
    if args.cache_min_compile_secs is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", args.cache_min_compile_secs)
    load_s = time.perf_counter() - t
    first = [1] + list(range(3, 3 + args.first_prompt_len - 1))
    t = time.perf_counter()
    ttft_wall, ttft_in = None, None
    for _ in llm.generate_stream({"prompt_token_ids": first}, greedy(args.first_output_len)):
        if ttft_in is None:
            ttft_in, ttft_wall = time.perf_counter() - t, time.time()
    comp_first = llm.num_compilations
    reqs = make_workload(
        args.num_prompts,
        max_model_len=args.max_model_len,
        vocab=vocab,
        seed=args.seed,
        mean_input=args.mean_input,
        mean_output=args.mean_output,
    )
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    sps = [greedy(o) for _, o in reqs]
    t = time.perf_counter()
    llm.generate(prompts, sps)
    run_s, comp_run = time.perf_counter() - t, llm.num_compilations
    compiles_run = events["backend_compiles"]
    t = time.perf_counter()
    llm.generate(prompts, sps)
    repeat_s, comp_repeat = time.perf_counter() - t, llm.num_compilations
    print(
        json.dumps(
            {
                "ttft_abs_time": ttft_wall,
                "import_done_time": t_import,
                "load_s": round(load_s, 3),
                "ttft_in_process_s": round(ttft_in, 3),
                "compilations_first_request": comp_first,
                "compilations_run": comp_run,
                "compilations_repeat": comp_repeat,
                "grew_after_warmup": comp_repeat - comp_run,
                "run_s": round(run_s, 3),
                "repeat_s": round(repeat_s, 3),
                "backend_compiles_run": compiles_run,
                "backend_compiles_repeat": events["backend_compiles"] - compiles_run,
                "backend_compile_s": round(events["backend_compile_s"], 3),
                "cache_hits": events["cache_hits"],
                "cache_misses": events["cache_misses"],
            }
        )
    )


def spawn(args, model: str, vocab: int, env: dict) -> dict:
    cmd = [
        sys.executable,
        str(SCRIPTS / "bench_compile.py"),
        "--child",
        "--models",
        model,
        "--vocab",
        str(vocab),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--num-prompts",
        str(args.num_prompts),
        "--mean-input",
        str(args.mean_input),
        "--mean-output",
        str(args.mean_output),
        "--seed",
        str(args.seed),
        "--first-prompt-len",
        str(args.first_prompt_len),
        "--first-output-len",
        str(args.first_output_len),
        "--attn-impl",
        args.attn_impl,
    ]
    if args.cache_min_compile_secs is not None:
        cmd += ["--cache-min-compile-secs", str(args.cache_min_compile_secs)]
    t0 = time.time()
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["ttft_process_s"] = round(r.pop("ttft_abs_time") - t0, 3)
    r["imports_s"] = round(r.pop("import_done_time") - t0, 3)
    r["process_wall_s"] = round(wall, 3)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="stories260K,llama110m")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--mean-input", type=float, default=64)
    ap.add_argument("--mean-output", type=float, default=32)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--first-prompt-len", type=int, default=16)
    ap.add_argument("--first-output-len", type=int, default=8)
    ap.add_argument(
        "--attn-impl",
        default="auto",
        help="the children's LLM(attn_impl=...) (--quick: xla, no native kernel to build)",
    )
    ap.add_argument(
        "--cache-min-compile-secs",
        type=float,
        default=None,
        help="override jax_persistent_cache_min_compile_time_secs (engine default 0.5)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=512, help=argparse.SUPPRESS)
    add_common_args(ap)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.quick:  # a smoke test of the three children and the summary
        args.models, args.num_prompts, args.mean_input, args.mean_output = "stories260K", 2, 12, 4
        args.max_model_len, args.max_num_seqs, args.first_output_len = 64, 8, 4
        # The cold child's fresh JAXINFER_CACHE_DIR holds no native CPU decode kernel: with the
        # default attention it would build it (a C++ compile) before its first token.
        args.attn_impl = "xla" if args.attn_impl == "auto" else args.attn_impl

    results = []
    for model in [m for m in args.models.split(",") if m]:
        path, vocab, _ = resolve_model(model)  # before JAXINFER_CACHE_DIR is redirected
        with tempfile.TemporaryDirectory(prefix="jaxinfer-cache-") as cache:
            modes = {}
            for mode, env in (
                ("disabled", {"JAXINFER_COMPILATION_CACHE": "0"}),
                ("cold", {"JAXINFER_COMPILATION_CACHE": "1", "JAXINFER_CACHE_DIR": cache}),
                ("warm", {"JAXINFER_COMPILATION_CACHE": "1", "JAXINFER_CACHE_DIR": cache}),
            ):
                modes[mode] = spawn(args, str(path), vocab, env)
                log(
                    f"[compile] {model} {mode}: TTFT {modes[mode]['ttft_process_s']} s from "
                    f"spawn, {modes[mode]['compilations_run']} -> "
                    f"{modes[mode]['compilations_repeat']} compilations"
                )
        results.append(
            {
                "model": model,
                **modes,
                "warm_over_disabled_ttft": round(
                    modes["warm"]["ttft_process_s"] / modes["disabled"]["ttft_process_s"], 3
                ),
                "compilations_stop_growing": all(
                    m["grew_after_warmup"] == 0 for m in modes.values()
                ),
            }
        )
    summary = {
        "bench": "compile",
        "quick": args.quick,
        "seed": args.seed,
        "num_prompts": args.num_prompts,
        "max_model_len": args.max_model_len,
        "results": results,
        **host_info(),
    }
    emit(summary, "bench_compile", args.results_dir)


if __name__ == "__main__":
    main()
