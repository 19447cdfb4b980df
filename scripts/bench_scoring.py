"""Prompt-logprob overhead and ``LLM.score`` throughput against lm-evaluation-harness's ``hf`` model
(issue 20), one JSON line (``benchlib.emit``).

    python scripts/bench_scoring.py                      # llama110m (random ~110M Llama, HF dir)
    python scripts/bench_scoring.py --model stories260K --quick

1. Overhead: ``--requests`` (64) prompts of the seeded ShareGPT-like workload (``benchlib``),
   greedy, ``--max-tokens`` each, generated with and without ``prompt_logprobs=5`` (same engine,
   prefix caching off, one untimed warm-up pass each so compilations are not timed, then the
   best of two alternating timed passes); tok/s counts prompt + output tokens; ``overhead`` is
   time with / time without.
2. Scoring: ``--contexts`` contexts x ``--choices`` continuations (a multiple-choice shape),
   token ids, scored by ``LLM.score`` and by lm-eval's ``HFLM._loglikelihood_tokens`` (the
   ``hf`` model's loglikelihood after tokenization, batch ``--hf-batch-size``) on the same
   checkpoint in the same process (float32, this machine's backend; torch on CPU unless CUDA);
   jaxinfer twice: prefix caching off, then on (pairs sharing a context read its pages).
   Both get the same token ids, so tokenization is not timed on either side; the summed
   logprobs of the two are compared (max abs difference reported). Without lm-eval
   (``pip install -e .[eval]`` plus accelerate), transformers directly (a padded batch forward,
   log_softmax, gather), which the JSON says.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import benchlib as B
import numpy as np


def _workload(n: int, vocab: int, mean_input: int, rng) -> list[list[int]]:
    lens = np.clip(rng.lognormal(np.log(mean_input) - 0.32, 0.8, n).astype(int), 4, 4 * mean_input)
    return [[1, *rng.integers(3, min(vocab, 512), int(k) - 1).tolist()] for k in lens]


def overhead(llm, prompts, max_tokens: int, repeats: int = 2) -> dict:
    """tok/s of the prompts generated without and with prompt logprobs: both warmed up first
    (compilations), then timed alternately ``repeats`` times each; the best time counts."""
    from jaxinfer.sampling.sampler import SamplingParams

    variants = {
        name: SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k
        )
        for name, k in (("without", None), ("with", 5))
    }
    for sp in variants.values():
        llm.generate(prompts, sp)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, sp in variants.items():
            t = time.perf_counter()
            res = llm.generate(prompts, sp)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            assert all(r.error is None for r in res)
    toks = sum(len(r.prompt_token_ids) + len(r.token_ids) for r in res)
    out = {
        name: {"seconds": round(dt, 3), "tok_s": round(toks / dt, 1)} for name, dt in best.items()
    }
    out["tokens"] = toks
    out["prompt_tokens"] = sum(len(r.prompt_token_ids) for r in res)
    out["overhead"] = B.ratio(best["with"], best["without"])
    return out


def _pairs(n_ctx: int, choices: int, ctx_len: int, cont_len: int, vocab: int, rng):
    pairs = []
    for _ in range(n_ctx):
        ctx = [1, *rng.integers(3, min(vocab, 512), ctx_len - 1).tolist()]
        for _ in range(choices):
            pairs.append((ctx, rng.integers(3, min(vocab, 512), cont_len).tolist()))
    return pairs


def hf_scores(hf_dir, pairs, batch_size: int) -> tuple[list[float], str, float]:
    """(summed logprobs, which reference, seconds) of the pairs under transformers."""
    import torch

    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        HFLM = None
    if HFLM is not None:
        tok_dir = Path(hf_dir)
        if not (tok_dir / "tokenizer.model").exists():  # stories260K-hf: tokenizer beside it
            tok_dir = Path(tempfile.mkdtemp())
            shutil.copy(Path(hf_dir) / "config.json", tok_dir / "config.json")
            shutil.copy(B.STORIES / "tok512.model", tok_dir / "tokenizer.model")
        lm = HFLM(
            pretrained=str(hf_dir),
            tokenizer=str(tok_dir),
            batch_size=batch_size,
            dtype="float32",
            device="cuda" if torch.cuda.is_available() else "cpu",
        )
        reqs = [(("", ""), list(c), list(x)) for c, x in pairs]
        lm._loglikelihood_tokens(reqs[:batch_size], disable_tqdm=True)  # warm-up
        t = time.perf_counter()
        res = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
        return (
            [float(r[0]) for r in res],
            "lm_eval HFLM._loglikelihood_tokens",
            time.perf_counter() - t,
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    t = time.perf_counter()
    out = []
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            seqs = [c + x for c, x in chunk]
            n = max(map(len, seqs))
            ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
            lp = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)
            for j, (c, x) in enumerate(chunk):
                pos = torch.arange(len(c) - 1, len(c) + len(x) - 1)
                out.append(float(lp[j, pos, torch.tensor(x)].sum()))
    return out, "transformers forward (lm-eval not installed)", time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    B.add_common_args(ap)
    ap.add_argument("--model", default="llama110m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--mean-input", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--contexts", type=int, default=16)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--context-len", type=int, default=48)
    ap.add_argument("--continuation-len", type=int, default=6)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.requests, args.contexts = "stories260K", 16, 4
    from jaxinfer import LLM

    path, vocab, hf_dir = B.resolve_model(args.model, hf=True)
    rng = np.random.default_rng(args.seed)
    # Prefix caching off: a timed pass must not read pages its warm-up pass cached (requests with
    # prompt logprobs never read them, so the comparison would be skewed).
    llm = LLM(
        path,
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )
    summary = {
        "bench": "scoring",
        "model": args.model,
        **B.host_info(),
        "load_avg": os.getloadavg(),
        "args": vars(args),
    }
    B.log("overhead ...")
    summary["prompt_logprobs_overhead"] = overhead(
        llm, _workload(args.requests, vocab, args.mean_input, rng), args.max_tokens
    )
    pairs = _pairs(args.contexts, args.choices, args.context_len, args.continuation_len, vocab, rng)
    B.log("score ...")
    llm.score(pairs)  # warm-up
    t = time.perf_counter()
    res = llm.score(pairs)
    dt = time.perf_counter() - t
    assert all(r.error is None for r in res)
    # The same with prefix caching on (the default): pairs sharing a context read its full
    # pages (prompt_logprobs_from); the cache is emptied after the warm-up pass, so the timed
    # pass shares contexts only within itself.
    del llm
    llm = LLM(path, max_model_len=512, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024)
    llm.score(pairs)
    for e in llm.engines:
        e.kv_manager.clear_cache()
    before = llm.prefix_cache_stats()["hit_tokens"]
    t = time.perf_counter()
    res_on = llm.score(pairs)
    dt_on = time.perf_counter() - t
    assert [r.num_tokens for r in res_on] == [r.num_tokens for r in res]
    B.log("hf ...")
    ref, which, hf_dt = hf_scores(hf_dir, pairs, args.hf_batch_size)
    summary["score"] = {
        "pairs": len(pairs),
        "jaxinfer_pairs_s": round(len(pairs) / dt, 2),
        "jaxinfer_prefix_caching_pairs_s": round(len(pairs) / dt_on, 2),
        "prefix_cached_tokens": llm.prefix_cache_stats()["hit_tokens"] - before,
        "hf_pairs_s": round(len(pairs) / hf_dt, 2),
        "hf_reference": which,
        "speedup": B.ratio(hf_dt, dt),
        "speedup_prefix_caching": B.ratio(hf_dt, dt_on),
        "max_abs_logprob_diff": float(np.max(np.abs(np.array([r.logprob for r in res]) - ref))),
    }
    summary["load_avg_end"] = os.getloadavg()
    B.emit(summary, "bench_scoring", args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
