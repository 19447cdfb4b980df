"""Quality, memory and decode speed of every quantization mode (issue 6).

    python scripts/bench_quant.py                       # stories260K and the random llama110m
    python scripts/bench_quant.py --models stories260K --decode-tokens 32

Per model and mode (float32, int8, w8a8, float32 + int8 KV, int8 + int8 KV): weight bytes, KV
bytes per token, greedy-token agreement with the float model over the stories260K reference
prompts (engine, greedy), mean NLL (nats/token) of the float model's own greedy continuations
under the mode (``dense_logits``, teacher-forced: no KV cache there, so an int8-KV mode has its
weight mode's NLL), and decode tokens/s at batch 1 and 32 against the bandwidth roofline
(weight bytes / measured read bandwidth of a large array, in the same run). Prints one JSON object
per model and appends it to results/bench_quant.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from benchlib import time_calls  # noqa: E402

MODES = {  # name: (quantization, kv_cache_dtype)
    "float32": (None, "auto"),
    "int8": ("int8", "auto"),
    "w8a8": ("w8a8", "auto"),
    "float32+kv8": (None, "int8"),
    "int8+kv8": ("int8", "int8"),
}


def bandwidth_gbs() -> float:
    big = jnp.ones((256 * 2**20 // 4,), jnp.float32)
    return big.nbytes / min(time_calls(jax.jit(jnp.sum), big, repeats=5)) / 1e9


def decode_tok_s(llm, batch: int, tokens: int) -> float:
    """Generated tokens per second of ``batch`` one-token prompts decoding ``tokens`` each (second
    run, compiled; prefill is one token per sequence)."""
    from jaxinfer import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[1, 10 + i] for i in range(batch)]
    llm.generate(prompts, sp)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def bench_formulations(rows_list=(1, 4, 32), repeats: int = 3) -> dict:
    """ms per forward step of the random ~110M Llama (D=768, L=12, F=2048, V=32000, untied head
    quantized too) with every quantized-matmul formulation forced, layers unstacked as the engine
    runs them on CPU; rows 1 = a batch-1 decode step, 4 = the smallest multi-row decode bucket."""
    from jaxinfer.models.attention import dense_attn_fn
    from jaxinfer.models.config import ModelConfig
    from jaxinfer.models.forward import compute_logits, forward
    from jaxinfer.models.params import init_random, unstack_layers
    from jaxinfer.quant import matmul as qm
    from jaxinfer.quant.tensor import quantize, weight_bytes

    cfg = ModelConfig("llama", 32000, 768, 2048, 12, 12, 12, 64)
    fp = init_random(cfg, jax.random.PRNGKey(0))
    cands = {
        "float32": (None, None),
        "int8:reduce_or": ("int8", "reduce_or"),
        "int8:reduce": ("int8", "reduce"),
        "int8:reduce_ro": ("int8", "reduce_ro"),
        "int8:dot": ("int8", "dot"),
        "int8:int_dot2": ("int8", "int_dot2"),
        "w8a8:reduce_or": ("w8a8", "reduce_or"),
        "w8a8:int_dot": ("w8a8", "int_dot"),
    }
    original = qm.choose_formulation
    out = {}
    try:
        for rows in rows_list:
            for name, (mode, form) in cands.items():
                if rows > 8 and form and form.startswith("reduce"):
                    continue  # row-by-row reductions: measured 11 s per step at 32 rows
                params = fp if mode is None else quantize(fp, mode, lm_head=True)
                params = unstack_layers(params)
                qm.choose_formulation = lambda act, r, backend=None, form=form: form

                def step(params, tokens, rows=rows):
                    seg = jnp.arange(rows, dtype=jnp.int32)
                    pos = jnp.zeros(rows, jnp.int32)
                    h, _ = forward(params, cfg, tokens, pos, None, dense_attn_fn(cfg, seg, pos))
                    return compute_logits(params, cfg, h)

                f = jax.jit(step)
                tokens = jnp.arange(rows, dtype=jnp.int32)
                ts = time_calls(f, params, tokens, repeats=repeats)
                out[f"rows{rows}:{name}"] = {
                    "ms": round(min(ts) * 1e3, 2),
                    "weight_bytes": weight_bytes(params),
                }
                print(
                    json.dumps({f"rows{rows}:{name}": out[f"rows{rows}:{name}"]}),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        qm.choose_formulation = original
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="stories260K,llama110m")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--ref-tokens", type=int, default=64, help="greedy tokens per reference prompt")
    ap.add_argument("--results", default=str(REPO / "results" / "bench_quant.jsonl"))
    ap.add_argument(
        "--formulations",
        action="store_true",
        help="only time the quantized-matmul formulations on the random ~110M Llama",
    )
    args = ap.parse_args()
    if args.formulations:
        bw = bandwidth_gbs()
        res = {
            "bench": "quant_formulations",
            "backend": jax.default_backend(),
            "bandwidth_gb_s": round(bw, 2),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "steps": bench_formulations(),
        }
        print(json.dumps(res), flush=True)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(res) + "\n")
        return

    from bench_generate import random_llama_dir

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.models.dense import dense_logits
    from jaxinfer.models.kv_cache import kv_bytes_per_token
    from jaxinfer.quant.tensor import weight_bytes

    shared = REPO.parent / "shared" / "models" / "stories260K"
    refs = json.loads((shared / "greedy_reference.json").read_text())
    prompts = [r["prompt"] for r in refs]
    bw = bandwidth_gbs()
    for model in args.models.split(","):
        path = shared if model == "stories260K" else random_llama_dir(model)
        rows, float_tokens = {}, None
        for mode in args.modes.split(","):
            quant, kv = MODES[mode]
            llm = LLM(
                path,
                max_num_seqs=32,
                max_model_len=256,
                quantization=quant,
                kv_cache_dtype=kv,
                compilation_cache=False,
            )
            sp = SamplingParams(temperature=0.0, max_tokens=args.ref_tokens, ignore_eos=True)
            outs = llm.generate(prompts, sp)
            toks = [(o.prompt_token_ids, o.token_ids) for o in outs]
            if float_tokens is None:
                float_tokens = toks
            agree = np.mean(
                [
                    a == b
                    for (_, f), (_, g) in zip(float_tokens, toks, strict=True)
                    for a, b in zip(f, g, strict=False)
                ]
            )
            # NLL of the float model's greedy continuations under this mode's weights.
            nll, n = 0.0, 0
            for p_ids, out_ids in float_tokens:
                seq = np.asarray(p_ids + out_ids, np.int32)[None]
                logits = dense_logits(llm.params, llm.config, jnp.asarray(seq))[0]
                lp = jax.nn.log_softmax(logits[len(p_ids) - 1 : -1], axis=-1)
                nll -= float(jnp.sum(jnp.take_along_axis(lp, jnp.asarray(out_ids)[:, None], 1)))
                n += len(out_ids)
            wb = weight_bytes(llm.params)
            kv_dtype = jnp.int8 if kv == "int8" else jnp.float32
            row = {
                "weight_bytes": wb,
                "kv_bytes_per_token": kv_bytes_per_token(llm.config, kv_dtype),
                "greedy_agreement": round(float(agree), 4),
                "mean_nll": round(nll / n, 4),
                "roofline_tok_s_b1": round(bw * 1e9 / wb, 1),
            }
            for b in map(int, args.batches.split(",")):
                row[f"decode_tok_s_b{b}"] = round(decode_tok_s(llm, b, args.decode_tokens), 2)
            rows[mode] = row
            print(json.dumps({"model": model, "mode": mode, **row}), file=sys.stderr, flush=True)
            del llm
        result = {
            "bench": "quant",
            "model": model,
            "backend": jax.default_backend(),
            "bandwidth_gb_s": round(bw, 2),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "decode_tokens": args.decode_tokens,
            "modes": rows,
        }
        print(json.dumps(result), flush=True)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
