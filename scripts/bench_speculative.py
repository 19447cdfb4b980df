"""Speculative decoding on stories260K: acceptance rate, mean tokens per round and wall-clock
speedup over plain decoding, per drafter and R, at batch 1 and batch 16 (greedy).

Prints one JSON object per configuration and appends it to results/bench_speculative.jsonl.
Each configuration is run twice; the second (compiled) run is timed. Defaults (48 new tokens,
drafters ngram, draft-model layers:4 and self, heads; R 2 4 8; batch 1 and 16) take ~10 min on
a loaded 2-core CPU.

    python scripts/bench_speculative.py [--heads results/heads_stories260K] [--rs 2 4 8]
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxinfer.llm import LLM
from jaxinfer.sampling.sampler import SamplingParams
from jaxinfer.speculative.strategy import make_spec_engine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Once upon a time",
    "Lily",
    "The cat sat on the mat and looked at the big red ball.",
    "Once",
    "Tom had a toy car.",
    "One day, a little bird flew into the garden and saw a shiny",
    "Sam and Ben",
    "The sun",
    "There was a big tree in the park.",
    "Mia liked to paint",
    "A dog",
    "Once upon a time, in a small town, there lived a kind old man",
    "The girl",
    "Ben saw a frog.",
    "Max wanted to fly",
    "It was a rainy day.",
]


def timed(llm, engine, prompts, sp):
    llm.engines, llm.engine = [engine], engine
    llm.generate(prompts, sp)  # compile
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    return time.perf_counter() - t0, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/stories260K"))
    ap.add_argument("--heads", default=str(ROOT / "results/heads_stories260K"))
    ap.add_argument(
        "--drafts",
        nargs="+",
        default=["layers:4", "self"],
        help="draft models of the draft-model drafter (one row set each)",
    )
    ap.add_argument("--rs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--methods", nargs="+", default=["ngram", "draft-model", "heads"])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "results/bench_speculative.jsonl"))
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=16, max_model_len=args.max_tokens + 48)
    base = llm.engines[0]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for bsz in args.batches:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:bsz]]
        t_plain, ref = timed(llm, base, prompts, sp)
        n_tok = sum(len(o.token_ids) for o in ref)
        for method in args.methods:
            if method == "heads" and not (Path(args.heads) / "heads").exists():
                continue
            for draft, r in [
                (d, r)
                for d in (args.drafts if method == "draft-model" else [None])
                for r in args.rs
            ]:
                eng = make_spec_engine(base, method, r, draft, args.heads)
                t, outs = timed(llm, eng, prompts, sp)
                rounds = sum(o.metrics.spec_rounds for o in outs)
                acc = [o.metrics.acceptance_rate for o in outs]
                rec = {
                    "model": Path(args.model).name,
                    "method": method,
                    "draft": draft
                    if method == "draft-model"
                    else (args.heads if method == "heads" else "ngram(3..1)"),
                    "R": r,
                    "batch": bsz,
                    "tokens": n_tok,
                    "acceptance_rate": float(np.mean(acc)),
                    "mean_tokens_per_round": (n_tok - len(outs))
                    / max(rounds, 1),  # first token: prefill
                    "mean_accepted_per_round": float(
                        np.mean([o.metrics.mean_accepted_tokens for o in outs])
                    ),
                    "plain_s": t_plain,
                    "spec_s": t,
                    "speedup": t_plain / t,
                    "greedy_identical": [o.token_ids for o in outs] == [o.token_ids for o in ref],
                }
                print(json.dumps(rec), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
