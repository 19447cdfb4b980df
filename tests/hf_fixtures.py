"""Tiny random Hugging Face checkpoints of every supported family, built with transformers.

Each case is a transformers config (built through ``AutoConfig.for_model``), saved with
``save_pretrained`` after re-drawing every weight at a scale where logits are O(1) (so argmax is
meaningful) and norm weights away from their neutral value (so a missing ``1 + w`` shows). Some
cases then rewrite ``config.json`` into the transformers 4 layout (``rope_theta``/``rope_scaling``/
``rope_local_base_freq``/``sliding_window_pattern``) to check that both layouts load.
"""

from __future__ import annotations

import json
import os

# Shape letters: D=64, V=256, L=2-3; windows (8) are smaller than the test sequences (24 tokens).
_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (model_type, config overrides, options). Options: "dtype" stored on disk, "shard" max
# shard
# size, "legacy" rewrite config.json to the transformers 4 layout.
CASES: dict[str, tuple[str, dict, dict]] = {
    # Llama 2 style: MHA, untied, eps 1e-5, sharded checkpoint.
    "llama2": (
        "llama",
        dict(num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False),
        dict(shard="40KB"),
    ),
    # Llama 3.1 style: GQA (N=4, K=2), tied, rope_type llama3 with a small original context so
    # all three wavelength bands (kept, smoothed, divided) occur for H=16; transformers 4 layout.
    "llama3": (
        "llama",
        dict(
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        dict(legacy=True),
    ),
    # Linear RoPE scaling, explicit head_dim (24) != D/N (16), 3 layers.
    "llama_linear_hd24": (
        "llama",
        dict(
            num_key_value_heads=2,
            head_dim=24,
            num_hidden_layers=3,
            rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
        ),
        dict(),
    ),
    # Mistral: MQA (K=1), every layer slides with window 8 < 24 tokens, stored in float16.
    "mistral": (
        "mistral",
        dict(num_key_value_heads=1, sliding_window=8, tie_word_embeddings=False),
        dict(dtype="float16"),
    ),
    # Qwen2: q/k/v biases, GQA, tied, stored in bfloat16.
    "qwen2": (
        "qwen2",
        dict(num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False),
        dict(dtype="bfloat16"),
    ),
    # Qwen3: q/k RMSNorm, head_dim 32 != D/N, untied.
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False), dict()),
    # Gemma: (1 + w) norms, sqrt(D) embed scale, GeGLU, head_dim 32, MQA, tied.
    "gemma": ("gemma", dict(num_key_value_heads=1, head_dim=32), dict()),
    # Gemma 2: softcaps, query_pre_attn_scalar, even layers slide with window 8, sandwich norms.
    # Gemma 2/3 are untied here: a random tied Gemma predicts its own input token, so greedy output
    # would repeat one token (tying is covered by llama3, qwen2, gemma).
    "gemma2": (
        "gemma2",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=False,
        ),
        dict(),
    ),
    # Gemma 3: q/k norms, local RoPE base on sliding layers, linear scaling on global layers,
    # sliding_window_pattern 2 over 3 layers (slide, full, slide); transformers 4 layout.
    "gemma3": (
        "gemma3_text",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=8,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1_000_000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
            },
        ),
        dict(legacy=True),
    ),
}

WEIGHT_STD = 0.2  # logits O(1) after the final norm; large enough that greedy does not lock up
NORM_STD = 0.2
# Gemma's tied, sqrt(D)-scaled embedding dominates the residual stream of a random model, which then
# predicts its own input token (greedy repeats one token). Larger weights (Gemma) or larger sandwich
# norm gains (Gemma 2/3, whose post-norms bound each layer's output) make the layers matter.
GEMMA_WEIGHT_STD = 0.3
SANDWICH_GAIN = 2.0


def _randomize(model, seed: int, gemma: bool):
    import torch

    g = torch.Generator().manual_seed(seed)
    names = [n for n, _ in model.named_parameters()]
    sandwich = any("pre_feedforward_layernorm" in n for n in names)
    std = GEMMA_WEIGHT_STD if gemma else WEIGHT_STD
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if sandwich and ("post_attention_layernorm" in name or "post_feedforward" in name):
                p.copy_(SANDWICH_GAIN + NORM_STD * noise)
            elif "norm" in name:  # Llama: w ~ 1; Gemma: (1 + w) with w ~ 0
                p.copy_((0.0 if gemma else 1.0) + NORM_STD * noise)
            else:
                p.copy_(std * noise)


