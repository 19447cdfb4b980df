"""Structured outputs' cost (issue 31); prints one JSON summary per model.

    python scripts/bench_structured.py                       # stories260K and the ~110M Llama
    python scripts/bench_structured.py --models stories260K

For each model: a batch of N requests (default 64, one prompt each, temperature 1.0, seeded)
run twice on one warm ``LLM``: every request constrained by a JSON schema (an array of at least
ten small objects, no whitespace: outputs reach ``max_tokens`` as the unconstrained ones do),
then the same requests unconstrained (``ignore_eos``). Reported: output tokens/s of each (the
slowdown in %), the host's mask time per token per row (µs: ``Grammars.fill_bitmask`` timed
around each call, divided by the rows it filled), the matcher's advance time per token, the
first-request cost of a schema (the llguidance tokenizer, then the grammar compiled) and the
same with the schema cached. Both configurations run once before they are timed (compilations
excluded). The summary also gives the CPU model, the commit and the load average; it is
appended to ``results/bench_structured.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

SCHEMA = {  # at least 10 items (> 128 tokens): constrained outputs as long as the others
    "type": "array",
    "minItems": 10,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    },
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def bench_model(name: str, n: int, max_tokens: int, max_num_seqs: int) -> dict:
    from bench_generate import RANDOM_LLAMAS, SHARED, random_llama_dir

    from jaxinfer import SamplingParams, StructuredOutputsParams
    from jaxinfer.llm import LLM
    from jaxinfer.sampling.structured import Grammars

    model = SHARED / "models" / "stories260K" if name == "stories260K" else random_llama_dir(name)
    assert name == "stories260K" or name in RANDOM_LLAMAS
    llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=512)
    eng = llm.engine
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    # first-request cost: the llguidance tokenizer, then the schema; then the schema cached
    g = Grammars(llm.tokenizer, eng.cfg.vocab_size)
    t0 = time.perf_counter()
    _ = g.ll_tokenizer
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.check(so)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        g.matcher(so)
    t_cached = (time.perf_counter() - t0) / 100

    timing = {"fill_s": 0.0, "rows": 0, "calls": 0}
    fill = eng.grammars.fill_bitmask

    def timed_fill(rows, bitmask):
        t = time.perf_counter()
        fill(rows, bitmask)
        timing["fill_s"] += time.perf_counter() - t
        timing["rows"] += len(rows)
        timing["calls"] += 1

    eng.grammars.fill_bitmask = timed_fill
    prompts = ["Once upon a time"] * n
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=so)
        for i in range(n)
    ]
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n)
    ]

    def run(params) -> tuple[float, int, list]:
        t = time.perf_counter()
        outs = llm.generate(prompts[: len(params)], params)
        wall = time.perf_counter() - t
        return wall, sum(len(o.token_ids) for o in outs), outs

    run(constrained[:8]), run(free[:8])  # compile the shapes of both (warm-up)
    run(constrained), run(free)
    timing.update(fill_s=0.0, rows=0, calls=0)
    wall_c, tok_c, outs = run(constrained)
    mask = dict(timing)
    wall_f, tok_f, _ = run(free)
    for o in outs:
        if o.finish_reason == "stop":
            json.loads(o.text)
    # the matcher's advance per token, timed apart (replayed on fresh matchers)
    t0, k = time.perf_counter(), 0
    for o in outs[:16]:
        m = eng.grammars.matcher(so)
        for tok in o.token_ids:
            m.accept(tok)
            k += 1
    accept_us = (time.perf_counter() - t0) / max(k, 1) * 1e6
    tps_c, tps_f = tok_c / wall_c, tok_f / wall_f
    return {
        "model": name,
        "vocab_size": eng.cfg.vocab_size,
        "tokenizer_vocab": llm.tokenizer.vocab_size,
        "requests": n,
        "max_tokens": max_tokens,
        "constrained_tok_s": round(tps_c, 1),
        "unconstrained_tok_s": round(tps_f, 1),
        "slowdown_pct": round((1 - tps_c / tps_f) * 100, 1),
        "constrained_tokens": tok_c,
        "unconstrained_tokens": tok_f,
        "constrained_finished_stop": sum(o.finish_reason == "stop" for o in outs),
        "mask_us_per_token_row": round(mask["fill_s"] / max(mask["rows"], 1) * 1e6, 2),
        "mask_ms_per_step": round(mask["fill_s"] / max(mask["calls"], 1) * 1e3, 3),
        "accept_us_per_token": round(accept_us, 2),
        "ll_tokenizer_build_ms": round(t_tok * 1e3, 2),
        "schema_first_compile_ms": round(t_first * 1e3, 2),
        "schema_cached_ms": round(t_cached * 1e3, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["stories260K", "llama110m"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--results", default=str(REPO / "results" / "bench_structured.jsonl"))
    args = ap.parse_args()
    for name in args.models:
        row = bench_model(name, args.num_requests, args.max_tokens, args.max_num_seqs)
        row |= {
            "bench": "structured",
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "commit": commit(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(row), flush=True)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
