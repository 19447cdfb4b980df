"""Decode throughput against the memory-bandwidth roofline, bandwidth measured in the same run.

    python scripts/bench_roofline.py                     # stories260K, llama110m; batch 1 and 16
    python scripts/bench_roofline.py --sweep             # batch 1, 2, 4, ..., 64 (for the plot)
    python scripts/bench_roofline.py --quick

Bandwidth: ``jnp.sum`` of a ``--bandwidth-mb`` float32 array under ``jit``; the best (minimum) time
over ``--bandwidth-repeats`` runs gives bytes / second.

Decode: B requests (prompts of ``--prompt-len`` random tokens, greedy, ``ignore_eos``) are added to
the engine (``llm.engine``) and stepped until every one has finished its prefill; then
``--warmup-steps`` decode-only steps are run untimed and ``--steps`` decode-only steps are timed one
by one (``EngineCore.step`` returns after the sampled tokens reach the host). Steps during which the
engine compiled (its ``compile_keys`` grew) are dropped. Decode tok/s = B / median step time.

Roofline: a decode step must read every weight once and the K/V of every live token once, so
bytes per step = weight bytes (every leaf of the params pytree, quantization scales included) +
live tokens x KV bytes per token slot (``benchlib.kv_slot_bytes``; live tokens averaged over the
timed steps), and the roofline tok/s = B x bandwidth / bytes per step. Reported: decode tok/s,
roofline tok/s and their ratio (%).
Matmul floor (``matmul_floor``): a jitted chain of one-row matmuls over the same weights, the
least time an XLA batch-1 step can take; its % of the weights-only roofline is the ceiling of the
batch-1 figure on this backend.
With ``LLM(quantization=...)`` available (detected through ``inspect.signature``), the same for
each quantization mode. One JSON line on stdout, appended to ``results/bench_roofline.jsonl``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import time

import numpy as np
from benchlib import (
    add_common_args,
    emit,
    greedy,
    host_info,
    kv_slot_bytes,
    log,
    resolve_model,
    time_calls,
)


def measure_bandwidth(megabytes: int, repeats: int) -> dict:
    """Read bandwidth in bytes/s: best time of a jitted ``jnp.sum`` over a float32 array."""
    import jax
    import jax.numpy as jnp

    n = megabytes * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    best = min(time_calls(jax.jit(jnp.sum), x, repeats=repeats))
    del x
    return {
        "bytes": n * 4,
        "best_s": round(best, 6),
        "bytes_s": n * 4 / best,
        "gb_s": round(n * 4 / best / 1e9, 3),
    }


def matmul_floor(params, repeats: int) -> dict | None:
    """Time of a jitted chain of one-row products over every float weight of ``params`` (each
    leaf of >= 2 dims read once as ``x f32[1, I] . W[O, I]``, its leading dim the output as in
    the engine's CPU layout; each product feeds the next): a batch-1 decode step runs these
    products and more, so with XLA's matmuls on this backend it cannot beat this time. None when
    a weight is not floating point (quantized modes). Median and best over ``repeats`` runs."""
    import jax
    import jax.numpy as jnp

    mats = [x.reshape(x.shape[0], -1) for x in jax.tree.leaves(params) if x.ndim >= 2]
    if any(not jnp.issubdtype(m.dtype, jnp.floating) for m in mats):
        return None
    width = max(m.shape[1] for m in mats)

    @jax.jit
    def chain(mats, x):
        for m in mats:
            o, i = m.shape
            y = jnp.einsum(
                "RI,OI->RO", x[:, :i].astype(m.dtype), m, preferred_element_type=jnp.float32
            )
            x = x + 1e-6 * (y[:, :width] if o >= width else jnp.pad(y, ((0, 0), (0, width - o))))
        return x

    times = time_calls(chain, mats, jnp.full((1, width), 1e-3, jnp.float32), repeats=repeats)
    return {"step_s_p50": round(float(np.median(times)), 6), "step_s_best": round(min(times), 6)}


def quantization_modes(requested: str) -> list[dict]:
    """``LLM`` keyword sets to run: unquantized, then each weight quantization mode and the int8
    KV cache, where ``LLM`` accepts them (``quantization=``, ``kv_cache_dtype=``; detected through
    ``inspect.signature``, so this runs before and after they exist). ``requested``: "all",
    "none" or a comma-separated list of weight modes and "kv-int8"."""
    from jaxinfer import LLM

    params = inspect.signature(LLM.__init__).parameters
    out: list[dict] = [{}]
    want = None if requested == "all" else {m for m in requested.split(",") if m}
    if "quantization" in params:
        try:
            from jaxinfer.quant import MODES
        except ImportError:
            MODES = ()
        out += [{"quantization": m} for m in MODES if want is None or m in want]
    if "kv_cache_dtype" in params and (want is None or "kv-int8" in want):
        out.append({"kv_cache_dtype": "int8"})
    return out


def decode_rate(
    llm, batch: int, *, prompt_len: int, warmup: int, steps: int, vocab: int, seed: int
) -> dict:
    """Steady-state decode of ``batch`` sequences on ``llm.engine``; see the module docstring."""
    eng = llm.engine
    rng = np.random.default_rng(seed)
    total = warmup + steps + 1
    for i in range(batch):
        ids = [1] + rng.integers(3, min(vocab, 512), prompt_len - 1).tolist()
        eng.add_request(f"roofline-{batch}-{i}-{time.monotonic_ns()}", ids, greedy(total))
    sched = eng.scheduler

    def decode_only() -> bool:  # every prompt computed (a token may be in flight: async)
        return not sched.waiting and all(
            s.num_computed >= len(s.prompt_ids) and s.num_tokens - s.num_computed <= 1
            for s in sched.running
        )

    while not decode_only():
        eng.step()
    for _ in range(warmup):
        eng.step()
    times, live = [], []
    for _ in range(steps):
        if not decode_only() or len(sched.running) != batch:
            break
        keys = len(eng.compile_keys)
        n_live = sum(
            len(s.prompt_ids) + len(s.output_ids) for s in sched.running
        )  # K/V read by the step whose tokens this call returns (its input token's included)
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        if len(eng.compile_keys) == keys:
            times.append(dt)
            live.append(n_live)
    while eng.has_unfinished():
        eng.step()
    if not times:
        raise RuntimeError(
            f"batch {batch}: no decode-only step without a compilation was timed; raise --steps"
        )
    kv_tok = kv_slot_bytes(eng)
    step_s = float(np.median(times))
    return {
        "batch": batch,
        "timed_steps": len(times),
        "step_s_p50": round(step_s, 6),
        "step_s_mean": round(float(np.mean(times)), 6),
        "tok_s": round(batch / step_s, 2),
        "live_kv_tokens": round(float(np.mean(live)), 1),
        "kv_bytes": float(np.mean(live)) * kv_tok,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="stories260K,llama110m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated decode batch sizes")
    ap.add_argument("--sweep", action="store_true", help="batch sizes 1, 2, 4, ..., --max-batch")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument(
        "--bandwidth-mb", type=int, default=512, help="array read for the bandwidth, MiB"
    )
    ap.add_argument("--bandwidth-repeats", type=int, default=10)
    ap.add_argument(
        "--quantization",
        default="all",
        help="'all' (every mode LLM accepts), 'none', or a list of weight modes and 'kv-int8'",
    )
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.quantization = "none" if args.quantization == "all" else args.quantization
        args.models, args.batch_sizes, args.sweep = "stories260K", "1,4", False
        args.warmup_steps, args.steps, args.bandwidth_mb, args.bandwidth_repeats = 2, 6, 64, 3
        args.max_model_len = 64
    sizes = (
        [2**i for i in range(args.max_batch.bit_length()) if 2**i <= args.max_batch]
        if args.sweep
        else [int(b) for b in args.batch_sizes.split(",")]
    )

    from jaxinfer import LLM

    bw = measure_bandwidth(args.bandwidth_mb, args.bandwidth_repeats)
    log(f"[roofline] bandwidth {bw['gb_s']} GB/s")
    results = []
    for name in [m for m in args.models.split(",") if m]:
        path, vocab, _ = resolve_model(name)
        for kw in quantization_modes(args.quantization):
            mode = kw.get("quantization") or (
                "kv-" + kw["kv_cache_dtype"] if "kv_cache_dtype" in kw else None
            )
            llm = LLM(
                path,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=8 if args.quick else max(64, max(sizes)),
                **kw,
            )
            import jax

            weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(llm.params))
            floor = matmul_floor(llm.params, 8 if args.quick else 20)
            if floor is not None:
                weight_s = weight_bytes / bw["bytes_s"]
                floor["pct_of_weight_roofline"] = round(100 * weight_s / floor["step_s_p50"], 1)
                log(
                    f"[roofline] {name} {mode or args.dtype}: the weights' one-row matmuls alone "
                    f"take {floor['step_s_p50'] * 1e3:.2f} ms (p50), "
                    f"{floor['pct_of_weight_roofline']} % of the weights' roofline"
                )
            rows = []
            for b in sizes:
                r = decode_rate(
                    llm,
                    b,
                    prompt_len=args.prompt_len,
                    warmup=args.warmup_steps,
                    steps=args.steps,
                    vocab=vocab,
                    seed=args.seed,
                )
                step_bytes = weight_bytes + r["kv_bytes"]
                roof = b * bw["bytes_s"] / step_bytes
                r.update(
                    bytes_per_step=int(step_bytes),
                    roofline_tok_s=round(roof, 2),
                    pct_of_roofline=round(100 * r["tok_s"] / roof, 1),
                )
                r["kv_bytes"] = int(r["kv_bytes"])
                rows.append(r)
                log(
                    f"[roofline] {name} {mode or args.dtype} batch {b}: {r['tok_s']} tok/s, "
                    f"{r['pct_of_roofline']} % of {r['roofline_tok_s']}"
                )
            results.append(
                {
                    "model": name,
                    "dtype": args.dtype,
                    "quantization": mode,
                    "weight_bytes": weight_bytes,
                    "compilations": llm.num_compilations,
                    "matmul_floor": floor,
                    "decode": rows,
                }
            )
            del llm
            gc.collect()

    summary = {
        "bench": "roofline",
        "quick": args.quick,
        "bandwidth_gb_s": bw["gb_s"],
        "bandwidth": bw,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "results": results,
        **host_info(),
    }
    emit(summary, "bench_roofline", args.results_dir)


if __name__ == "__main__":
    main()
