"""Serving throughput and latency: the engine beside Hugging Face transformers, same run, weights.

    python scripts/bench_serving.py                         # stories260K, llama110m, llama1b
    python scripts/bench_serving.py --models llama110m --num-prompts 64
    python scripts/bench_serving.py --quick                 # smoke test, seconds
    python scripts/bench_serving.py --batch-invariant --hf-dtypes ''  # the mode's cost

For each model, N requests (``benchlib.make_workload``: ShareGPT-like log-normal lengths, seeded)
all arrive at t=0 and run greedy with ``ignore_eos`` to their own ``max_tokens``:

- engine: ``LLM.generate`` over all prompts at once (continuous batching), in ``--engine-dtype``
  (float32 by default, the fast dtype on CPU). A first pass over the same workload compiles every
  bucket and is reported apart (``engine_cold_wall_s``); the measured pass reuses the compiled code.
  TTFT and TPOT come from ``RequestOutput.metrics``.
- transformers: ``AutoModelForCausalLM.from_pretrained`` of the same Hugging Face directory (for
  stories260K a conversion of the same weights), ``model.generate`` the way users call it: static
  batches of ``--hf-batch-size`` prompts in workload order, left-padded, greedy, ``max_new_tokens``
  = the batch's largest request; only each request's own requested tokens count as output. Run in
  float32 (same dtype as the engine) and in bfloat16 (transformers' best CPU configuration), with
  ``torch.set_num_threads(--torch-threads)``. A streamer object whose ``put()`` transformers calls
  once per generated step timestamps the steps: request i of a batch gets TTFT = first step time -
  t0 (t0: start of the whole transformers run, since all requests arrive at t=0) and TPOT =
  (time of its last requested step - its first) / (requested tokens - 1).

On a GPU, ``--hf-device cuda`` runs transformers there, and ``--hf-generate-batch`` adds
transformers' own continuous batching (``model.generate_batch``, one call over all requests,
``max_new_tokens`` the largest request's; throughput only), reported as ``<dtype>_generate_batch``.

With ``--batch-invariant`` the engine also runs the same workload with
``LLM(batch_invariant=True)`` (``jaxinfer.models.batch_invariant``), reported as
``engine_batch_invariant``
with ``batch_invariant_cost``: its throughput and latencies over the default engine's, and the
fraction of requests whose greedy tokens are the same in both modes.

Reported per model: requests/s, output tokens/s, TTFT and TPOT (mean, p50, p99, seconds), and the
ratios engine / transformers (throughput: higher is better for the engine; latency: lower is). One
JSON line on stdout, appended to ``results/bench_serving.jsonl``.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
from benchlib import (
    add_common_args,
    emit,
    greedy,
    host_info,
    log,
    make_workload,
    ratio,
    resolve_model,
    stats,
)

DEFAULT_PROMPTS = {"stories260K": 64, "llama110m": 64, "llama1b": 8}


def run_engine(
    path,
    reqs,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    warmup: bool,
    batch_invariant: bool = False,
) -> dict:
    from jaxinfer import LLM

    t = time.perf_counter()
    llm = LLM(
        path,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        batch_invariant=batch_invariant,
    )
    load_s = time.perf_counter() - t
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    sps = [greedy(o) for _, o in reqs]
    cold_wall = None
    if warmup:
        t = time.perf_counter()
        llm.generate(prompts, sps)
        cold_wall = time.perf_counter() - t
    comp_before = llm.num_compilations
    t = time.perf_counter()
    outs = llm.generate(prompts, sps)
    wall = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    res = {
        "dtype": dtype,
        "batch_invariant": batch_invariant,
        "wall_s": round(wall, 3),
        "requests_s": round(len(reqs) / wall, 3),
        "output_tok_s": round(n_out / wall, 2),
        "output_tokens": n_out,
        "ttft_s": stats([o.metrics.ttft_s for o in outs]),
        "tpot_s": stats([o.metrics.tpot_s for o in outs if len(o.token_ids) > 1]),
        "cold_wall_s": None if cold_wall is None else round(cold_wall, 3),
        "load_s": round(load_s, 3),
        "compilations": llm.num_compilations,
        "compilations_in_measured_pass": llm.num_compilations - comp_before,
        "preemptions": sum(e.scheduler.num_preemptions for e in llm.engines),
    }
    token_ids = [o.token_ids for o in outs]
    del llm, outs
    gc.collect()
    return res, token_ids


def run_hf(
    hf_dir, reqs, *, dtype: str, batch_size: int, threads: int, device: str = "cpu"
) -> tuple[dict, list]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        """Timestamps each generated step (the first ``put`` is the prompt)."""

        def __init__(self):
            self.times, self.seen_prompt = [], False

        def put(self, value):
            if self.seen_prompt:
                self.times.append(time.perf_counter())
            self.seen_prompt = True

        def end(self):
            pass

    torch.set_num_threads(threads)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    model = model.to(device)
    load_s = time.perf_counter() - t
    pad = 0

    def gen(batch, max_new, streamer=None):
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (ids, _) in enumerate(batch):  # left padding, as decoder-only generation needs
            input_ids[r, width - len(ids) :] = torch.tensor(ids)
            mask[r, width - len(ids) :] = 1
        cfg = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
            bos_token_id=1,
        )
        with torch.inference_mode():
            return model.generate(
                input_ids.to(device),
                attention_mask=mask.to(device),
                generation_config=cfg,
                streamer=streamer,
            )[:, width:]

    gen(reqs[:1], 2)  # warm-up (allocator, thread pool); transformers compiles nothing
    ttft, tpot, token_ids, n_out = [], [], [], 0
    t0 = time.perf_counter()
    for s in range(0, len(reqs), batch_size):
        batch = reqs[s : s + batch_size]
        clock = StepClock()
        out = gen(batch, max(o for _, o in batch), clock)
        for r, (_, o) in enumerate(batch):
            ttft.append(clock.times[0] - t0)
            if o > 1:
                tpot.append((clock.times[o - 1] - clock.times[0]) / (o - 1))
            token_ids.append(out[r, :o].tolist())
            n_out += o
    wall = time.perf_counter() - t0
    res = {
        "dtype": dtype,
        "batch_size": batch_size,
        "threads": threads,
        "device": device,
        "wall_s": round(wall, 3),
        "requests_s": round(len(reqs) / wall, 3),
        "output_tok_s": round(n_out / wall, 2),
        "output_tokens": n_out,
        "ttft_s": stats(ttft),
        "tpot_s": stats(tpot),
        "load_s": round(load_s, 3),
    }
    return res, token_ids


def run_hf_continuous(hf_dir, reqs, *, dtype: str, device: str) -> tuple[dict, list]:
    """transformers' own continuous batching, ``model.generate_batch`` (transformers 5), over all
    requests at once, greedy. generate_batch takes one GenerationConfig for all requests, so
    ``max_new_tokens`` is the largest request's; only each request's own tokens count as output
    (the extra tokens transformers generates are its cost). No per-step timestamps: throughput
    only."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    model = model.to(device)
    load_s = time.perf_counter() - t
    cfg = GenerationConfig(
        max_new_tokens=max(o for _, o in reqs),
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=1,
    )
    with torch.inference_mode():
        warm = GenerationConfig(
            max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        model.generate_batch([reqs[0][0]], generation_config=warm)  # warm-up
        t0 = time.perf_counter()
        outs = model.generate_batch([ids for ids, _ in reqs], generation_config=cfg)
        wall = time.perf_counter() - t0
    got = list(outs.values())
    if len(got) != len(reqs):
        raise RuntimeError(f"generate_batch returned {len(got)} results for {len(reqs)} requests")
    token_ids = [list(g.generated_tokens)[:o] for g, (_, o) in zip(got, reqs, strict=True)]
    n_out = sum(len(x) for x in token_ids)
    res = {
        "dtype": dtype,
        "device": device,
        "mode": "generate_batch",
        "wall_s": round(wall, 3),
        "requests_s": round(len(reqs) / wall, 3),
        "output_tok_s": round(n_out / wall, 2),
        "output_tokens": n_out,
        "max_new_tokens_all": cfg.max_new_tokens,
        "load_s": round(load_s, 3),
    }
    del model
    gc.collect()
    return res, token_ids


def compare(eng: dict, hf: dict) -> dict:
    """engine / transformers: >1 is better for throughput, <1 is better for latency."""
    return {
        "output_tok_s": ratio(eng["output_tok_s"], hf["output_tok_s"]),
        "requests_s": ratio(eng["requests_s"], hf["requests_s"]),
        "ttft_p50": ratio(eng["ttft_s"]["p50"], hf["ttft_s"]["p50"]),
        "ttft_p99": ratio(eng["ttft_s"]["p99"], hf["ttft_s"]["p99"]),
        "tpot_p50": ratio(eng["tpot_s"]["p50"], hf["tpot_s"]["p50"]),
        "tpot_p99": ratio(eng["tpot_s"]["p99"], hf["tpot_s"]["p99"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models",
        default="stories260K,llama110m,llama1b",
        help="comma-separated: stories260K, llama110m, llama1b or paths",
    )
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests per model (default per model: {DEFAULT_PROMPTS}, else 16)",
    )
    ap.add_argument("--mean-input", type=float, default=64, help="mean prompt length, tokens")
    ap.add_argument("--mean-output", type=float, default=96, help="mean output length, tokens")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="engine: most running sequences")
    ap.add_argument("--engine-dtype", default="float32")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers runs ('' skips)")
    ap.add_argument("--hf-batch-size", type=int, default=8, help="transformers static batch size")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--hf-device", default="cpu", help="torch device of transformers (cuda on GPU)")
    ap.add_argument(
        "--hf-generate-batch",
        action="store_true",
        help="also transformers' continuous batching (model.generate_batch)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run the engine with LLM(batch_invariant=True) and report its cost",
    )
    ap.add_argument(
        "--no-engine-warmup",
        action="store_true",
        help="measure the engine's first pass (compilations included)",
    )
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.models, args.num_prompts, args.mean_input, args.mean_output = "stories260K", 4, 12, 8
        args.max_model_len, args.hf_batch_size, args.hf_dtypes = 64, 4, "float32"
        args.max_num_seqs = 8  # quick runs share buckets (and compiled code) across scripts

    results = []
    for name in [m for m in args.models.split(",") if m]:
        path, vocab, hf_dir = resolve_model(name, hf=bool(args.hf_dtypes))
        n = args.num_prompts or DEFAULT_PROMPTS.get(name, 16)
        reqs = make_workload(
            n,
            max_model_len=args.max_model_len,
            vocab=vocab,
            seed=args.seed,
            mean_input=args.mean_input,
            mean_output=args.mean_output,
        )
        log(
            f"[serving] {name}: {n} requests, {sum(len(i) for i, _ in reqs)} prompt tokens, "
            f"{sum(o for _, o in reqs)} output tokens"
        )
        eng, eng_ids = run_engine(
            path,
            reqs,
            dtype=args.engine_dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            warmup=not args.no_engine_warmup,
        )
        log(f"[serving] {name} engine: {eng['output_tok_s']} tok/s")
        entry = {
            "model": name,
            "num_prompts": n,
            "prompt_tokens": sum(len(i) for i, _ in reqs),
            "engine": eng,
            "hf": {},
            "ratio": {},
        }
        if args.batch_invariant:
            inv, inv_ids = run_engine(
                path,
                reqs,
                dtype=args.engine_dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                warmup=not args.no_engine_warmup,
                batch_invariant=True,
            )
            entry["engine_batch_invariant"] = inv
            entry["batch_invariant_cost"] = {
                **{k: v for k, v in compare(inv, eng).items() if not k.startswith("requests")},
                "same_tokens_as_default": round(
                    float(np.mean([a == b for a, b in zip(inv_ids, eng_ids, strict=True)])), 3
                ),
            }
            log(f"[serving] {name} engine, batch invariant: {inv['output_tok_s']} tok/s")
        if hf_dir is None and args.hf_dtypes:
            entry["hf_skipped"] = f"{path} is not a Hugging Face directory"
        for dt in [d for d in args.hf_dtypes.split(",") if d and hf_dir is not None]:
            hf, hf_ids = run_hf(
                hf_dir,
                reqs,
                dtype=dt,
                batch_size=args.hf_batch_size,
                threads=args.torch_threads,
                device=args.hf_device,
            )
            # Greedy agreement (informational: random weights have near-tied logits).
            hf["same_tokens_as_engine"] = round(
                float(np.mean([a == b for a, b in zip(eng_ids, hf_ids, strict=True)])), 3
            )
            entry["hf"][dt] = hf
            entry["ratio"][dt] = compare(eng, hf)
            log(f"[serving] {name} transformers {dt}: {hf['output_tok_s']} tok/s")
            if args.hf_generate_batch:
                try:
                    cb, cb_ids = run_hf_continuous(hf_dir, reqs, dtype=dt, device=args.hf_device)
                    cb["same_tokens_as_engine"] = round(
                        float(np.mean([a == b for a, b in zip(eng_ids, cb_ids, strict=True)])), 3
                    )
                    entry["hf"][dt + "_generate_batch"] = cb
                    entry["ratio"][dt + "_generate_batch"] = {
                        "output_tok_s": ratio(eng["output_tok_s"], cb["output_tok_s"])
                    }
                    log(
                        f"[serving] {name} transformers generate_batch {dt}: "
                        f"{cb['output_tok_s']} tok/s"
                    )
                except Exception as e:  # reported in the JSON, the run goes on
                    entry["hf"][dt + "_generate_batch"] = {"error": f"{type(e).__name__}: {e}"}
        results.append(entry)

    summary = {
        "bench": "serving",
        "quick": args.quick,
        "seed": args.seed,
        "workload": {
            "mean_input": args.mean_input,
            "mean_output": args.mean_output,
            "max_model_len": args.max_model_len,
            "distribution": "lognormal sigma 0.8 in / 0.6 out",
        },
        "engine_dtype": args.engine_dtype,
        "batch_invariant": args.batch_invariant,
        "hf_batch_size": args.hf_batch_size,
        "results": results,
        **host_info(),
    }
    emit(summary, "bench_serving", args.results_dir)


if __name__ == "__main__":
    main()
