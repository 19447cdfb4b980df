"""gpt-oss attention == transformers' ``GptOssAttention`` (eager, the same weights), one layer at a
time on a tiny random config: the input RMSNorm, q/k/v biases, YaRN RoPE (its attention factor
on cos/sin), per-head sinks, a sliding-window layer and a full one, the o_proj bias; through the
dense XLA attention, the paged XLA attention (a prefill chunk, then a decode row over the cached
pages) and the native CPU decode kernel. The config is read by ``hf_gpt_oss`` from
transformers' own ``GptOssConfig.to_dict()``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.attention import dense_attn_fn
from jaxinfer.models.forward import attention_inputs, attention_output, rope_tables
from jaxinfer.models.kv_cache import init_kv_cache
from jaxinfer.models.paged_attention import AttentionMetadata, paged_attn_fn
from jaxinfer.models.params import LayerParams

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
masking = pytest.importorskip("transformers.masking_utils")
from transformers import GptOssConfig  # noqa: E402

from jaxinfer.loaders.hf_gpt_oss import gpt_oss_config_from_hf  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)  # float32
S, Z = 13, 4  # tokens; page size


@pytest.fixture(scope="module")
def model():
    """(transformers config, our ModelConfig, per layer: (GptOssAttention, norm weight),
    x f32[1, S, D], position embeddings, masks per layer type)."""
    hf = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=500.0,
            factor=8.0,
            beta_fast=16.0,
            beta_slow=2.0,
            truncate=False,
            original_max_position_embeddings=8,  # yarn's ramp falls inside H / 2 = 8 dims
        ),
    )
    hf._attn_implementation = "eager"
    cfg, _ = gpt_oss_config_from_hf(hf.to_dict(), "gpt_oss/config.json")
    torch.manual_seed(0)
    layers = []
    for i in range(2):
        attn = gpt_oss.GptOssAttention(hf, i).float().eval()
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_(0.0, 0.3)
            attn.sinks.normal_(0.0, 2.0)  # decisive: a sink of 2 takes a good share
        norm = gpt_oss.GptOssRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.2)
        layers.append((attn, norm))
    x = torch.randn(1, S, hf.hidden_size)
    pos = torch.arange(S)[None]
    emb = gpt_oss.GptOssRotaryEmbedding(hf)(x, pos)
    kw = dict(config=hf, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
    masks = {
        "full_attention": masking.create_causal_mask(**kw, allow_is_causal_skip=False),
        "sliding_attention": masking.create_sliding_window_causal_mask(
            **kw, allow_is_causal_skip=False
        ),
    }
    return hf, cfg, layers, x, emb, masks


def _theirs(model, i):
    hf, _, layers, x, emb, masks = model
    attn, norm = layers[i]
    with torch.no_grad():
        out, _ = attn(norm(x), emb, masks[hf.layer_types[i]])
    return out[0].numpy()  # [S, D]


def _layer_params(model, i) -> LayerParams:
    hf, cfg, layers, *_ = model
    attn, norm = layers[i]
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    t = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
    proj = lambda lin, heads: t(lin.weight).reshape(heads, h, d).transpose(2, 0, 1)  # noqa: E731
    return LayerParams(
        attn_norm=t(norm.weight),
        wq=proj(attn.q_proj, n),
        wk=proj(attn.k_proj, k),
        wv=proj(attn.v_proj, k),
        wo=t(attn.o_proj.weight).reshape(d, n, h).transpose(1, 2, 0),
        mlp_norm=None,
        w_gate=None,
        w_up=None,
        w_down=None,
        bq=t(attn.q_proj.bias).reshape(n, h),
        bk=t(attn.k_proj.bias).reshape(k, h),
        bv=t(attn.v_proj.bias).reshape(k, h),
        bo=t(attn.o_proj.bias),
        sinks=t(attn.sinks),
    )


def _qkv(model, i, lp):
    _, cfg, _, x, _, _ = model
    positions = jnp.arange(S, dtype=jnp.int32)
    cos, sin = rope_tables(cfg, positions, local=False)
    return attention_inputs(cfg, lp, jnp.asarray(x[0].numpy()), cos, sin)


def test_config_fields(model):
    hf, cfg, *_ = model
    assert cfg.layer_windows == (5, 0)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.attn_scale == 16**-0.5


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_dense_attention_layer_equals_transformers(model, layer):
    _, cfg, *_ = model
    lp = _layer_params(model, layer)
    q, k, v = _qkv(model, layer, lp)
    ids, pos = jnp.zeros(S, jnp.int32), jnp.arange(S, dtype=jnp.int32)
    window = jnp.int32(cfg.layer_windows[layer])
    out, _ = dense_attn_fn(cfg, ids, pos)(q, k, v, None, jnp.int32(layer), window, lp.sinks)
    np.testing.assert_allclose(attention_output(cfg, lp, out), _theirs(model, layer), **TOL)


def _md(positions, kv_len, num_decode):
    positions = np.asarray(positions, np.int32)
    pages = np.asarray([3, 1, 4, 2], np.int32)  # shuffled pages of the one sequence
    slots = pages[positions // Z] * Z + positions % Z
    t = len(positions)
    return AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(pages[None]),
        kv_lens=jnp.asarray([kv_len], jnp.int32),
        cu_q_lens=jnp.asarray([0, t], jnp.int32),
        seq_ids=jnp.zeros(t, jnp.int32),
        num_decode=num_decode,
    )


@pytest.mark.parametrize("impl,page_major", [("xla", False), ("xla", True), ("cpu_kernel", True)])
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_paged_prefill_then_decode_equals_transformers(model, layer, impl, page_major):
    """The first S - 1 tokens as one prefill chunk, then the last as a decode row reading them
    from the pages (``impl`` runs the decode row: the XLA attention or the CPU kernel)."""
    _, cfg, *_ = model
    lp = _layer_params(model, layer)
    q, k, v = _qkv(model, layer, lp)
    ref = _theirs(model, layer)
    cache = init_kv_cache(cfg, 6, Z, jnp.float32, page_major=page_major)
    window = jnp.int32(cfg.layer_windows[layer])
    lay = jnp.int32(layer)
    pre = _md(np.arange(S - 1), S - 1, 0)
    out, cache = paged_attn_fn(cfg, pre, "xla")(
        q[:-1], k[:-1], v[:-1], cache, lay, window, lp.sinks
    )
    np.testing.assert_allclose(attention_output(cfg, lp, out), ref[:-1], **TOL)
    dec = _md([S - 1], S, 1)
    out, _ = paged_attn_fn(cfg, dec, impl)(q[-1:], k[-1:], v[-1:], cache, lay, window, lp.sinks)
    np.testing.assert_allclose(attention_output(cfg, lp, out), ref[-1:], **TOL)


class _TupleMLP(torch.nn.Module):
    """transformers' LlamaMLP (SwiGLU) in place of gpt-oss's expert layer, returning the
    (hidden, router scores) pair GptOssDecoderLayer unpacks."""

    def __init__(self, hf):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP

        self.mlp = LlamaMLP(hf)

    def forward(self, x):
        return self.mlp(x), None


F32_MAX_REL = 1e-4  # float32 logits against transformers' float32 (test_hf_parity's bound)


def test_whole_model_with_a_dense_mlp_equals_transformers(model):
    """GptOssForCausalLM with its expert layers replaced by a dense SwiGLU MLP on both sides: the
    logits of every position == ours (``dense_logits``, the XLA attention), so the forward
    passes each layer's sinks, window, biases and YaRN tables through."""
    from jaxinfer.models.dense import dense_logits
    from jaxinfer.models.params import Params

    hf, cfg, *_ = model
    hf.mlp_bias = False
    hf.hidden_act = "silu"
    torch.manual_seed(1)
    lm = gpt_oss.GptOssForCausalLM(hf).float().eval()
    for layer in lm.model.layers:
        layer.mlp = _TupleMLP(hf)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.3)
        for layer in lm.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    tokens = np.random.default_rng(0).integers(0, hf.vocab_size, (1, S))
    with torch.no_grad():
        ref = lm(torch.from_numpy(tokens)).logits[0].numpy()

    t = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
    layers = []
    for layer in lm.model.layers:
        lp = _layer_params((hf, cfg, [(layer.self_attn, layer.input_layernorm)]), 0)
        mlp = layer.mlp.mlp
        layers.append(
            dataclasses.replace(
                lp,
                mlp_norm=t(layer.post_attention_layernorm.weight),
                w_gate=t(mlp.gate_proj.weight).T,
                w_up=t(mlp.up_proj.weight).T,
                w_down=t(mlp.down_proj.weight).T,
            )
        )
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    params = Params(
        embed=t(lm.model.embed_tokens.weight),
        layers=stacked,
        final_norm=t(lm.model.norm.weight),
        lm_head=t(lm.lm_head.weight).T,
    )
    ours = np.asarray(dense_logits(params, cfg, jnp.asarray(tokens, jnp.int32), "xla"))[0]
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= F32_MAX_REL
