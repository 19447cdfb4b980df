"""Host memory and time of ``load_hf`` on a ~110M-parameter random Llama checkpoint.

Writes (or reuses) four checkpoints in a work directory: float32 and bfloat16, single-file and
sharded
(``model.safetensors.index.json``), with the tensor names and shapes transformers' LlamaForCausalLM
saves. Each load runs in a fresh subprocess (imports done first) so the peak is clean; it reports
the peak resident set size (``ru_maxrss``) minus the RSS before ``load_hf``, the RSS still held
after it (the loaded Params), the checkpoint size in bytes and peak/size.

Usage: python scripts/load_memory.py [--workdir DIR] [--dtype float32|bfloat16]
Prints one JSON object (a list of runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# ~110M parameters: 12 x 7.08M per layer + 2 x 16000 x 768 (untied embedding and LM head).
CONFIG = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=16000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SHARD_BYTES = 100 * 2**20


def _tensor_shapes(c):
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    h = d // c["num_attention_heads"]
    kh = c["num_key_value_heads"] * h
    shapes = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kh, d),
                p + "self_attn.v_proj.weight": (kh, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    return shapes


def build(path: str, dtype: str, sharded: bool) -> None:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    if os.path.exists(os.path.join(path, "config.json")):
        return
    os.makedirs(path, exist_ok=True)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    shards, cur, cur_bytes = [], {}, 0
    for name, shape in _tensor_shapes(CONFIG).items():
        x = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np_dtype)
        if sharded and cur and cur_bytes + x.nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[name] = x
        cur_bytes += x.nbytes
    shards.append(cur)
    if not sharded:
        save_file(shards[0], os.path.join(path, "model.safetensors"))
    else:
        wm = {}
        for i, s in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(s, os.path.join(path, fn))
            wm.update(dict.fromkeys(s, fn))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**CONFIG, "torch_dtype": dtype}, f)


def _child(path: str, dtype: str) -> None:
    """Runs in the subprocess: one load, JSON on stdout."""
    import resource
    import time

    import jax
    import jax.numpy as jnp
    import psutil

    from jaxinfer.loaders.hf import load_hf

    jnp.zeros(1).block_until_ready()  # initialise the backend before measuring
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    cfg, params = load_hf(path, getattr(jnp, dtype))
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    rss1 = proc.memory_info().rss
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(
        json.dumps(
            {
                "load_s": dt,
                "rss_before": rss0,
                "peak_rss": peak,
                "rss_after": rss1,
                "params_bytes": nbytes,
                "num_params": cfg.num_params(),
            }
        )
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--workdir", default=os.path.join(tempfile.gettempdir(), "jaxinfer_load_memory")
    )
    ap.add_argument("--child", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(*args.child)
    runs = []
    for dtype in ("float32", "bfloat16"):
        for sharded in (False, True):
            path = os.path.join(
                args.workdir, f"llama110m-{dtype}-{'sharded' if sharded else 'single'}"
            )
            build(path, dtype, sharded)
            size = sum(
                os.path.getsize(os.path.join(path, f))
                for f in os.listdir(path)
                if f.endswith(".safetensors")
            )
            out = subprocess.run(
                [sys.executable, __file__, "--child", path, dtype],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            increase = r["peak_rss"] - r["rss_before"]
            runs.append(
                {
                    "checkpoint": os.path.basename(path),
                    "load_dtype": dtype,
                    "num_params": r["num_params"],
                    "checkpoint_bytes": size,
                    "load_s": round(r["load_s"], 3),
                    "peak_rss_increase_bytes": increase,
                    "rss_held_after_bytes": r["rss_after"] - r["rss_before"],
                    "params_bytes": r["params_bytes"],
                    "peak_over_checkpoint": round(increase / size, 3),
                }
            )
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
