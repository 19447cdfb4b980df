"""Random Qwen3-MoE-shaped checkpoints for the benchmarks, saved with transformers.

    qwen3moe1b      ~0.99B parameters, ~0.19B active per token
    qwen3moe250m    ~0.26B, ~0.06B active
    qwen3moe_tiny   ~0.16M (the benchmark smoke tests; 8 experts, top-2, vocabulary 512)

(``param_counts`` gives the exact figures: 0.987B / 0.194B and 0.255B / 0.057B.)

Proportions after Qwen3-30B-A3B (every layer sparse, 128 experts of width 768 at hidden 2048,
top-8, ``norm_topk_prob``, q/k norms, untied head): 64 experts of width D / 4, top-8, all layers
sparse, GQA 4:1 with head_dim 64, scaled to fit a 2-core CPU. The embedding is tied (as the
random Llamas of ``bench_generate``) and the vocabulary is 32000; prompts use ids below 512,
with stories260K's ``tok512.model`` copied beside the weights for the engine's detokenizer.

Each checkpoint is a ``Qwen3MoeConfig`` / ``Qwen3MoeForCausalLM`` saved with ``save_pretrained``
(float32, built once into ``$JAXINFER_CACHE_DIR/bench/<name>``) after its weights are redrawn
(seed 0) with a spread that keeps activations O(1) at any width and makes routing decisive, as
``tests/moe_fixtures.py`` does for its tiny cases at a fixed spread: each projection
normal(0, 1/sqrt(fan_in)), the router normal(0, 2/sqrt(D)) (router logits of a normed token have
standard deviation ~2, so the top-k choice has O(0.01-0.1) gaps, far from f32 rounding), the
(tied) embedding normal(0, 1/sqrt(D)), norm weights 1 + normal(0, 0.1). The embedding's spread
sets the output logits' standard deviation to ~1: at normal(0, 1) each token's own embedding
dominates the final hidden state and greedy decoding repeats the last prompt token forever.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# name: hidden D, layers L, query heads N, KV heads K, head_dim H, experts E, top-k A,
# expert width I, vocabulary V.
RANDOM_QWEN3_MOES = {
    "qwen3moe1b": dict(D=1024, L=18, N=16, K=4, H=64, E=64, A=8, I=256, V=32000),
    "qwen3moe250m": dict(D=512, L=18, N=8, K=2, H=64, E=64, A=8, I=128, V=32000),
    "qwen3moe_tiny": dict(D=64, L=2, N=4, K=2, H=16, E=8, A=2, I=32, V=512),
}

ROUTER_SPREAD = 2.0  # router std * sqrt(D): the std of a normed token's router logits
NORM_STD = 0.1


def param_counts(name: str) -> dict:
    """Total and active (per token) parameters of ``RANDOM_QWEN3_MOES[name]``, counted from the
    shapes (tied embedding counted once; norms included)."""
    s = RANDOM_QWEN3_MOES[name]
    D, L, N, K, H, E, A, I, V = (s[k] for k in "DLNKHEAIV")
    attn = D * N * H + 2 * D * K * H + N * H * D + 2 * H  # q, k, v, o, q/k norms
    expert = 3 * D * I  # gate, up, down
    per_layer = attn + D * E + 2 * D  # + router, the two norms
    total = V * D + D + L * (per_layer + E * expert)
    active = V * D + D + L * (per_layer + A * expert)
    return {"total": total, "active": active}


def qwen3_moe_config(name: str):
    """The transformers ``Qwen3MoeConfig`` of ``RANDOM_QWEN3_MOES[name]``."""
    from transformers import Qwen3MoeConfig

    s = RANDOM_QWEN3_MOES[name]
    return Qwen3MoeConfig(
        vocab_size=s["V"],
        hidden_size=s["D"],
        intermediate_size=4 * s["D"],  # dense MLP width: unused, every layer is sparse
        num_hidden_layers=s["L"],
        num_attention_heads=s["N"],
        num_key_value_heads=s["K"],
        head_dim=s["H"],
        num_experts=s["E"],
        num_experts_per_tok=s["A"],
        moe_intermediate_size=s["I"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def redraw(model, seed: int = 0) -> None:
    """Redraws every parameter of a Qwen3-MoE ``model`` in place (see the module docstring)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * noise)
            elif name.endswith("mlp.gate.weight"):  # the router [E, D]
                p.copy_(ROUTER_SPREAD / d**0.5 * noise)
            elif "embed_tokens" in name:  # [V, D], also the LM head
                p.copy_(noise / d**0.5)
            else:  # projections: [..., out, in] (experts fused [E, 2I, D] / [E, D, I])
                p.copy_(noise / p.shape[-1] ** 0.5)


def random_qwen3_moe_dir(name: str, cache: Path, shared: Path) -> Path:
    """``cache/bench/<name>``: the random checkpoint (built once; an existing one is reused),
    with ``shared/models/stories260K/tok512.model`` beside it."""
    path = Path(cache) / "bench" / name
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(name)).to(torch.float32)
    redraw(model)
    tmp = path.with_name(f"{name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    shutil.copy(Path(shared) / "models" / "stories260K" / "tok512.model", tmp / "tokenizer.model")
    tmp.rename(path)  # atomic: a concurrent run never sees half a directory
    return path
