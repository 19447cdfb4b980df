"""Automatic prefix caching: the engine with caching on vs off, same process, same workloads.

    python scripts/bench_prefix_cache.py                       # stories260K and llama110m
    python scripts/bench_prefix_cache.py --models llama110m --repeats 3
    python scripts/bench_prefix_cache.py --quick               # smoke test, seconds

Two ``LLM`` objects per model live side by side, one with ``enable_prefix_caching=True`` and one
with it off (same weights, dtype, pool size, ``max_num_seqs``). Workloads (token ids, seeded, BOS
then uniform ids in [3, min(vocab, 512)), greedy with ``ignore_eos``, every request of a wave
arriving at t=0 in one ``LLM.generate`` call):

- ``system_prompt`` (a): R requests = one S-token system prompt + a unique Q-token question.
- ``chat`` (b): U users, T turns replayed as waves (every user's turn k, then turn k + 1); turn 1
  is a unique first message, turn k + 1's prompt = turn k's prompt + its answer (the setting's own
  generated tokens) + a new user message.
- ``few_shot`` (c): R records = one H-token 5-shot header + a unique question.
- ``no_prefix`` (d): R random prompts of (a)'s length: nothing to share, the cost of caching on.

Before measuring, every workload runs once per setting (compilation: the measured passes compile
nothing, ``compilations_in_measured_passes`` shows it). Then ``--repeats`` rounds; each runs every
workload in both settings, the order on/off alternating between rounds (the machine's load drifts).
The prefix cache is emptied (``KVCacheManager.clear_cache``) before every pass, so a pass
starts cold: the shared prefix is computed once inside the measured pass. Figures per workload
and setting are the median over the repeats of: TTFT p50/p99 (seconds from arrival; a chat's
are over all its waves), output tokens/s and wall (a chat's: the sum of its waves), hit rate
(cached prompt tokens / prompt tokens, from ``metrics.num_cached_tokens``), prefill tokens
computed (prompt tokens - cached tokens: recomputation after a preemption not counted; the
preemptions are reported), the engine's own hit rate and evictions (``prefix_cache_stats``
deltas), and ``cache_host_s``, host seconds inside the cache's bookkeeping (``CacheClock``).
``same_tokens`` says whether every output was the same with caching on and off.
``ratio_on_vs_off``: TTFT p50 off / on (higher is better for caching), output tok/s on / off,
wall on / off. ``aims``: the issue's targets, (a) TTFT p50 >= 3x lower and >= 2x the throughput,
(d) at most 3 % slower (wall on / off <= 1.03).

One JSON line on stdout (appended to ``results/bench_prefix_cache.jsonl``), a table on stderr.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time

import numpy as np
from benchlib import add_common_args, emit, greedy, host_info, log, resolve_model

# Per model: requests of (a), (c), (d); chat users and turns; lengths in tokens. stories260K's
# context is 512 (llama2.c seq_len): 400 + 32 + 32 output fits, so nothing is shrunk there.
# llama110m's requests and users are fewer so that the whole run stays near ten minutes on 2
# loaded cores (its prefill ran at ~155 tokens/s at a load average of 8-11).
SIZES = {
    "stories260K": dict(requests=64, users=16, turns=4),
    "llama110m": dict(requests=8, users=4, turns=4),
}
DEFAULT_SIZE = dict(requests=8, users=4, turns=4)
LENGTHS = dict(
    system=400,
    question=32,
    answer=32,
    header=300,
    shot_question=20,
    shot_answer=8,
    first_message=64,
    user_message=32,
    chat_answer=32,
)
QUICK_SIZE = dict(requests=4, users=2, turns=2)
QUICK_LENGTHS = dict(
    system=24,
    question=8,
    answer=4,
    header=20,
    shot_question=6,
    shot_answer=2,
    first_message=10,
    user_message=6,
    chat_answer=4,
)
WORKLOADS = ("system_prompt", "chat", "few_shot", "no_prefix")


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


# ---------------------------------------------------------------- workloads


class Tokens:
    """Seeded random token ids in [3, min(vocab, 512))."""

    def __init__(self, vocab: int, seed: int):
        self.rng, self.hi = np.random.default_rng(seed), min(vocab, 512)

    def __call__(self, n: int, bos: bool = False) -> list[int]:
        ids = self.rng.integers(3, self.hi, n - bos).tolist()
        return [1] + ids if bos else ids


def static_workloads(vocab: int, seed: int, size: dict, ln: dict) -> dict:
    """(prompt ids, max_tokens) lists of the single-wave workloads (a), (c), (d)."""
    tok, r = Tokens(vocab, seed), size["requests"]
    system = tok(ln["system"], bos=True)
    header = tok(ln["header"], bos=True)
    return {
        "system_prompt": [(system + tok(ln["question"]), ln["answer"]) for _ in range(r)],
        "few_shot": [(header + tok(ln["shot_question"]), ln["shot_answer"]) for _ in range(r)],
        "no_prefix": [
            (tok(ln["system"] + ln["question"], bos=True), ln["answer"]) for _ in range(r)
        ],
    }


def chat_messages(vocab: int, seed: int, size: dict, ln: dict) -> list[list[list[int]]]:
    """Per turn, per user: the new user message (turn 0: the first message, with BOS)."""
    tok = Tokens(vocab, seed + 1)
    return [
        [
            tok(ln["first_message"], bos=True) if k == 0 else tok(ln["user_message"])
            for _ in range(size["users"])
        ]
        for k in range(size["turns"])
    ]


# ---------------------------------------------------------------- passes


def cache_stats(llm) -> dict:
    keys = ("queried_tokens", "hit_tokens", "evictions")
    tot = {k: 0 for k in keys}
    for e in llm.engines:
        s = e.prefix_cache_stats()
        for k in keys:
            tot[k] += s[k]
    return tot


def clear_prefix_cache(llm) -> None:
    for e in llm.engines:
        e.kv_manager.clear_cache()  # nothing to clear with caching off


class CacheClock:
    """Host seconds spent in the prefix cache's bookkeeping: wraps, on each engine's KV
    manager's page pool, the methods only caching calls (``hash_pages``, ``match_prefix``,
    ``touch``, ``acquire``, ``cache_page``, ``record_lookup``; the plain pool of caching off has
    ``acquire`` alone, never called). An upper bound on what caching adds to a step's
    host work (async scheduling may hide it behind the device's)."""

    METHODS = ("hash_pages", "match_prefix", "touch", "acquire", "cache_page", "record_lookup")

    def __init__(self, llm):
        self.seconds = 0.0
        for e in llm.engines:
            pool = e.kv_manager.pool
            for m in self.METHODS:
                if hasattr(pool, m):
                    setattr(pool, m, self._timed(getattr(pool, m)))

    def _timed(self, f):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def run_pass(
    llm, clock: CacheClock, name: str, static: dict, chat: list, answer_len: int, collect=True
) -> tuple[dict, list]:
    """One cold-cache pass of workload ``name``: (figures, generated token ids per request).
    ``collect``: ``gc.collect()`` first (skipped by ``--quick``, whose figures are a smoke test:
    a full collection takes ~1 s in a process holding many compiled programs)."""
    clear_prefix_cache(llm)
    if collect:
        gc.collect()
    before = cache_stats(llm)
    host0 = clock.seconds
    waves = []
    if name == "chat":
        prev = [[] for _ in chat[0]]  # per user: the last prompt + its answer
        for msgs in chat:
            wave = [(p + m, answer_len) for p, m in zip(prev, msgs, strict=True)]
            outs, wall = generate(llm, wave)
            prev = [ids + o.token_ids for (ids, _), o in zip(wave, outs, strict=True)]
            waves.append((outs, wall))
    else:
        waves.append(generate(llm, static[name]))
    after = cache_stats(llm)
    outs = [o for w, _ in waves for o in w]
    wall = sum(t for _, t in waves)
    prompt = sum(o.metrics.prompt_tokens for o in outs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = np.asarray([o.metrics.ttft_s for o in outs], float)
    queried = after["queried_tokens"] - before["queried_tokens"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    fig = {
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "output_tok_s": n_out / wall,
        "wall_s": wall,
        "hit_rate": cached / prompt,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens_computed": prompt - cached,
        "output_tokens": n_out,
        "engine_hit_rate": hit / queried if queried else 0.0,
        "evictions": after["evictions"] - before["evictions"],
        "preemptions": sum(o.metrics.num_preemptions for o in outs),
        "cache_host_s": clock.seconds - host0,
    }
    return fig, [o.token_ids for o in outs]


def generate(llm, reqs: list) -> tuple[list, float]:
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    sps = [greedy(o) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, sps)
    return outs, time.perf_counter() - t


# ---------------------------------------------------------------- summary


def median_figures(runs: list[dict]) -> dict:
    """Per key, the median over the repeats (rounded); ``repeats`` keeps each repeat's TTFT p50,
    output tok/s and wall."""
    out = {}
    for k in runs[0]:
        v = float(np.median([r[k] for r in runs]))
        out[k] = (
            int(v)
            if k
            in (
                "prompt_tokens",
                "cached_tokens",
                "prefill_tokens_computed",
                "output_tokens",
                "evictions",
                "preemptions",
            )
            and v.is_integer()
            else round(v, 6 if k.endswith("_s") else 4)
        )
    out["repeats"] = [
        {k: round(r[k], 4) for k in ("ttft_p50_s", "output_tok_s", "wall_s")} for r in runs
    ]
    return out


def ratios(on: dict, off: dict) -> dict:
    r = lambda a, b: None if not b else round(a / b, 3)  # noqa: E731
    return {
        "ttft_p50_off_over_on": r(off["ttft_p50_s"], on["ttft_p50_s"]),
        "ttft_p99_off_over_on": r(off["ttft_p99_s"], on["ttft_p99_s"]),
        "output_tok_s_on_over_off": r(on["output_tok_s"], off["output_tok_s"]),
        "wall_on_over_off": r(on["wall_s"], off["wall_s"]),
    }


def aims(res: dict) -> dict:
    out = {}
    if "system_prompt" in res:
        q = res["system_prompt"]["ratio_on_vs_off"]
        out["system_prompt_ttft_p50_3x"] = q["ttft_p50_off_over_on"] >= 3
        out["system_prompt_throughput_2x"] = q["output_tok_s_on_over_off"] >= 2
    if "no_prefix" in res:
        out["no_prefix_at_most_3pct_slower"] = (
            res["no_prefix"]["ratio_on_vs_off"]["wall_on_over_off"] <= 1.03
        )
    return out


def table(model: str, res: dict) -> str:
    head = (
        f"{model:<12} {'workload':<14}{'cache':<5}{'TTFT p50':>10}{'p99':>9}{'tok/s':>9}"
        f"{'wall s':>8}{'hit':>7}{'prefill':>9}{'evict':>7}{'cache s':>9}"
    )
    lines = [head]
    for w, r in res.items():
        for s in ("on", "off"):
            f = r[s]
            lines.append(
                f"{'':<12} {w:<14}{s:<5}{f['ttft_p50_s']:>10.4f}{f['ttft_p99_s']:>9.4f}"
                f"{f['output_tok_s']:>9.1f}{f['wall_s']:>8.2f}{f['hit_rate']:>7.3f}"
                f"{f['prefill_tokens_computed']:>9}{f['evictions']:>7}{f['cache_host_s']:>9.4f}"
            )
        q = r["ratio_on_vs_off"]
        lines.append(
            f"{'':<12} {w:<14}     TTFT p50 off/on {q['ttft_p50_off_over_on']}x, "
            f"tok/s on/off {q['output_tok_s_on_over_off']}x, wall on/off "
            f"{q['wall_on_over_off']}, same tokens {r['same_tokens']}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def bench_model(name: str, args, size: dict, ln: dict) -> dict:
    from jaxinfer import LLM

    path, vocab, _ = resolve_model(name)
    static = static_workloads(vocab, args.seed, size, ln)
    chat = chat_messages(vocab, args.seed, size, ln)
    names = [w for w in WORKLOADS if w in args.workloads.split(",")]
    kw = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
    )
    t = time.perf_counter()
    llms = {
        "on": LLM(path, enable_prefix_caching=True, **kw),
        "off": LLM(path, enable_prefix_caching=False, **kw),
    }
    load_s = time.perf_counter() - t
    clocks = {s: CacheClock(llm) for s, llm in llms.items()}
    t = time.perf_counter()
    for w in names:  # warm-up: compiles every bucket each setting meets
        for s in ("on", "off"):
            run_pass(llms[s], clocks[s], w, static, chat, ln["chat_answer"], not args.quick)
    warmup_s = time.perf_counter() - t
    log(f"[prefix_cache] {name}: loaded in {load_s:.1f} s, warm-up {warmup_s:.1f} s")
    comp = {s: llm.num_compilations for s, llm in llms.items()}
    runs = {w: {"on": [], "off": []} for w in names}
    same = {w: True for w in names}
    for rep in range(args.repeats):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        for w in names:
            ids = {}
            for s in order:
                fig, ids[s] = run_pass(
                    llms[s], clocks[s], w, static, chat, ln["chat_answer"], not args.quick
                )
                runs[w][s].append(fig)
                log(
                    f"[prefix_cache] {name} {w} cache {s} repeat {rep}: "
                    f"TTFT p50 {fig['ttft_p50_s']:.4f} s, {fig['output_tok_s']:.1f} tok/s, "
                    f"hit {fig['hit_rate']:.3f}"
                )
            same[w] &= ids["on"] == ids["off"]
    res = {}
    for w in names:
        on, off = median_figures(runs[w]["on"]), median_figures(runs[w]["off"])
        res[w] = {"on": on, "off": off, "ratio_on_vs_off": ratios(on, off), "same_tokens": same[w]}
    entry = {
        "model": name,
        "sizes": {**size, **ln},
        "num_pages": llms["on"].engine.ecfg.num_pages,
        "page_size": llms["on"].engine.ecfg.page_size,
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "compilations": {s: comp[s] for s in llms},
        "compilations_in_measured_passes": sum(
            llm.num_compilations - comp[s] for s, llm in llms.items()
        ),
        "workloads": res,
        "aims": aims(res),
    }
    log(table(name, res))
    del llms
    if not args.quick:
        gc.collect()
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models",
        default="stories260K,llama110m",
        help="comma-separated: stories260K, llama110m, llama1b or paths",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    ap.add_argument("--repeats", type=int, default=2, help="measured rounds (median reported)")
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests of system_prompt, few_shot, no_prefix (default per model: "
        f"{ {k: v['requests'] for k, v in SIZES.items()} })",
    )
    ap.add_argument("--users", type=int, default=None, help="chat users (default per model)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=0.5,
        help="KV pool of each LLM, GiB (0.5: 910 pages of 8 tokens for llama110m)",
    )
    ap.add_argument("--dtype", default="float32")
    add_common_args(ap)
    args = ap.parse_args()
    bad = set(args.workloads.split(",")) - set(WORKLOADS)
    if bad:
        ap.error(f"--workloads: unknown {sorted(bad)}; choose from {list(WORKLOADS)}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    ln = dict(LENGTHS)
    if args.quick:
        args.models, args.max_model_len, args.max_num_seqs = "stories260K", 64, 8
        args.repeats, args.kv_cache_memory_gb, ln = 1, 0.01, dict(QUICK_LENGTHS)
    load_start = os.getloadavg()
    results = []
    for name in [m for m in args.models.split(",") if m]:
        size = dict(QUICK_SIZE if args.quick else SIZES.get(name, DEFAULT_SIZE))
        size["requests"] = args.requests or size["requests"]
        size["users"] = args.users or size["users"]
        results.append(bench_model(name, args, size, ln))
    summary = {
        "bench": "prefix_cache",
        "quick": args.quick,
        "seed": args.seed,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "results": results,
        "cpu": cpu_name(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        **host_info(),
    }
    emit(summary, "bench_prefix_cache", args.results_dir)


if __name__ == "__main__":
    main()
