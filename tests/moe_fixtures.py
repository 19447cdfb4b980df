"""Tiny random mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), built and
saved with transformers.

Each case is a transformers config (``AutoConfig.for_model``) saved with ``save_pretrained``
(transformers 5 writes the experts one tensor each, the layout shipped on the Hub) after every
weight is redrawn: normal(0, 0.2) for projections, 1 + normal(0, 0.2) for norms, and normal(0,
0.5) for the routers, so router logits differ by O(1) and the top-k choice is decisive (no
near-ties that rounding could flip). The Qwen cases mix dense and sparse layers
(``mlp_only_layers``). ``fused_copy`` rewrites a checkpoint in transformers 5's fused expert
layout (``mlp.experts.gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

import os

# Shape letters: D=64, V=256, N=4, K=2, E=4-6 experts, top-k 2, expert width I=32.
_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

CASES: dict[str, tuple[str, dict]] = {
    # Mixtral: 4 experts of width 32 (intermediate_size), top-2, renormalised; all layers sparse.
    "mixtral": ("mixtral", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # Qwen2-MoE: q/k/v biases, a gated shared expert (S=48), norm_topk_prob false, 3 layers with
    # the middle one dense (intermediate_size 96).
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    # Qwen3-MoE: q/k norms per head, head_dim 32 != D/N, 6 experts, top-2 renormalised, the first
    # of 3 layers dense.
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # OLMoE: q/k norm over the whole projection, 4 experts, top-2 not renormalised.
    "olmoe": (
        "olmoe",
        dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    ),
}

# Expert parallel on 8 devices (tests/test_moe_parallel.py, not in CASES): a Qwen3-MoE whose 8
# query heads and 8 experts split over tp = 8; 2 KV heads (repeated for tp > 2), the first of 2
# layers dense.
EP_CASE = (
    "qwen3_moe",
    dict(
        num_attention_heads=8,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
)

WEIGHT_STD = 0.2
NORM_STD = 0.2
ROUTER_STD = 0.5


def _randomize(model, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * noise)
            elif name.endswith("mlp.gate.weight"):  # the router
                p.copy_(ROUTER_STD * noise)
            else:
                p.copy_(WEIGHT_STD * noise)


def build_checkpoint(name: str, path: str, seed: int = 0) -> str:
    """Saves the random tiny model of ``CASES[name]`` (or ``EP_CASE`` for "ep") to ``path``;
    returns ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = EP_CASE if name == "ep" else CASES[name]
    config = AutoConfig.for_model(model_type, **{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, seed)
    model.save_pretrained(path)
    return path


def fused_copy(src: str, dst: str) -> str:
    """``src`` rewritten with each layer's experts fused as transformers 5 holds them in memory
    (``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I], router
    ``mlp.gate.weight``); returns ``dst``."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    t = load_file(os.path.join(src, "model.safetensors"))
    out, experts = {}, {}
    for k, v in t.items():
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            layer = ".".join(parts[: at - 1])  # model.layers.{i}
            experts.setdefault(layer, {})[(int(parts[at + 1]), parts[at + 2])] = v
        elif ".block_sparse_moe.gate." in k:
            out[k.replace(".block_sparse_moe.", ".mlp.")] = v
        else:
            out[k] = v
    for layer, ws in experts.items():
        n = 1 + max(e for e, _ in ws)
        g, u, d = (
            ("w1", "w3", "w2")
            if "w1" in {p for _, p in ws}
            else ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([ws[(e, g)], ws[(e, u)]], axis=0) for e in range(n)]
        )
        out[f"{layer}.mlp.experts.down_proj"] = np.stack([ws[(e, d)] for e in range(n)])
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst
