"""The transformer forward pass in pure JAX, one function for every supported family.

Tokens are a flat ragged axis T (many sequences concatenated); how attention sees other tokens
(dense segment mask, paged KV cache, Pallas kernel) is supplied by the caller as ``attn_fn``, so the
same forward serves the reference tests and the engine's jitted step. Layers run under
``lax.scan`` over the stacked weights (unstacked ones: an unrolled loop, or a scan picking each
layer's buffers for passes of at least ``Params.scan_from_tokens`` tokens); the KV cache travels
in the carry so the engine can update it in place.

Sources: Hugging Face transformers' modeling_llama / modeling_gemma2 / modeling_gemma3 /
modeling_qwen3 (the numerics are matched to them: norms in float32, RoPE in float32, softmax in
float32).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.expert_sharding import sharded_moe_mlp
from jaxinfer.models.moe import moe_mlp
from jaxinfer.models.params import LayerParams, OutInWeight, Params
from jaxinfer.models.rope import rope_attention_scaling, rope_inv_freq
from jaxinfer.quant.matmul import qlinear, qlinear_flat
from jaxinfer.quant.tensor import QTensor

Cache = TypeVar("Cache")


class AttnFn(Protocol[Cache]):
    """Attention of one layer, including the KV cache update.

    Args:
        q: [T, N, H] queries, RoPE applied.
        k, v: [T, K, H] keys (RoPE applied) and values of the same tokens.
        cache: the KV cache pytree (any structure the implementation owns).
        layer: i32[] layer index.
        window: i32[] sliding window of this layer in tokens, 0 = global.
        sinks: [N] this layer's attention-sink logits (``ModelConfig.attention_sinks``), or
            None. An implementation that cannot add them raises ValueError.
    Returns:
        ([T, N, H] attention output, updated cache).
    """

    def __call__(self, q, k, v, cache: Cache, layer, window, sinks) -> tuple[jax.Array, Cache]: ...


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:  # Gemma: (1 + w) in float32, then cast.
        return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)
    return w * xf.astype(x.dtype)  # Llama: cast, then scale in the weight dtype.


def linear(x: jax.Array, w: jax.Array | QTensor | OutInWeight, spec: str) -> jax.Array:
    """Projection ``einsum(spec, x, w)`` accumulated in float32, returned in x's dtype.

    ``spec`` is written for the params' input-first layout. An int8 ``QTensor`` weight runs the
    quantized matmul of its mode (``jaxinfer.quant.matmul``); an ``OutInWeight`` (output-first)
    runs ``linear_out_in``.
    """
    if isinstance(w, QTensor):
        return qlinear(x, w, spec)
    if isinstance(w, OutInWeight):
        return linear_out_in(x, w.values, w.num_in)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def linear_out_in(x: jax.Array, w: jax.Array, num_in: int) -> jax.Array:
    """``x [*rows, *in]`` times an output-first weight ``w [*out, *in]`` -> ``[*rows, *out]`` in
    x's dtype, accumulated in float32.

    On CPU it is computed as ``(w @ x^T)^T``: XLA CPU's GEMM is faster in that form for a few
    rows (``params.out_in_projections``), and the optimization barrier keeps XLA from folding
    the small transpose back into the dot (which restores the slow form). Elsewhere a plain
    contraction.
    """
    out_shape = w.shape[: w.ndim - num_in]
    rows = x.shape[: x.ndim - num_in]
    n_in = math.prod(w.shape[w.ndim - num_in :])
    x2, w2 = x.reshape(-1, n_in), w.reshape(-1, n_in)
    if jax.default_backend() == "cpu":
        y = jnp.einsum("OI,RI->OR", w2, x2, preferred_element_type=jnp.float32)
        y = jax.lax.optimization_barrier(y).T
    else:
        y = jnp.einsum("RI,OI->RO", x2, w2, preferred_element_type=jnp.float32)
    return y.reshape(rows + out_shape).astype(x.dtype)


def linear_parts(x: jax.Array, w: OutInWeight | QTensor) -> tuple[jax.Array, ...]:
    """``x [*rows, D]`` times a fused output-first weight (``OutInWeight`` or int8 ``QTensor``
    with ``parts``): one product, split into each part's ``[*rows, *part]`` in x's dtype."""
    if isinstance(w, QTensor):
        y = qlinear_flat(x, w)  # [*rows, S]
    else:
        y = linear_out_in(x, w.values, w.num_in)  # [*rows, S]
    rows = x.shape[: x.ndim - w.num_in]
    sizes = [math.prod(p) for p in w.parts]
    cuts = np.cumsum(sizes)[:-1].tolist()
    return tuple(
        part.reshape(rows + p)
        for part, p in zip(jnp.split(y, cuts, axis=-1), w.parts, strict=False)
    )


def rope_tables(cfg: ModelConfig, positions: jax.Array, local: bool) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[T, H // 2] for the global (or, with ``local``, the sliding-window) layers."""
    if local:
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None)
    else:
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    mul = 1.0 if local else rope_attention_scaling(cfg.rope_scaling)
    if mul != 1.0:  # yarn: cos and sin carry the attention factor (transformers' rotary forward)
        return jnp.cos(angles) * mul, jnp.sin(angles) * mul
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, "rotate_half" layout (Hugging Face), x: [T, heads, H]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _act(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.hidden_act == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=True)


