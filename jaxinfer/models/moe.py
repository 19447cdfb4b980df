"""The mixture-of-experts MLP: routing, tokens sorted by expert, grouped matmuls, weighted combine.

Shape letters beyond STYLE.md's: E experts, A experts per token (top-k), I one expert's MLP
width, U the shared expert's MLP width.

One sparse layer, for a flat token axis T:

1. ``route``: router logits ``h @ router`` (accumulated in float32, rounded to the activation
   dtype as transformers' ``F.linear`` does, then float32), plus the router bias when the family
   has one; softmax then top-k (Mixtral, Qwen2/3-MoE, OLMoE) or top-k then softmax (gpt-oss);
   the k weights divided by their sum with ``norm_topk_prob``. Ties in the top-k go to the lower
   expert index (``jax.lax.top_k``, as ``torch.topk``; ``tests/test_moe_routing.py``).
2. ``expert_mlp``: the T*A (token, expert) pairs are flattened, sorted by expert with a stable
   argsort (a token's pairs keep their order within each expert's group), the per-expert group
   sizes counted (``bincount``), and each expert's SwiGLU computed on its contiguous rows as two
   grouped matmuls (``grouped_matmul``, over ``kernels_pallas.grouped_matmul.gmm``: gate and up
   fused in one, then down). Dropless: every
   pair is computed, no capacity factor. The rows are put back in pair order by the inverse
   permutation and each token's k outputs summed, weighted by their routing weights in float32.
   int8 experts (``QTensor``, ``quant.quantize``) go through ``expert_matmul``: the same grouped
   matmul on the int8 values, then each row's own expert's scales (``quant.grouped``).
   gpt-oss's experts (``cfg.expert_bias``, ``cfg.expert_glu == "gpt_oss_clamped"``) add their
   biases to each row after the grouped matmuls, the bias of the row's expert
   (``add_expert_bias``), and take the clamped SwiGLU (``gpt_oss_clamped_glu``).
3. Qwen2-MoE adds a shared expert (a dense SwiGLU of width S) every token runs, scaled by
   ``sigmoid(h . w)``.

Sources: transformers' modeling_mixtral / modeling_qwen2_moe / modeling_qwen3_moe /
modeling_olmoe / modeling_gpt_oss (``*TopKRouter``, ``*Experts``, ``*SparseMoeBlock``); the
sort-by-expert grouped matmul is MegaBlocks' dropless formulation (Gale et al., 2022).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import LayerParams
from jaxinfer.quant.grouped import grouped_qmatmul
from jaxinfer.quant.matmul import qlinear
from jaxinfer.quant.tensor import QTensor
from kernels_pallas.grouped_matmul import BACKENDS, gmm

GROUPED_MATMUL_IMPLS = BACKENDS  # "auto", "xla", "xla_tiled", "reference", "tpu", "gpu"


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    impl: str = "auto",
    group_offset: jax.Array | int = 0,
) -> jax.Array:
    """Rows of ``lhs`` [T, D], in consecutive groups, each times its group's ``rhs`` [E, D, F]:
    out[t] = lhs[t] @ rhs[e(t)] where rows ``sum(group_sizes[:e]) .. sum(group_sizes[:e+1])``
    belong to group e. Accumulated in float32, returned [T, F] in ``lhs``' dtype. With expert
    parallelism ``rhs`` holds E_local experts from ``group_offset`` on and the rows of the other
    experts give 0 (``gmm``'s contract).

    The one place the expert matmuls are dispatched: ``kernels_pallas.grouped_matmul.gmm`` with
    ``backend=impl`` ("auto": the platform's Pallas kernel where verified, else the tiled XLA
    loop on CPU, where XLA expands ``ragged_dot`` over every group, and ``jax.lax.ragged_dot``
    elsewhere; "xla": ``ragged_dot``; "xla_tiled"; "reference"; "tpu" / "gpu": the kernels).

    Args:
        lhs: [T, D] rows sorted by group (here T counts (token, expert) pairs).
        rhs: [E, D, F] one weight per group, ``lhs``' dtype.
        group_sizes: i32[E], rows of each group (zeros allowed); sum(group_sizes) == T.
        impl: one of ``GROUPED_MATMUL_IMPLS``.
        group_offset: i32[] (or int), the first expert ``rhs`` holds.

    Raises:
        ValueError: as ``gmm``: an unknown ``impl``, a kernel on another platform, shapes or
            dtypes it does not take.
    """
    out = gmm(lhs, rhs, group_sizes, group_offset, backend=impl, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def expert_matmul(
    lhs: jax.Array,
    w: jax.Array | QTensor,
    group_sizes: jax.Array,
    row_experts: jax.Array,
    impl: str = "auto",
    group_offset: jax.Array | int = 0,
) -> jax.Array:
    """``grouped_matmul`` of rows ``lhs`` [M, K] with float expert weights ``w`` [E, K, N], or
    with int8 ones (a ``QTensor``, values i8[E, N, K], scales f32[E, N]: ``quant.grouped``,
    each row's output columns scaled by its own expert's ``row_experts`` i32[M] scales).
    Returns [M, N] in ``lhs``' dtype. ``group_offset``: the first expert ``w`` holds (float
    weights only: int8 experts run unsharded, ``expert_sharding`` refuses them on a mesh)."""
    if isinstance(w, QTensor):
        return grouped_qmatmul(
            lhs, w, group_sizes, row_experts, lambda x, r, g: grouped_matmul(x, r, g, impl)
        )
    return grouped_matmul(lhs, w, group_sizes, impl, group_offset)


def route(
    cfg: ModelConfig, router: jax.Array, router_bias: jax.Array | None, h: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Routing of tokens h [T, D] with router weights [D, E] (and bias [E] or None).

    Returns:
        (weights f32[T, A], experts i32[T, A]): each token's A (top-k) experts, in descending
        order of router probability (ties: lower expert index first), and their routing
        weights.
    """
    logits = jnp.einsum("TD,DE->TE", h, router, preferred_element_type=jnp.float32)
    logits = logits.astype(h.dtype).astype(jnp.float32)  # as transformers: F.linear, then .float()
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    a = cfg.num_experts_per_tok
    if cfg.router_order == "softmax_topk":
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), a)
    else:  # "topk_softmax"
        top, experts = jax.lax.top_k(logits, a)
        weights = jax.nn.softmax(top, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _silu_glu(gate_up: jax.Array) -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def gpt_oss_clamped_glu(gate_up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's clamped SwiGLU of gate_up [R, 2I] (gate the first I columns, up the last I;
    the checkpoint's interleaved columns are split at load) -> [R, I] in its dtype:
    ``(clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g))`` with ``g = min(gate, limit)``.

    Source: transformers' ``GptOssExperts._apply_gate`` (modeling_gpt_oss).
    """
    i = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :i], gate_up[..., i:]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def expert_glu(cfg: ModelConfig, gate_up: jax.Array) -> jax.Array:
    """The experts' gated activation (``cfg.expert_glu``) of gate_up [R, 2I] -> [R, I]."""
    if cfg.expert_glu == "gpt_oss_clamped":
        return gpt_oss_clamped_glu(gate_up, cfg.swiglu_limit, cfg.swiglu_alpha)
    return _silu_glu(gate_up)


def add_expert_bias(
    x: jax.Array, bias: jax.Array | None, row_experts: jax.Array, first_expert: jax.Array | int = 0
) -> jax.Array:
    """Rows x [R, F] sorted by expert, plus each row's expert's bias: ``x[r] + bias[e(r)]``
    with bias [E, F] (None: x unchanged) and row_experts i32[R] the expert of each row. With
    expert parallelism ``bias`` [E_local, F] holds experts ``first_expert ..`` and the rows of
    the other experts get no bias."""
    if bias is None:
        return x
    local = row_experts - first_expert
    mine = (local >= 0) & (local < bias.shape[0])
    b = bias[jnp.clip(local, 0, bias.shape[0] - 1)].astype(x.dtype)
    return x + jnp.where(mine[:, None], b, jnp.zeros_like(b))


def expert_mlp(
    cfg: ModelConfig,
    expert_gate_up: jax.Array,
    expert_down: jax.Array,
    h: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    impl: str = "auto",
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
) -> jax.Array:
    """The routed experts' SwiGLU outputs of tokens h [T, D], weighted and summed: [T, D] in h's
    dtype.

    Args:
        expert_gate_up: [E, D, 2I]; expert_down: [E, I, D] (or int8 ``QTensor`` values
            i8[E, 2I, D] and i8[E, D, I], ``expert_matmul``).
        h: [T, D] normed residual stream.
        weights: f32[T, A]; experts: i32[T, A] (``route``).
        impl: the grouped matmul's (``grouped_matmul``).
        gate_up_bias: [E, 2I] | None; down_bias: [E, D] | None (gpt-oss's expert biases, added
            after each grouped matmul).
    """
    y = expert_mlp_partial(
        cfg, expert_gate_up, expert_down, h, weights, experts, impl, gate_up_bias, down_bias
    )
    return y.astype(h.dtype)


def expert_mlp_partial(
    cfg: ModelConfig,
    expert_gate_up: jax.Array,
    expert_down: jax.Array,
    h: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    impl: str = "auto",
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    first_expert: jax.Array | int = 0,
) -> jax.Array:
    """``expert_mlp`` before its final cast, f32[T, D], over the experts the weights hold:
    ``expert_gate_up`` [E_local, D, 2I], ``expert_down`` [E_local, I, D] (biases
    [E_local, 2I], [E_local, D]) are experts ``first_expert .. first_expert + E_local - 1`` of
    the ``cfg.num_experts``; every token is routed as on one device and the (token, expert)
    pairs of the other experts contribute 0. With all E experts (``first_expert`` 0) it is
    ``expert_mlp``; ``expert_sharding`` sums the shards' partials over the mesh."""
    t, a = experts.shape
    flat = experts.reshape(-1)  # [T*A] pair p = (token p // A, choice p % A)
    order = jnp.argsort(flat, stable=True)  # sorted row -> pair
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    rows = h[order // a]  # [T*A, D] sorted by expert
    row_experts = flat[order]  # i32[T*A], each sorted row's expert
    off = first_expert

    def matmul(x, w):
        return expert_matmul(x, w, group_sizes, row_experts, impl, off)

    gate_up = add_expert_bias(matmul(rows, expert_gate_up), gate_up_bias, row_experts, off)
    out = matmul(expert_glu(cfg, gate_up), expert_down)  # [T*A, D] sorted; other experts' 0
    out = add_expert_bias(out, down_bias, row_experts, off)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    pairs = out[inverse].reshape(t, a, -1)  # [T, A, D] back in pair order
    return jnp.einsum("TAD,TA->TD", pairs.astype(jnp.float32), weights)


def moe_mlp(cfg: ModelConfig, lp: LayerParams, h: jax.Array, impl: str = "auto") -> jax.Array:
    """One sparse layer's MLP of normed tokens h [T, D] -> [T, D] in h's dtype: the routed
    experts plus, when the family has one, the (gated) shared expert. ``lp`` holds one layer's
    weights (no L axis)."""
    weights, experts = route(cfg, lp.router, lp.router_bias, h)
    y = expert_mlp(
        cfg,
        lp.expert_gate_up,
        lp.expert_down,
        h,
        weights,
        experts,
        impl,
        gate_up_bias=lp.expert_gate_up_bias,
        down_bias=lp.expert_down_bias,
    )
    return add_shared_expert(lp, h, y)


def add_shared_expert(lp: LayerParams, h: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` [T, D] plus the (gated) shared expert's output of h [T, D] when the layer has one
    (Qwen2-MoE), else ``y``."""
    if lp.shared_w_gate is None:
        return y
    f32 = jnp.float32

    def proj(x, w, spec):
        if isinstance(w, QTensor):  # int8 shared expert, as a dense MLP's projections
            return qlinear(x, w, spec)
        return jnp.einsum(spec, x, w, preferred_element_type=f32).astype(h.dtype)

    gate = proj(h, lp.shared_w_gate, "TD,DU->TU")
    up = proj(h, lp.shared_w_up, "TD,DU->TU")
    shared = proj(jax.nn.silu(gate) * up, lp.shared_w_down, "TU,UD->TD")
    if lp.shared_expert_gate is not None:
        g = proj(h, lp.shared_expert_gate, "TD,D->T")
        shared = jax.nn.sigmoid(g)[:, None] * shared
    return y + shared
