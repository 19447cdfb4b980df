"""Shared pieces of the benchmark scripts: models, the seeded workload, statistics, results files.

Models (``resolve_model``):
- ``stories260K``: the llama2.c TinyStories model in ``$JAXINFER_SHARED/models/stories260K``
  (default ``../shared`` beside the repository); for transformers it is converted once into a
  Hugging Face directory under ``~/.cache/jaxinfer/bench/stories260K-hf`` (or
  ``$JAXINFER_CACHE_DIR/bench``).
- ``llama110m``, ``llama1b``: random Llama checkpoints in Hugging Face format (float32 on disk,
  built once and cached; see ``bench_generate.random_llama_dir``). Both the engine and
  transformers load the same directory.
- ``qwen3moe1b``, ``qwen3moe250m``, ``qwen3moe_tiny``: random Qwen3-MoE checkpoints in Hugging
  Face format (``moe_models``: ~0.99B total / ~0.19B active, ~0.26B / ~0.06B, a tiny one for
  smoke tests), built once and cached; both sides load the same directory.
- any other value: a path (a Hugging Face directory is used for both sides).

Workload (``make_workload``): ``n`` requests whose prompt and output lengths are log-normal, shaped
like ShareGPT (long-tailed: many short, a few long). Input lengths: log-normal with sigma 0.8 and
mean ``mean_input`` (median ``mean_input * exp(-0.32)``); output lengths: sigma 0.6, mean
``mean_output`` (median ``mean_output * exp(-0.18)``); both clamped to ``[4, max_model_len // 2]``.
Prompt tokens are BOS (1) then uniform ids in [3, min(vocab, 512)) — real tokens of every
tokenizer used here. One ``numpy.random.default_rng(seed)`` draws everything, so a seed fixes the
workload exactly. Outputs run to their drawn length (``ignore_eos``), greedy.

Results: every script prints one JSON line on stdout and appends it to
``<results dir>/<script>.jsonl`` (default ``results/`` in the repository; ``--results-dir`` or
``$JAXINFER_RESULTS_DIR`` move it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from bench_generate import CACHE, RANDOM_LLAMAS, REPO, SHARED, random_llama_dir  # noqa: E402
from moe_models import RANDOM_QWEN3_MOES, random_qwen3_moe_dir  # noqa: E402

STORIES = SHARED / "models" / "stories260K"
MODELS = ("stories260K", *RANDOM_LLAMAS, *RANDOM_QWEN3_MOES)


# ---------------------------------------------------------------- models


def stories_hf_dir() -> Path:
    """stories260K as a Hugging Face Llama directory (converted once from jaxinfer's params).

    jaxinfer's params are already in Hugging Face's rotate_half layout, so the conversion is a
    reshape and transpose per projection: ``wq [L, D, N, H] -> q_proj.weight [N*H, D]``,
    ``wo [L, N, H, D] -> o_proj.weight [D, N*H]``, ``w_gate [L, D, F] -> gate_proj.weight [F, D]``.
    """
    path = CACHE / "bench" / "stories260K-hf"
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    convert_stories_to_hf(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent run never sees half a directory
    except OSError:  # another process renamed its copy first (the test workers race here)
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def convert_stories_to_hf(path: Path) -> Path:
    """Writes stories260K's weights as a Hugging Face Llama directory at ``path`` (no
    tokenizer; see ``stories_hf_dir``). Raises RuntimeError if the state dict does not fit."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import jaxinfer

    m = jaxinfer.load(STORIES, dtype="float32")
    c, p = m.config, m.params
    L, D, N, K, H = c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=D,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=K,
        head_dim=H,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(hf_cfg)
    t = lambda a: torch.from_numpy(np.array(a, np.float32))
    lp = p.layers
    sd = {"model.embed_tokens.weight": t(p.embed), "model.norm.weight": t(p.final_norm)}
    if p.lm_head is not None:
        sd["lm_head.weight"] = t(np.asarray(p.lm_head).T)
    for i in range(L):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = t(lp.attn_norm[i])
        sd[pre + "post_attention_layernorm.weight"] = t(lp.mlp_norm[i])
        sd[pre + "self_attn.q_proj.weight"] = t(np.asarray(lp.wq[i]).reshape(D, N * H).T)
        sd[pre + "self_attn.k_proj.weight"] = t(np.asarray(lp.wk[i]).reshape(D, K * H).T)
        sd[pre + "self_attn.v_proj.weight"] = t(np.asarray(lp.wv[i]).reshape(D, K * H).T)
        sd[pre + "self_attn.o_proj.weight"] = t(np.asarray(lp.wo[i]).reshape(N * H, D).T)
        sd[pre + "mlp.gate_proj.weight"] = t(np.asarray(lp.w_gate[i]).T)
        sd[pre + "mlp.up_proj.weight"] = t(np.asarray(lp.w_up[i]).T)
        sd[pre + "mlp.down_proj.weight"] = t(np.asarray(lp.w_down[i]).T)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not c.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(
            f"stories260K -> HF conversion: missing {missing}, unexpected {unexpected}"
        )
    model.save_pretrained(path)
    return path


