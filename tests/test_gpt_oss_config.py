"""gpt-oss configs (jaxinfer/loaders/hf_gpt_oss.py) and YaRN RoPE (models/config.py): the inverse
frequencies and attention factor == transformers' ``_compute_yarn_parameters`` called directly;
the shipped config.json layout and transformers' own ``GptOssConfig.to_dict()`` map to the same
ModelConfig (MoE fields included); bad fields are named; the size check counts MXFP4 experts at
17/32 of a byte a weight."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.hf_gpt_oss import gpt_oss_config_from_hf, min_checkpoint_bytes
from jaxinfer.models.rope import RopeScaling, rope_attention_scaling, rope_inv_freq

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

TOL = dict(rtol=1e-6, atol=0)  # float32 inverse frequencies

YARN_CASES = {
    # gpt-oss's own: no truncation
    "gpt_oss": dict(
        head_dim=64,
        rope=dict(
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
    # Qwen-style: truncation on (transformers' default), other betas
    "truncated": dict(
        head_dim=128,
        rope=dict(
            rope_theta=1e6,
            factor=4.0,
            beta_fast=16.0,
            beta_slow=2.0,
            original_max_position_embeddings=32768,
        ),
    ),
    # DeepSeek-style attention factor: mscale / mscale_all_dim
    "mscale": dict(
        head_dim=64,
        rope=dict(
            rope_theta=10000.0,
            factor=40.0,
            mscale=0.707,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
    ),
    "attention_factor": dict(
        head_dim=32,
        rope=dict(
            rope_theta=10000.0,
            factor=8.0,
            attention_factor=0.9,
            original_max_position_embeddings=2048,
        ),
    ),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_equals_transformers(case):
    spec = YARN_CASES[case]
    hf = transformers.GptOssConfig(
        head_dim=spec["head_dim"], rope_parameters=dict(rope_type="yarn", **spec["rope"])
    )
    inv_ref, att_ref = rope_utils._compute_yarn_parameters(hf)
    r = {k: v for k, v in spec["rope"].items() if k != "rope_theta"}
    scaling = RopeScaling("yarn", **r)
    inv = rope_inv_freq(spec["head_dim"], spec["rope"]["rope_theta"], scaling)
    assert inv.dtype == np.float32 and inv.shape == (spec["head_dim"] // 2,)
    np.testing.assert_allclose(inv, inv_ref.numpy(), **TOL)
    assert rope_attention_scaling(scaling) == pytest.approx(att_ref, rel=1e-12)
    # the ramp is not degenerate: some dimensions interpolated, some kept
    plain = rope_inv_freq(spec["head_dim"], spec["rope"]["rope_theta"], None)
    assert np.any(inv == plain) or np.any(np.isclose(inv, plain, rtol=1e-7))
    assert np.any(inv < plain * 0.99)


# gpt-oss-20b's config.json as shipped (transformers 4.55 layout, rope_scaling + rope_theta).
SHIPPED = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def test_shipped_config():
    cfg = gpt_oss_config_from_hf(SHIPPED, "gpt-oss-20b/config.json")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (24, 64, 8, 64)
    assert cfg.layer_windows == (128, 0) * 12
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias
    assert cfg.rope_theta == 150000.0 and cfg.rms_norm_eps == 1e-5
    s = cfg.rope_scaling
    assert (s.rope_type, s.factor, s.beta_fast, s.beta_slow, s.truncate) == (
        "yarn",
        32.0,
        32.0,
        1.0,
        False,
    )
    assert s.original_max_position_embeddings == 4096
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.router_bias) == (7.0, 1.702, True)
    assert (cfg.router_order, cfg.expert_glu, cfg.expert_bias) == (
        "topk_softmax",
        "gpt_oss_clamped",
        True,
    )
    assert cfg.sparse_layers == (True,) * 24 and not cfg.has_dense_mlp
    # gpt-oss-20b's 13.8 GB of safetensors (MXFP4 experts) pass the size check; the same sizes
    # in bf16 experts would not fit in them
    assert min_checkpoint_bytes(cfg, True) < 13_761_300_000 < min_checkpoint_bytes(cfg, False)
    gpt_oss_config_from_hf(SHIPPED, "c.json", checkpoint_bytes=13_761_300_000)
    with pytest.raises(CheckpointError, match=r"c\.json: the config's sizes .* 17/32"):
        gpt_oss_config_from_hf(SHIPPED, "c.json", checkpoint_bytes=10_000_000_000)


def test_transformers_layout_maps_alike():
    """transformers 5's ``to_dict`` (rope_parameters holding rope_theta) of the same model."""
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "head_dim",
        "num_attention_heads",
        "num_key_value_heads",
        "num_local_experts",
        "num_experts_per_tok",
        "layer_types",
        "sliding_window",
        "swiglu_limit",
    )
    hf = transformers.GptOssConfig(
        num_hidden_layers=24,
        rope_parameters=dict(rope_theta=150000.0, **SHIPPED["rope_scaling"]),
        **{k: SHIPPED[k] for k in keys},
    )
    cfg = gpt_oss_config_from_hf(hf.to_dict())
    ref = gpt_oss_config_from_hf(SHIPPED)
    assert cfg == ref
    # transformers' defaults (an almost empty config) are GptOssConfig's
    d = gpt_oss_config_from_hf({"model_type": "gpt_oss"})
    dh = transformers.GptOssConfig()
    assert (d.num_layers, d.hidden_size, d.layer_windows[:2]) == (
        dh.num_hidden_layers,
        dh.hidden_size,
        (dh.sliding_window, 0),
    )


@pytest.mark.parametrize(
    "change,field",
    [
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 12}, "layer_types[1]"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
        (
            {"rope_scaling": {**SHIPPED["rope_scaling"], "partial_rotary_factor": 0.5}},
            "rope_scaling.partial_rotary_factor",
        ),
        (
            {"rope_scaling": {**SHIPPED["rope_scaling"], "beta_fast": "32"}},
            "rope_scaling.beta_fast",
        ),
        ({"num_experts_per_tok": 33}, "num_experts_per_tok"),
        ({"sliding_window": None}, "sliding_window"),
        ({"num_key_value_heads": 7}, "num_attention_heads"),
        ({"attention_bias": 1}, "attention_bias"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_bad_field_is_named(change, field):
    c = {**SHIPPED, **change}
    with pytest.raises(CheckpointError, match=rf"oss/config\.json: field '{re.escape(field)}'"):
        gpt_oss_config_from_hf(c, "oss/config.json")
