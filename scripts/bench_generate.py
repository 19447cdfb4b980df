"""Throughput of ``jaxinfer generate`` on a batch of mixed-length prompts; prints one JSON summary.

    python scripts/bench_generate.py --model stories260K        # the shipped real model
    python scripts/bench_generate.py --model llama110m          # random ~110M Llama (HF format)
    python scripts/bench_generate.py --model qwen3moe250m       # random Qwen3-MoE (moe_models)

Workload (seeded): N prompts whose input and output lengths are drawn from log-normal
distributions shaped like ShareGPT's (long-tailed: many short, some long), clamped to the model's
context; prompt tokens are random non-special ids, outputs run to their drawn length
(``ignore_eos``), greedy. The prompts go through the real CLI path (``jaxinfer.cli.main.main``)
twice:
a cold run (compilations included) and a warm run (compiled code reused). The summary is printed
and appended to ``results/bench_generate.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from moe_models import RANDOM_QWEN3_MOES, random_qwen3_moe_dir

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("JAXINFER_SHARED", REPO.parent / "shared"))
CACHE = Path(os.environ.get("JAXINFER_CACHE_DIR", Path.home() / ".cache" / "jaxinfer"))

RANDOM_LLAMAS = {
    # name: (hidden, layers, heads, kv heads, mlp width, vocab)
    "llama110m": (768, 12, 12, 12, 2048, 32000),
    "llama1b": (2048, 16, 32, 8, 5632, 32000),
}


def random_llama_dir(name: str, dtype: str = "float32") -> Path:
    """A random Llama checkpoint in Hugging Face format (built once, cached), with stories260K's
    SentencePiece tokenizer beside it (smaller than the vocabulary, which is allowed)."""
    d, layers, heads, kv, f, v = RANDOM_LLAMAS[name]
    path = CACHE / "bench" / f"{name}-{dtype}"
    if (path / "config.json").exists():
        return path
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=f,
        vocab_size=v,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    shutil.copy(SHARED / "models" / "stories260K" / "tok512.model", path / "tokenizer.model")
    return path


def workload(n: int, max_len: int, vocab: int, seed: int, mean_in: float, mean_out: float):
    """(prompt ids, max_tokens) per request: log-normal lengths (sigma 0.8 in, 0.6 out)."""
    rng = np.random.default_rng(seed)
    ins = np.clip(rng.lognormal(np.log(mean_in) - 0.32, 0.8, n), 4, max_len // 2).astype(int)
    outs = np.clip(rng.lognormal(np.log(mean_out) - 0.18, 0.6, n), 4, max_len // 2).astype(int)
    reqs = []
    for i, o in zip(ins, outs, strict=False):
        ids = [1] + rng.integers(3, min(vocab, 512), i - 1).tolist()
        reqs.append((ids, int(o)))
    return reqs


def run_cli(argv: list[str]) -> dict:
    from jaxinfer.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"jaxinfer generate failed with exit code {rc}")
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="stories260K",
        help=f"stories260K, llama110m, llama1b, {', '.join(RANDOM_QWEN3_MOES)} or a path",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--mean-input", type=float, default=64)
    ap.add_argument("--mean-output", type=float, default=96)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(REPO / "results" / "bench_generate.jsonl"))
    args = ap.parse_args()

    if args.model == "stories260K":
        model, vocab = SHARED / "models" / "stories260K", 512
    elif args.model in RANDOM_LLAMAS:
        model, vocab = random_llama_dir(args.model), RANDOM_LLAMAS[args.model][-1]
    elif args.model in RANDOM_QWEN3_MOES:
        model = random_qwen3_moe_dir(args.model, CACHE, SHARED)
        vocab = RANDOM_QWEN3_MOES[args.model]["V"]
    else:
        model, vocab = Path(args.model), 512
    reqs = workload(
        args.num_prompts, args.max_model_len, vocab, args.seed, args.mean_input, args.mean_output
    )
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": o}) + "\n"
                for i, (ids, o) in enumerate(reqs)
            )
        )
        common = [
            "generate",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--dtype",
            args.dtype,
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--no-progress",
            "--quiet",
        ]
        t0 = time.perf_counter()
        cold = run_cli(common + ["--out", str(Path(tmp) / "cold.jsonl")])
        cold_wall = time.perf_counter() - t0
        warm = run_cli(common + ["--out", str(Path(tmp) / "warm.jsonl")])
        recs = [json.loads(x) for x in (Path(tmp) / "warm.jsonl").read_text().splitlines()]
    ttft = np.array([r["metrics"]["ttft_s"] for r in recs])
    tpot = np.array([r["metrics"]["tpot_s"] for r in recs])
    summary = {
        "bench": "generate",
        "model": args.model,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "prompt_tokens": warm["prompt_tokens"],
        "completion_tokens": warm["completion_tokens"],
        "cold_wall_s": round(cold_wall, 2),
        "cold_tok_s": cold["throughput_tok_s"],
        "warm_tok_s": warm["throughput_tok_s"],
        "warm_wall_s": warm["wall_s"],
        "requests_s": round(args.num_prompts / warm["generate_s"], 3),
        "ttft_mean_s": round(float(ttft.mean()), 4),
        "ttft_p50_s": round(float(np.median(ttft)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "tpot_mean_s": round(float(tpot.mean()), 5),
        "tpot_p50_s": round(float(np.median(tpot)), 5),
        "tpot_p99_s": round(float(np.percentile(tpot, 99)), 5),
        "compilations_cold": cold["compilations"],
        "compilations_warm": warm["compilations"],
        "preemptions": warm["preemptions"],
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(summary))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    sys.exit(main())