def resolve_model(name: str, *, hf: bool = False) -> tuple[Path, int, Path | None]:
    """(engine checkpoint path, vocabulary size, Hugging Face directory or None unless ``hf``)."""
    if name == "stories260K":
        return STORIES, 512, stories_hf_dir() if hf else None
    if name in RANDOM_LLAMAS:
        path = random_llama_dir(name, "float32")
        return path, RANDOM_LLAMAS[name][-1], path
    if name in RANDOM_QWEN3_MOES:
        path = random_qwen3_moe_dir(name, CACHE, SHARED)
        return path, RANDOM_QWEN3_MOES[name]["V"], path
    path = Path(name)
    if (path / "config.json").exists():
        vocab = json.loads((path / "config.json").read_text()).get("vocab_size", 512)
        return path, int(vocab), path if hf else None
    return path, 512, None


# ---------------------------------------------------------------- workload


def make_workload(
    n: int, *, max_model_len: int, vocab: int, seed: int, mean_input: float, mean_output: float
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of ``n`` requests; see the module docstring."""
    rng = np.random.default_rng(seed)
    cap = max_model_len // 2
    ins = np.clip(rng.lognormal(np.log(mean_input) - 0.32, 0.8, n), 4, cap).astype(int)
    outs = np.clip(rng.lognormal(np.log(mean_output) - 0.18, 0.6, n), 4, cap).astype(int)
    hi = min(vocab, 512)
    return [
        ([1] + rng.integers(3, hi, i - 1).tolist(), int(o)) for i, o in zip(ins, outs, strict=True)
    ]


def kv_slot_bytes(engine) -> float:
    """Bytes of one token slot of the engine's KV pool over all layers (every leaf of the pool
    pytree, so a quantized pool's scales count): pool bytes / (pages x page size)."""
    import jax

    pool = sum(int(x.nbytes) for x in jax.tree.leaves(engine.kv))
    return pool / (engine.ecfg.num_pages * engine.ecfg.page_size)


def greedy(max_tokens: int):
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---------------------------------------------------------------- statistics and output


def stats(xs, digits: int = 5) -> dict:
    """mean, p50 and p99 of ``xs`` (NaN-free; an empty list gives None values)."""
    a = np.asarray([x for x in xs if x is not None], float)
    if a.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": round(float(a.mean()), digits),
        "p50": round(float(np.percentile(a, 50)), digits),
        "p99": round(float(np.percentile(a, 99)), digits),
    }


def ratio(a, b, digits: int = 3):
    return None if a is None or not b else round(a / b, digits)


def host_info() -> dict:
    import jax

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, stories260K only: a smoke test that runs in seconds",
    )
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument(
        "--results-dir",
        default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results")),
        help="where <script>.jsonl is appended (default: results/ in the repo)",
    )


def emit(summary: dict, name: str, results_dir: str | os.PathLike) -> None:
    """Prints ``summary`` as one JSON line and appends it to ``<results_dir>/<name>.jsonl``."""
    line = json.dumps(summary)
    print(line, flush=True)
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.jsonl", "a") as f:
        f.write(line + "\n")


def time_calls(f, *args, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls ``f(*args)`` (a jitted function), each waited for
    with ``block_until_ready``, after one untimed warm-up call (compilation)."""
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return times


def log(*args) -> None:
    """Progress to stderr (stdout carries only the JSON summary)."""
    print(*args, file=sys.stderr, flush=True)
