"""Tiny random gpt-oss checkpoints saved with transformers (``GptOssForCausalLM``), float and
MXFP4-stored.

Shape letters: D=64, V=256, N=4, K=2, H=16, E=4 experts, top-2, expert width I=32; layer 0 slides
over 8 tokens, layer 1 is full; YaRN RoPE (factor 4 over 16 original positions, so positions of
the 13-24-token prompts are scaled).

Weights are redrawn with spread so the router's top-k is decisive and the clamp acts: normal(0,
0.2) for projections, 1 + normal(0, 0.2) for norms, normal(0, 0.5) for the router weight and
bias, normal(0, 1) for the attention sinks, normal(0, 0.5) for the experts' gate_up weights (so a
share of gate / up values passes the clamp at 7), normal(0, 0.5) for the expert biases.

``build_mxfp4_checkpoint`` draws the expert weights as MXFP4 (random FP4 codes and E8M0
exponents), gives transformers the weights its own ``convert_moe_packed_tensors`` dequantizes
them to, and writes two directories: ``float`` (``save_pretrained`` of that model, the
reference) and ``mxfp4`` (the same tensors with each expert weight replaced by its
``*_blocks`` / ``*_scales`` pair, and ``quantization_config.quant_method: "mxfp4"``, as the
checkpoints ship on the Hub).
"""

from __future__ import annotations

import json
import os
import shutil

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=500.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=8.0,
        beta_slow=1.0,
        truncate=False,
    ),
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
# exponents (E8M0, bias 127) drawn for MXFP4 weights: 2**-4 .. 2**-2 for gate_up, 2**-5 .. 2**-3
# for down, so the dequantized weights have about the float checkpoint's spread
GATE_UP_SCALES = (123, 126)
DOWN_SCALES = (122, 125)


def _std(name: str) -> tuple[float, float]:
    """(mean, std) of the redrawn parameter ``name``."""
    if "norm" in name:
        return 1.0, 0.2
    if "sinks" in name:
        return 0.0, 1.0
    if ".router." in name or name.endswith("_bias") or name.endswith("gate_up_proj"):
        return 0.0, 0.5
    return 0.0, 0.2


def make_model(seed: int = 0):
    """The random tiny GptOssForCausalLM (float32, eval, eager attention)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = _std(name)
            p.copy_(mean + std * torch.randn(p.shape, generator=g, dtype=torch.float32))
    return model


def build_checkpoint(path: str, seed: int = 0) -> str:
    """Saves the random tiny model with transformers to ``path``; returns ``path``."""
    make_model(seed).save_pretrained(path)
    return path


def _mxfp4(rng, e: int, rows: int, inputs: int, scales: tuple[int, int]):
    """Random MXFP4 blocks u8[E, rows, inputs/32, 16] and scales u8[E, rows, inputs/32]."""
    import numpy as np

    g = inputs // 32
    blocks = rng.integers(0, 256, (e, rows, g, 16), dtype=np.uint8)
    exps = rng.integers(scales[0], scales[1], (e, rows, g), dtype=np.uint8, endpoint=True)
    return blocks, exps


def build_mxfp4_checkpoint(path: str, seed: int = 1) -> tuple[str, str]:
    """(float dir, mxfp4 dir) of one random model whose experts are MXFP4-representable."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = make_model(seed)
    c = model.config
    e, d, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    rng = np.random.default_rng(seed)
    packed = {}
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            prefix = f"model.layers.{li}.mlp.experts."
            for name, rows, inputs, scales in (
                ("gate_up_proj", 2 * i, d, GATE_UP_SCALES),
                ("down_proj", d, i, DOWN_SCALES),
            ):
                blocks, exps = _mxfp4(rng, e, rows, inputs, scales)
                w = convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(exps), dtype=torch.float32
                )
                getattr(ex, name).copy_(w)  # [E, inputs, rows], GptOssExperts' layout
                packed[prefix + name + "_blocks"] = blocks
                packed[prefix + name + "_scales"] = exps
    float_dir, mxfp4_dir = os.path.join(path, "float"), os.path.join(path, "mxfp4")
    model.save_pretrained(float_dir)
    os.makedirs(mxfp4_dir, exist_ok=True)
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            del tensors[name]
    save_file({**tensors, **packed}, os.path.join(mxfp4_dir, "model.safetensors"))
    with open(os.path.join(float_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(mxfp4_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(float_dir, extra)):
            shutil.copy(os.path.join(float_dir, extra), mxfp4_dir)
    return float_dir, mxfp4_dir
