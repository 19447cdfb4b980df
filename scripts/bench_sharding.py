"""Tokens/s of a ~110M random Llama at tensor-parallel sizes 1/2/4 on fake CPU devices; prints JSON.

    python scripts/bench_sharding.py [--tp 1 2 4] [--prompts 8] [--max-tokens 32]

Runs on 8 fake CPU devices (``--xla_force_host_platform_device_count=8``, set here before jax
starts). The fake devices share the machine's cores, so this measures the overhead of the sharded
step (collectives, smaller per-device matmuls), not a speed-up: that needs real chips. Each size
runs the same greedy batch twice (cold: compilations included; warm: compiled) through ``LLM``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama110m")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    import jax
    import numpy as np
    from bench_generate import random_llama_dir

    from jaxinfer.llm import LLM
    from jaxinfer.sampling.params import SamplingParams

    path = random_llama_dir(args.model)
    rng = np.random.default_rng(0)
    prompts = [
        [1] + rng.integers(3, 512, args.prompt_len - 1).tolist() for _ in range(args.prompts)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, ref = [], None
    for tp in args.tp:
        t0 = time.perf_counter()
        llm = LLM(
            path,
            tensor_parallel_size=tp,
            data_parallel_size=1,
            max_model_len=256,
            max_num_seqs=args.prompts,
            kv_pages=64,
            page_size=16,
            compilation_cache=False,
        )
        load_s = time.perf_counter() - t0
        runs = []
        for _ in range(2):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            runs.append(time.perf_counter() - t)
        toks = [o.token_ids for o in outs]
        ref = toks if ref is None else ref
        n = sum(len(t) for t in toks)
        rows.append(
            {
                "tp": tp,
                "load_s": round(load_s, 2),
                "cold_s": round(runs[0], 2),
                "warm_s": round(runs[1], 2),
                "warm_tok_s": round(n / runs[1], 1),
                "same_tokens_as_first": toks == ref,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del llm
    print(
        json.dumps(
            {
                "bench": "sharding",
                "model": args.model,
                "devices": jax.device_count(),
                "backend": jax.default_backend(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "prompts": args.prompts,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "note": "fake CPU devices share the cores: overhead, not speed-up",
                "runs": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
