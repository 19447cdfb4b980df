"""Peers in one script (issue 21): one token-id batch job, whole runs, through every engine.

    python scripts/bench_peers.py                                # the issue's job (llama110m)
    python scripts/bench_peers.py --quick                        # stories260K smoke run
    python scripts/bench_peers.py --engines jaxinfer,hf_generate --num-prompts 16
    python scripts/bench_peers.py --gguf model-f32.gguf          # with llama-cpp-python
    python scripts/bench_peers.py --gguf model-f32.gguf --gguf-q8 model-q8_0.gguf   # + its q8_0

Job: ``benchlib.make_workload`` (seed 0: 64 prompts, ShareGPT-like log-normal lengths, mean 64
in and 96 out, clamped to [4, 256] at ``--max-model-len`` 512; on llama110m 4050 prompt and
6232 output tokens), greedy, EOS ignored, each request to its own ``max_tokens``, so every engine
produces the same tokens' count. Each engine runs as its own process and is timed from process
start to exit (imports, weight load, compilation, generation): a whole run, as a user sees it.

- ``jaxinfer``: the CLI, ``jaxinfer generate --prompts P --out O --temperature 0 --ignore-eos
  --max-model-len 512`` (defaults otherwise), twice with ``JAXINFER_CACHE_DIR`` set to one fresh
  directory: ``jaxinfer_cold`` (empty persistent compilation cache) and ``jaxinfer_warm``
  (the cache the cold run filled).
- ``hf_generate``: transformers ``model.generate``, float32, static batches of
  ``--hf-batch-size`` (16) in workload order, left-padded, ``torch.set_num_threads(2)``
  (``bench_serving.run_hf``; a batch runs to its longest request, only requested tokens count).
- ``hf_generate_batch``: transformers' continuous batching, the manager ``generate_batch`` runs
  (``continuous_batching_context_manager``, warm-up included), each request added with its own
  ``max_new_tokens`` and EOS off (``generate_batch`` itself takes one ``max_new_tokens`` for all).
  Its KV cache is sized to the job (blocks for every request at once) and its step to
  ``max_batch_tokens`` 512, 64 requests at most, as jaxinfer's; by default transformers sizes the
  cache to 60 % of free memory, and on CPU that alone took 16 s for stories260K here.
- ``llama_cpp``: ``llama-cpp-python`` on ``--gguf`` (the same weights converted with llama.cpp's
  ``convert_hf_to_gguf.py``), 2 threads, requests one after another (``Llama.generate``, greedy).
  Skipped, with the reason in the JSON, when ``llama_cpp`` is not importable or no GGUF is given.

Useful output tok/s = the job's requested output tokens / whole-run wall; ``vs_hf_generate`` is
that over transformers ``generate``'s (the same tokens, so the inverse wall ratio).

``decode1`` (batch-1 decode, steady state): jaxinfer float32, int8 and w8a8
(``bench_roofline.decode_rate``: the median decode-only step of one sequence, compile steps left
out) beside transformers batch 1 (1 / its mean decode step, ``bench_serving.run_hf``) and
llama.cpp when available (the median decode step of the same prompt, f32 ``--gguf`` and q8_0
``--gguf-q8``, as jaxinfer's float32 and int8 modes).

Output: one JSON line (host, CPU model, load averages before and after, per engine wall, CPU
seconds, output tokens, tok/s, ratio) appended to ``results/bench_peers.jsonl``; a table on
stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import add_common_args, emit, host_info, log, make_workload, ratio, resolve_model

ENGINES = ("jaxinfer", "hf_generate", "hf_generate_batch", "llama_cpp", "decode1")
QUANT_MODES = (None, "int8", "w8a8")  # batch-1 decode modes of jaxinfer


# ---------------------------------------------------------------- the engines' runs (children)


def _torch_threads(threads: int):
    import torch

    torch.set_num_threads(threads)
    return torch


def child_hf_generate(spec: dict) -> dict:
    from bench_serving import run_hf

    reqs = [(ids, n) for ids, n in spec["reqs"]]
    res, _ = run_hf(
        spec["hf_dir"],
        reqs,
        dtype="float32",
        batch_size=spec["batch_size"],
        threads=spec["threads"],
    )
    return res


def child_hf_generate_batch(spec: dict) -> dict:
    """transformers' continuous batching over all requests (see the module docstring)."""
    torch = _torch_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    reqs, page = spec["reqs"], 256
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - t
    gen = GenerationConfig(
        max_new_tokens=max(n for _, n in reqs),
        do_sample=False,
        pad_token_id=0,
        eos_token_id=-1,
        bos_token_id=1,
    )
    blocks = sum(math.ceil((len(ids) + n) / page) for ids, n in reqs) + 8
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=512, max_requests_per_batch=64
    )
    results, t = {}, time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, block=True, timeout=5, continuous_batching_config=cb
    ) as manager:
        ids = [manager.add_request(input_ids=p, max_new_tokens=n, eos_token_id=-1) for p, n in reqs]
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                break
        generate_s = time.perf_counter() - t
    errors = [i for i, r in results.items() if r.error is not None]
    if len(results) < len(ids) or errors:
        raise RuntimeError(
            f"transformers continuous batching: {len(results)} of {len(ids)} "
            f"requests finished, errors in {errors[:5]}"
        )
    got = [len(results[i].generated_tokens) for i in ids]
    return {
        "load_s": round(load_s, 3),
        "generate_s": round(generate_s, 3),
        "output_tokens": sum(got),
        "num_blocks": blocks,
        "page_size": page,
        "short_requests": sum(g < n for g, (_, n) in zip(got, reqs, strict=True)),
    }


def llama_cpp_run(spec: dict, reqs) -> int:
    """Output tokens of llama.cpp's greedy run of ``reqs``, one request after another."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=spec["max_model_len"],
        n_threads=spec["threads"],
        n_batch=512,
        verbose=False,
    )
    total = 0
    for ids, n in reqs:
        got = 0
        for _ in llm.generate(ids, temp=0.0, reset=True):  # yields past EOS: only n counts
            got += 1
            if got == n:
                break
        total += got
    return total


def child_llama_cpp(spec: dict) -> dict:
    return {"output_tokens": llama_cpp_run(spec, spec["reqs"])}


def child_decode1(spec: dict) -> dict:
    """Batch-1 decode tok/s: jaxinfer per mode, then transformers (and llama.cpp) if asked."""
    out = {}
    if spec["jaxinfer"]:
        import gc

        from bench_roofline import decode_rate

        from jaxinfer import LLM

        for mode in QUANT_MODES:
            llm = LLM(
                spec["path"],
                dtype="float32",
                quantization=mode,
                max_model_len=spec["max_model_len"],
            )
            r = decode_rate(
                llm,
                1,
                prompt_len=spec["prompt_len"],
                warmup=spec["warmup"],
                steps=spec["steps"],
                vocab=spec["vocab"],
                seed=0,
            )
            out[f"jaxinfer_{mode or 'float32'}"] = {
                "tok_s": r["tok_s"],
                "step_ms_p50": round(r["step_s_p50"] * 1e3, 3),
                "timed_steps": r["timed_steps"],
            }
            del llm
            gc.collect()
    prompt = [1] + list(range(3, 2 + spec["prompt_len"]))
    n = spec["warmup"] + spec["steps"] + 1
    if spec["hf"]:
        from bench_serving import run_hf

        res, _ = run_hf(
            spec["hf_dir"], [(prompt, n)], dtype="float32", batch_size=1, threads=spec["threads"]
        )
        step = res["tpot_s"]["mean"]
        out["hf_generate_float32"] = {
            "tok_s": round(1 / step, 2),
            "step_ms_mean": round(step * 1e3, 3),
        }
    for name, gguf in (("llama_cpp", spec.get("gguf")), ("llama_cpp_q8_0", spec.get("gguf_q8"))):
        if gguf:
            steps = llama_cpp_steps({**spec, "gguf": gguf}, prompt, n)[spec["warmup"] :]
            p50 = float(np.median(steps))
            out[name] = {
                "tok_s": round(1 / p50, 2),
                "step_ms_p50": round(p50 * 1e3, 3),
                "timed_steps": len(steps),
                "gguf": gguf,
            }
    return out


def llama_cpp_steps(spec: dict, prompt: list[int], n: int) -> list[float]:
    """Seconds of each of llama.cpp's batch-1 decode steps after the first token (greedy)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=spec["max_model_len"],
        n_threads=spec["threads"],
        n_batch=512,
        verbose=False,
    )
    stamps = []
    for _ in llm.generate(prompt, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == n:
            break
    return list(np.diff(stamps))


CHILDREN = {
    "hf_generate": child_hf_generate,
    "hf_generate_batch": child_hf_generate_batch,
    "llama_cpp": child_llama_cpp,
    "decode1": child_decode1,
}


# ---------------------------------------------------------------- the parent


def cpu_info() -> dict:
    """lscpu's model name and the SIMD flags that matter here."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return {"cpu_model": None, "lscpu_error": str(e)}
    fields = dict(ln.split(":", 1) for ln in text.splitlines() if ":" in ln)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")
    return {
        "cpu_model": fields.get("Model name"),
        "cpu_family": fields.get("CPU family"),
        "cpu_flags": [f for f in wanted if f in flags],
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed(cmd: list[str], env: dict, log_path: Path, timeout: float) -> dict:
    """Runs ``cmd`` to exit: wall and CPU seconds, exit code, last stdout line as JSON."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = loadavg()[0]
    t = time.perf_counter()
    try:
        with open(log_path, "w") as err:
            p = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "load1_before": load}
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    res = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 1), "load1_before": load}
    lines = p.stdout.strip().splitlines()
    try:
        res["inner"] = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        res["inner"] = None
    if p.returncode != 0 or res["inner"] is None:
        tail = log_path.read_text()[-1500:]
        res["error"] = f"exit code {p.returncode}; stderr tail: {tail}"
    return res


def jaxinfer_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("jaxinfer")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "jaxinfer"]


def run_jaxinfer(path, reqs, args, tmp: Path) -> dict:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt_token_ids": ids, "max_tokens": n}) + "\n"
            for i, (ids, n) in enumerate(reqs)
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "JAXINFER_COMPILATION_CACHE"}
    env["JAXINFER_CACHE_DIR"] = str(tmp / "jaxinfer-cache")  # fresh: the cold run starts empty
    out = {}
    for run in ("cold", "warm"):
        cmd = jaxinfer_cmd() + [
            "generate",
            "--model",
            str(path),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp / f"out-{run}.jsonl"),
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-model-len",
            str(args.max_model_len),
            "--no-progress",
            *shlex.split(args.jaxinfer_args),
        ]
        log(f"[peers] jaxinfer {run}: {' '.join(cmd[1:])}")
        r = timed(cmd, env, tmp / f"jaxinfer-{run}.log", args.timeout)
        inner = r.pop("inner", None) or {}
        r.update(
            {
                "output_tokens": inner.get("completion_tokens"),
                "compilations": inner.get("compilations"),
                "generate_s": inner.get("generate_s"),
            }
        )
        out[f"jaxinfer_{run}"] = r
    out["jaxinfer_cold"]["command"] = "JAXINFER_CACHE_DIR=<fresh dir> " + " ".join(
        [
            "jaxinfer",
            "generate",
            "--model",
            "M",
            "--prompts",
            "P",
            "--out",
            "O",
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-model-len",
            str(args.max_model_len),
            "--no-progress",
            *shlex.split(args.jaxinfer_args),
        ]
    )
    return out