TokenMap = Callable[..., Any]
"""``token_map(fn, *xs)``: applies ``fn`` to arrays ``xs`` that share a leading token axis T and
returns ``fn``'s outputs with that axis; ``fn`` maps each token independently of the others."""


def _direct(fn, *xs):
    return fn(*xs)


def attention_inputs(
    cfg: ModelConfig, lp: LayerParams, x: jax.Array, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention inputs of residual stream x [T, D]: (q [T, N, H], k [T, K, H],
    v [T, K, H]); the input norm, projections, biases, q/k norms, RoPE (cos, sin f32[T, H // 2])."""
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
    h = rms_norm(x, lp.attn_norm, eps, off)
    if lp.wqkv is not None:
        q, k, v = linear_parts(h, lp.wqkv)
    else:
        q = linear(h, lp.wq, "TD,DNH->TNH")
        k = linear(h, lp.wk, "TD,DKH->TKH")
        v = linear(h, lp.wv, "TD,DKH->TKH")
    if lp.bq is not None:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    if lp.q_norm is not None and cfg.qk_norm_flat:  # OLMoE: over the whole projection
        q = rms_norm(q.reshape(q.shape[0], -1), lp.q_norm.reshape(-1), eps, off).reshape(q.shape)
        k = rms_norm(k.reshape(k.shape[0], -1), lp.k_norm.reshape(-1), eps, off).reshape(k.shape)
    elif lp.q_norm is not None:
        q = rms_norm(q, lp.q_norm, eps, off)
        k = rms_norm(k, lp.k_norm, eps, off)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(cfg: ModelConfig, lp: LayerParams, attn: jax.Array) -> jax.Array:
    """One layer's attention output [T, D] (in ``attn``'s dtype) of ``attn`` [T, N, H]: the
    output projection, its bias (gpt-oss) and the post-attention norm (Gemma 2/3)."""
    out = linear(attn, lp.wo, "TNH,NHD->TD")
    if lp.bo is not None:
        out = out + lp.bo
    if lp.post_attn_norm is not None:
        out = rms_norm(out, lp.post_attn_norm, cfg.rms_norm_eps, cfg.norm_weight_offset)
    return out


def dense_mlp(cfg: ModelConfig, lp: LayerParams, h: jax.Array) -> jax.Array:
    """The dense gated MLP of normed tokens h [T, D] -> [T, D] in h's dtype."""
    if lp.w_gate_up is not None:
        gate, up = linear_parts(h, lp.w_gate_up)
    else:
        gate = linear(h, lp.w_gate, "TD,DF->TF")
        up = linear(h, lp.w_up, "TD,DF->TF")
    return linear(_act(cfg, gate) * up, lp.w_down, "TF,FD->TD")


def mlp(
    cfg: ModelConfig, lp: LayerParams, h: jax.Array, layer: int | jax.Array | None
) -> jax.Array:
    """One layer's MLP of normed tokens h [T, D]: the dense MLP, or the mixture of experts
    (``moe.moe_mlp``) in the layers ``cfg.sparse_layers`` marks; a model mixing both picks by
    ``layer``: statically for a Python int (the unrolled layer loop), with ``lax.cond`` for an
    i32[] (traced under the layer scan)."""
    if not cfg.is_moe:
        return dense_mlp(cfg, lp, h)
    # On a mesh the routed experts are split over its "model" axis (expert_sharding).
    moe = moe_mlp if cfg.expert_split == "none" else sharded_moe_mlp
    if not cfg.has_dense_mlp:
        return moe(cfg, lp, h)
    if isinstance(layer, int):
        return moe(cfg, lp, h) if cfg.sparse_layers[layer] else dense_mlp(cfg, lp, h)
    sparse = jnp.asarray(cfg.sparse_layers)[layer]
    return jax.lax.cond(sparse, lambda h: moe(cfg, lp, h), lambda h: dense_mlp(cfg, lp, h), h)


def attention_output_and_mlp(
    cfg: ModelConfig,
    lp: LayerParams,
    x: jax.Array,
    attn: jax.Array,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """The rest of one layer: x [T, D] plus the output projection of ``attn`` [T, N, H] (in x's
    dtype), then plus the MLP of the result (``mlp``; ``layer`` i32[] is needed by a model that
    mixes dense and sparse layers); returns the new residual stream [T, D]."""
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
    x = x + attention_output(cfg, lp, attn)
    h = rms_norm(x, lp.mlp_norm, eps, off)
    out = mlp(cfg, lp, h, layer)
    if lp.post_mlp_norm is not None:
        out = rms_norm(out, lp.post_mlp_norm, eps, off)
    return x + out


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    cache: Cache,
    attn_fn: AttnFn[Cache],
    *,
    token_map: TokenMap | None = None,
) -> tuple[jax.Array, Cache]:
    """Runs the decoder stack over a flat batch of tokens.

    Args:
        params: model weights (float32 or bfloat16).
        cfg: architecture.
        tokens: i32[T] token ids.
        positions: i32[T] position of each token within its sequence.
        cache: KV cache pytree threaded through ``attn_fn`` (None for cache-less attention).
        attn_fn: attention of one layer, see ``AttnFn``.
        token_map: runs every per-token computation (embedding, RoPE tables, the layers' parts
            before and after attention, the final norm); None calls them on the whole token
            axis. ``jaxinfer.models.batch_invariant.map_token_tiles`` runs them in fixed-shape
            tiles.

    Returns:
        (hidden states [T, D] after the final norm, in the params' dtype; the updated cache).
    """
    tmap = token_map or _direct
    dtype = params.embed.dtype

    def embed(tokens):
        x = params.embed[tokens]
        if cfg.embed_scale:  # Gemma: the normalizer is rounded to the activation dtype first.
            x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=dtype)
        return x

    x = tmap(embed, tokens)
    rope_g = tmap(lambda p: rope_tables(cfg, p, local=False), positions)
    rope_l = None
    if cfg.has_local_rope:
        rope_l = tmap(lambda p: rope_tables(cfg, p, local=True), positions)
    windows = jnp.asarray(np.asarray(cfg.layer_windows, np.int32))
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset

    def layer_fn(carry, xs, static_layer: int | None = None):
        x, cache = carry
        lp, layer, window = xs
        mlp_layer = layer if static_layer is None else static_layer  # unrolled: known per layer
        lp: LayerParams
        if cfg.has_local_rope:
            is_local = window > 0
            cos = jnp.where(is_local, rope_l[0], rope_g[0])
            sin = jnp.where(is_local, rope_l[1], rope_g[1])
        else:
            cos, sin = rope_g
        q, k, v = tmap(lambda x, c, s: attention_inputs(cfg, lp, x, c, s), x, cos, sin)
        attn, cache = attn_fn(q, k, v, cache, layer, window, lp.sinks)
        x = tmap(
            lambda x, a: attention_output_and_mlp(cfg, lp, x, a.astype(dtype), mlp_layer), x, attn
        )
        return (x, cache), None

    unstacked = isinstance(params.layers, tuple)  # params.unstack_layers
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    if unstacked and (
        params.scan_from_tokens is None or tokens.shape[0] < params.scan_from_tokens
    ):  # unrolled loop
        for i, lp in enumerate(params.layers):
            (x, cache), _ = layer_fn((x, cache), (lp, jnp.int32(i), windows[i]), i)
    elif unstacked:  # a scan over the separate buffers: each step picks its layer's weights
        branches = [lambda lp=lp: lp for lp in params.layers]

        def switch_layer_fn(carry, xs):
            layer, window = xs
            return layer_fn(carry, (jax.lax.switch(layer, branches), layer, window))

        (x, cache), _ = jax.lax.scan(switch_layer_fn, (x, cache), (layers, windows))
    else:
        (x, cache), _ = jax.lax.scan(layer_fn, (x, cache), (params.layers, layers, windows))
    return tmap(lambda x: rms_norm(x, params.final_norm, eps, off), x), cache


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output logits f32[B, V] of hidden states [B, D] (final softcap applied when configured)."""
    # Accumulated in float32 and rounded to the params' dtype, as the reference rounds its logits.
    if params.lm_head is None:
        if isinstance(params.embed, QTensor):
            logits = linear(hidden, params.embed, "BD,VD->BV").astype(jnp.float32)
        else:  # the embedding [V, D] is already output-first
            logits = linear_out_in(hidden, params.embed, 1).astype(jnp.float32)
    else:
        logits = linear(hidden, params.lm_head, "BD,DV->BV").astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits
