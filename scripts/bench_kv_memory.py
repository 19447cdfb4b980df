"""KV memory efficiency at a fixed budget: the paged engine beside a contiguous per-sequence cache.

    python scripts/bench_kv_memory.py          # stories260K, 256 requests, 8192-token budget
    python scripts/bench_kv_memory.py --budget-tokens 16384 --num-prompts 512
    python scripts/bench_kv_memory.py --quick

The KV pool holds ``--budget-tokens`` token slots (``budget / page_size`` pages plus the reserved
null page). A mixed-length workload (``benchlib.make_workload``, seeded) all arrives at t=0 and runs
greedy with ``ignore_eos``; ``--max-num-seqs`` is set high so that memory, not the row limit, bounds
concurrency. After every ``EngineCore.step``:

- running = sequences in the scheduler's running set;
- live = sum over running sequences of ``num_computed`` (tokens whose K/V are in the cache);
- allocated = (num_pages - 1 - kv_manager.num_free_pages) x page_size (slots of handed-out pages).

Paged: max and mean running sequences, live / allocated (over all steps: sum live / sum allocated;
and the mean of the per-step fraction), preemptions. Contiguous (a cache reserving
``max_model_len`` slots per sequence): concurrent sequences = budget // max_model_len; its live
fraction is computed from the same trace: per step, live / (running x max_model_len), aggregated
the same way. One JSON line on stdout, appended to ``results/bench_kv_memory.jsonl``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from benchlib import (
    add_common_args,
    emit,
    greedy,
    host_info,
    kv_slot_bytes,
    log,
    make_workload,
    resolve_model,
)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--mean-input", type=float, default=64)
    ap.add_argument("--mean-output", type=float, default=96)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--budget-tokens", type=int, default=8192, help="KV budget in token slots")
    ap.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="tokens per page (default: the engine's, engine.default_page_size)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:  # the engine of the other scripts' quick runs (65 pages, 8 rows): shared steps
        args.model, args.num_prompts, args.mean_input, args.mean_output = "stories260K", 16, 12, 16
        args.max_model_len, args.budget_tokens, args.max_num_seqs = 64, 512, 8

    from jaxinfer import LLM

    path, vocab, _ = resolve_model(args.model)
    if args.page_size is None:
        from jaxinfer.engine.config import default_page_size

        args.page_size = default_page_size()
    num_pages = args.budget_tokens // args.page_size + 1
    llm = LLM(
        path,
        max_model_len=args.max_model_len,
        kv_pages=num_pages,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
    )
    eng, z = llm.engine, args.page_size
    reqs = make_workload(
        args.num_prompts,
        max_model_len=args.max_model_len,
        vocab=vocab,
        seed=args.seed,
        mean_input=args.mean_input,
        mean_output=args.mean_output,
    )
    for i, (ids, o) in enumerate(reqs):
        eng.add_request(f"kv-{i}", ids, greedy(o))
    kv, sched = eng.kv_manager, eng.scheduler
    running, live, allocated = [], [], []
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        running.append(len(sched.running))
        live.append(sum(s.num_computed for s in sched.running))
        allocated.append((kv.num_pages - 1 - kv.num_free_pages) * z)
    wall = time.perf_counter() - t
    running, live, allocated = map(np.asarray, (running, live, allocated))
    busy = allocated > 0
    slot_bytes = kv_slot_bytes(eng)
    paged = {
        "max_concurrent": int(running.max()),
        "mean_concurrent": round(float(running.mean()), 2),
        "live_fraction": round(float(live.sum() / allocated.sum()), 4),
        "live_fraction_mean_per_step": round(float(np.mean(live[busy] / allocated[busy])), 4),
        "peak_allocated_tokens": int(allocated.max()),
        "preemptions": sched.num_preemptions,
    }
    contig_slots = running * args.max_model_len
    has = contig_slots > 0
    contiguous = {
        "max_concurrent": args.budget_tokens // args.max_model_len,
        "live_fraction": round(float(live.sum() / contig_slots.sum()), 4),
        "live_fraction_mean_per_step": round(float(np.mean(live[has] / contig_slots[has])), 4),
    }
    log(
        f"[kv_memory] paged {paged['max_concurrent']} seqs, {paged['live_fraction']:.1%} live; "
        f"contiguous {contiguous['max_concurrent']} seqs, {contiguous['live_fraction']:.1%} live"
    )
    summary = {
        "bench": "kv_memory",
        "quick": args.quick,
        "model": args.model,
        "seed": args.seed,
        "num_prompts": args.num_prompts,
        "mean_input": args.mean_input,
        "mean_output": args.mean_output,
        "max_model_len": args.max_model_len,
        "page_size": z,
        "budget_tokens": args.budget_tokens,
        "budget_bytes": int(args.budget_tokens * slot_bytes),
        "steps": len(running),
        "wall_s": round(wall, 2),
        "paged": paged,
        "contiguous": contiguous,
        "concurrency_ratio": round(
            paged["max_concurrent"] / max(1, contiguous["max_concurrent"]), 2
        ),
        **host_info(),
    }
    emit(summary, "bench_kv_memory", args.results_dir)


if __name__ == "__main__":
    main()