def _legacy_config(path: str, model_type: str):
    """Rewrites config.json into the transformers 4 layout (what most Hub checkpoints carry)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters")
    if model_type == "gemma3_text":
        full, local = rp["full_attention"], rp["sliding_attention"]
        c["rope_theta"] = full.pop("rope_theta")
        c["rope_local_base_freq"] = local["rope_theta"]
        if full.get("rope_type", "default") != "default":
            c["rope_scaling"] = full
        c.pop("layer_types")
        c.pop("_sliding_window_pattern", None)
        c["sliding_window_pattern"] = 2
    else:
        c["rope_theta"] = rp.pop("rope_theta")
        c["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    with open(file, "w") as f:
        json.dump(c, f, indent=2)


def build_checkpoint(name: str, path: str, seed: int = 0) -> str:
    """Saves the random tiny model of ``CASES[name]`` to ``path``; returns ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, opts = CASES[name]
    kwargs = {**_BASE, **overrides}
    pattern = kwargs.pop("sliding_window_pattern", None)
    config = AutoConfig.for_model(model_type, **kwargs)
    if pattern is not None:
        config.sliding_window_pattern = pattern
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, seed, gemma=model_type.startswith("gemma"))
    if "dtype" in opts:
        model = model.to(getattr(torch, opts["dtype"]))
    save_kwargs = {"max_shard_size": opts["shard"]} if "shard" in opts else {}
    model.save_pretrained(path, **save_kwargs)
    if opts.get("legacy"):
        _legacy_config(path, model_type)
    return path


def hf_model(path: str, dtype: str = "float32"):
    """The transformers reference of a saved checkpoint, eval mode, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Comparison against transformers.

SEQ_LEN = 24  # > every sliding window above (8), so the windows matter
PROMPT_LEN = 8
NEW_TOKENS = 32


def sample_tokens(vocab_size: int = 256, seed: int = 0):
    """i32[2, SEQ_LEN] random token ids (no special ids 0-2)."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab_size, size=(2, SEQ_LEN)).astype(np.int32)


def hf_logits(model, tokens):
    """f32[B, S, V] logits of transformers' model (in its dtype, upcast)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def log_softmax(x):
    """f64 log_softmax over the last axis (an independent formula, numpy)."""
    import numpy as np

    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def hf_logprob_ref(path: str):
    """A function: token ids -> f64[S, V] log_softmax of transformers' f32 logits of the
    checkpoint at ``path`` (one sequence)."""
    model = hf_model(path, "float32")

    def ref(ids):
        return log_softmax(hf_logits(model, [ids])[0])

    return ref


def random_ids(n: int, seed: int, vocab_size: int = 256) -> list[int]:
    """n random token ids in [3, vocab_size) (no special ids 0-2)."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab_size, size=n).tolist()


def jax_logits(path: str, dtype: str, tokens):
    """f32[B, S, V] logits of jaxinfer on the checkpoint loaded at ``dtype``; also the config."""
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.loaders.hf import load_hf
    from jaxinfer.models.dense import dense_logits

    cfg, params = load_hf(path, getattr(jnp, dtype))
    return np.asarray(dense_logits(params, cfg, jnp.asarray(tokens))), cfg, params


def errors(got, ref, scale=None) -> dict[str, float]:
    """max_abs = max|got - ref|; max_rel = max_abs / max|scale| (scale defaults to ref);
    rms_rel = rms(got - ref) / rms(scale)."""
    import numpy as np

    scale = ref if scale is None else scale
    d = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    return {
        "max_abs": float(d.max()),
        "max_rel": float(d.max() / np.abs(scale).max()),
        "rms_rel": float(
            np.sqrt((d**2).mean()) / np.sqrt((np.asarray(scale, np.float64) ** 2).mean())
        ),
    }


def parity_figures(path: str) -> dict[str, dict[str, float]]:
    """Errors of jaxinfer against transformers on one checkpoint, f32 and bf16.

    Keys: ``f32`` (jaxinfer f32 vs transformers f32), ``bf16`` (jaxinfer bf16 vs transformers
    bf16), ``hf_bf16_vs_f32`` (transformers' own bf16 error), ``jax_bf16_vs_f32``; relative errors
    of the bf16 entries are scaled by the f32 reference.
    """
    tokens = sample_tokens()
    ref32 = hf_logits(hf_model(path, "float32"), tokens)
    ref16 = hf_logits(hf_model(path, "bfloat16"), tokens)
    got32, _, _ = jax_logits(path, "float32", tokens)
    got16, _, _ = jax_logits(path, "bfloat16", tokens)
    return {
        "f32": errors(got32, ref32),
        "bf16": errors(got16, ref16, ref32),
        "hf_bf16_vs_f32": errors(ref16, ref32),
        "jax_bf16_vs_f32": errors(got16, ref32),
    }