def run_child(kind: str, spec: dict, args, tmp: Path) -> dict:
    (tmp / f"{kind}.json").write_text(json.dumps(spec))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kind,
        "--spec",
        str(tmp / f"{kind}.json"),
    ]
    log(f"[peers] {kind} ...")
    return timed(cmd, dict(os.environ), tmp / f"{kind}.log", args.timeout)


def llama_cpp_skip(gguf: str | None) -> str | None:
    """Why llama.cpp cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama_cpp (llama-cpp-python) is not importable in this Python; install it "
            "(a source build) and convert the weights with llama.cpp's convert_hf_to_gguf.py, "
            "then pass --gguf"
        )
    if not gguf:
        return "no --gguf given (the model converted with llama.cpp's convert_hf_to_gguf.py)"
    if not Path(gguf).is_file():
        return f"--gguf {gguf}: no such file"
    return None


def finish(engines: dict, expected_tokens: int) -> None:
    """Adds tok/s, the ratio to transformers generate and a token-count check to each run."""
    for r in engines.values():
        if "wall_s" in r and r.get("output_tokens"):
            r["output_tok_s"] = round(r["output_tokens"] / r["wall_s"], 2)
            r["same_tokens_as_requested"] = r["output_tokens"] == expected_tokens
    base_rate = engines.get("hf_generate", {}).get("output_tok_s")
    for r in engines.values():
        if "output_tok_s" in r:
            r["vs_hf_generate"] = ratio(r["output_tok_s"], base_rate)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=None,
        help="llama110m (default), stories260K (--quick's), llama1b, qwen3moe1b, qwen3moe250m, "
        "qwen3moe_tiny or a HF directory",
    )
    ap.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated subset of {','.join(ENGINES)}",
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--mean-input", type=float, default=64)
    ap.add_argument("--mean-output", type=float, default=96)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    ap.add_argument("--gguf", default=None, help="the model as GGUF, for llama.cpp")
    ap.add_argument(
        "--jaxinfer-args",
        default="",
        help='more `jaxinfer generate` flags for its runs, e.g. "--attn-impl cpu_kernel"',
    )
    ap.add_argument(
        "--gguf-q8",
        default=None,
        help="the model as q8_0 GGUF: llama.cpp's batch-1 decode beside the int8 modes",
    )
    ap.add_argument("--decode-steps", type=int, default=64, help="timed batch-1 decode steps")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    add_common_args(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](json.loads(Path(args.spec).read_text()))))
        return
    engines = [e for e in args.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"--engines: unknown {bad}; choose from {','.join(ENGINES)}")
    if args.quick:
        args.num_prompts, args.mean_input, args.mean_output = 8, 12, 12
        args.max_model_len, args.hf_batch_size, args.decode_steps = 64, 4, 8
    args.model = args.model or ("stories260K" if args.quick else "llama110m")

    load_before, started, git = loadavg(), time.strftime("%Y-%m-%dT%H:%M:%S"), git_state()
    wants_hf = bool({"hf_generate", "hf_generate_batch", "decode1"} & set(engines))
    path, vocab, hf_dir = resolve_model(args.model, hf=wants_hf)
    reqs = make_workload(
        args.num_prompts,
        max_model_len=args.max_model_len,
        vocab=vocab,
        seed=args.seed,
        mean_input=args.mean_input,
        mean_output=args.mean_output,
    )
    expected = sum(n for _, n in reqs)
    log(
        f"[peers] {args.model}: {len(reqs)} requests, {sum(len(i) for i, _ in reqs)} prompt "
        f"tokens, {expected} output tokens; load {load_before}"
    )
    spec = {
        "reqs": reqs,
        "path": str(path),
        "hf_dir": str(hf_dir) if hf_dir else None,
        "vocab": vocab,
        "threads": args.threads,
        "max_model_len": args.max_model_len,
        "batch_size": args.hf_batch_size,
        "gguf": args.gguf,
    }
    skip = llama_cpp_skip(args.gguf)
    results, skipped = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as td:
        tmp = Path(td)
        if "jaxinfer" in engines:
            results.update(run_jaxinfer(path, reqs, args, tmp))
        for kind in ("hf_generate", "hf_generate_batch"):
            if kind in engines:
                r = run_child(kind, spec, args, tmp)
                inner = r.pop("inner", None) or {}
                r["output_tokens"] = inner.get("output_tokens")
                r["inner"] = {k: v for k, v in inner.items() if k not in ("ttft_s", "tpot_s")}
                results[kind] = r
        if "llama_cpp" in engines:
            if skip:
                skipped["llama_cpp"] = skip
            else:
                r = run_child("llama_cpp", spec, args, tmp)
                r["output_tokens"] = (r.pop("inner", None) or {}).get("output_tokens")
                results["llama_cpp"] = r
        decode1 = None
        if "decode1" in engines:
            d_spec = {
                **spec,
                "reqs": [],
                "jaxinfer": True,
                "hf": True,
                "gguf": None if skip else args.gguf,
                "gguf_q8": None if skip or llama_cpp_skip(args.gguf_q8) else args.gguf_q8,
                "prompt_len": 16 if args.quick else 64,
                "warmup": 2 if args.quick else 8,
                "steps": args.decode_steps,
            }
            r = run_child("decode1", d_spec, args, tmp)
            decode1 = {
                **(r.get("inner") or {"error": r.get("error")}),
                "wall_s": r.get("wall_s"),
                "load1_before": r.get("load1_before"),
            }
            if skip:
                decode1["llama_cpp"] = {"skipped": skip}
    finish(results, expected)
    summary = {
        "bench": "peers",
        **host_info(),
        **cpu_info(),
        "quick": args.quick,
        "started": started,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "model": args.model,
        "jaxinfer_args": args.jaxinfer_args,
        "threads": args.threads,
        "hf_batch_size": args.hf_batch_size,
        "workload": {
            "num_prompts": len(reqs),
            "seed": args.seed,
            "mean_input": args.mean_input,
            "mean_output": args.mean_output,
            "max_model_len": args.max_model_len,
            "prompt_tokens": sum(len(i) for i, _ in reqs),
            "output_tokens": expected,
            "prompt_len_range": [min(len(i) for i, _ in reqs), max(len(i) for i, _ in reqs)],
            "output_len_range": [min(n for _, n in reqs), max(n for _, n in reqs)],
        },
        "engines": results,
        "skipped": skipped,
        "decode_batch1": decode1,
        "versions": versions(),
        "git_at_start": git,
    }
    log(f"{'engine':20s} {'wall s':>8s} {'cpu s':>7s} {'tokens':>7s} {'tok/s':>8s} {'vs hf':>6s}")
    for name, r in results.items():
        log(
            f"{name:20s} {r.get('wall_s', '-')!s:>8s} {r.get('cpu_s', '-')!s:>7s} "
            f"{r.get('output_tokens', '-')!s:>7s} {r.get('output_tok_s', '-')!s:>8s} "
            f"{r.get('vs_hf_generate', '-')!s:>6s}"
            + (f"  ERROR {r['error'][:200]}" if "error" in r else "")
        )
    for name, why in skipped.items():
        log(f"{name:20s} skipped: {why}")
    if decode1:
        log(f"batch-1 decode: {json.dumps(decode1)}")
    emit(summary, "bench_peers", args.results_dir)


def git_state() -> dict:
    """The checkout's commit and its uncommitted engine files: a shared working tree changes
    under a long run, and the jaxinfer runs use whatever is there."""

    def git(*a):
        p = subprocess.run(
            ["git", *a], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
        )
        return (
            p.stdout.rstrip() if p.returncode == 0 else None
        )  # porcelain lines start with a space

    status = git("status", "--porcelain", "--", "jaxinfer", "kernels_pallas")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted": [ln[3:] for ln in status.splitlines()] if status else [],
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("jax", "torch", "transformers", "llama-cpp-python"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    main()
