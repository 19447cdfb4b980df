"""``jaxinfer quantize``: load a float checkpoint, quantize it to int8, save it with orbax.

jaxinfer quantize --model ../shared/models/stories260K --out stories260K-int8
jaxinfer generate --model stories260K-int8 --prompts prompts.txt --out out.jsonl
"""

from __future__ import annotations

import argparse
import json
import time


def add_quantize_parser(sub) -> argparse.ArgumentParser:
    """Adds the ``quantize`` subcommand to the CLI's subparsers."""
    q = sub.add_parser(
        "quantize",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        usage="%(prog)s --model PATH --out DIR [options]",
        help="quantize a checkpoint to int8 and save it (orbax), so later starts load int8",
        description="Quantize every linear weight of --model to int8 (per-output-channel scales) "
        "and write a checkpoint directory that `jaxinfer generate --model DIR` and "
        "jaxinfer.load(DIR) load directly.",
    )
    q.add_argument(
        "--model", required=True, help="source: a Hugging Face directory or a llama2.c checkpoint"
    )
    q.add_argument("--out", required=True, help="output directory (must not hold a checkpoint)")
    q.add_argument(
        "--quantization",
        default="int8",
        choices=["int8", "w8a8"],
        help="int8: weight-only (w8a16); w8a8: int8 activations too (recorded; the "
        "weights are the same)",
    )
    q.add_argument("--embed", action="store_true", help="also quantize the token embedding")
    q.add_argument("--lm-head", action="store_true", help="also quantize an untied LM head")
    q.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="float dtype of the unquantized tensors and activations",
    )
    return q


def cmd_quantize(args: argparse.Namespace) -> int:
    """Runs ``jaxinfer quantize``; prints a JSON summary on stdout. Returns the exit code."""
    from jaxinfer.loaders import load
    from jaxinfer.quant.checkpoint import save_quantized
    from jaxinfer.quant.tensor import quantize, weight_bytes

    t0 = time.perf_counter()
    loaded = load(args.model, dtype=args.dtype)
    params = quantize(loaded.params, args.quantization, embed=args.embed, lm_head=args.lm_head)
    out = save_quantized(
        args.out, loaded.config, params, args.model, embed=args.embed, lm_head=args.lm_head
    )
    print(
        json.dumps(
            {
                "out": str(out),
                "quantization": args.quantization,
                "float_bytes": weight_bytes(loaded.params),
                "quantized_bytes": weight_bytes(params),
                "seconds": round(time.perf_counter() - t0, 2),
            }
        ),
        flush=True,
    )
    return 0
