"""The mixture-of-experts MLP: routing, tokens sorted by expert, grouped matmuls, weighted combine.

One sparse layer, for a flat token axis T:

1. ``route``: router logits ``h @ router`` (accumulated in float32, rounded to the activation
   dtype as transformers' ``F.linear`` does, then float32), plus the router bias when the family
   has one; softmax then top-k (Mixtral, Qwen2/3-MoE, OLMoE) or top-k then softmax (gpt-oss);
   the k weights divided by their sum with ``norm_topk_prob``. Ties in the top-k go to the lower
   expert index (``jax.lax.top_k``, as ``torch.topk``; ``tests/test_moe_routing.py``).
2. ``expert_mlp``: the T*k (token, expert) pairs are flattened, sorted by expert with a stable
   argsort (a token's pairs keep their order within each expert's group), the per-expert group
   sizes counted (``bincount``), and each expert's SwiGLU computed on its contiguous rows as two
   grouped matmuls (``grouped_matmul``: gate and up fused in one, then down). Dropless: every
   pair is computed, no capacity factor. The rows are put back in pair order by the inverse
   permutation and each token's k outputs summed, weighted by their routing weights in float32.
3. Qwen2-MoE adds a shared expert (a dense SwiGLU of width S) every token runs, scaled by
   ``sigmoid(h . w)``.

Sources: transformers' modeling_mixtral / modeling_qwen2_moe / modeling_qwen3_moe /
modeling_olmoe (``*TopKRouter``, ``*Experts``, ``*SparseMoeBlock``); the sort-by-expert grouped
matmul is MegaBlocks' dropless formulation (Gale et al., 2022).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import LayerParams

GROUPED_MATMUL_IMPLS = ("auto", "xla", "xla_tiled")
TILE_ROWS = 32  # rows of one tile of "xla_tiled"


def resolve_grouped_matmul_impl(impl: str, backend: str | None = None) -> str:
    """The grouped matmul ``impl`` runs on ``backend`` (default: jax's): "auto" is "xla_tiled"
    on CPU (where XLA expands ``ragged_dot`` over every group, docs/models.md) and "xla"
    elsewhere.

    Raises:
        ValueError: an ``impl`` not in ``GROUPED_MATMUL_IMPLS``.
    """
    if impl not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"grouped matmul impl={impl!r}; supported: {GROUPED_MATMUL_IMPLS}")
    if impl != "auto":
        return impl
    return "xla_tiled" if (backend or jax.default_backend()) == "cpu" else "xla"


def grouped_matmul(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, impl: str = "auto"
) -> jax.Array:
    """Rows of ``lhs`` [M, K], in consecutive groups, each times its group's ``rhs`` [G, K, N]:
    out[m] = lhs[m] @ rhs[g(m)] where rows ``sum(group_sizes[:g]) .. sum(group_sizes[:g+1])``
    belong to group g. Accumulated in float32, returned [M, N] in ``lhs``' dtype.

    Args:
        lhs: [M, K] rows sorted by group.
        rhs: [G, K, N] one weight per group.
        group_sizes: i32[G], rows of each group (zeros allowed); sum(group_sizes) == M.
        impl: ``"xla"``: ``jax.lax.ragged_dot``; ``"xla_tiled"``: ``grouped_matmul_tiled``;
            ``"auto"``: ``resolve_grouped_matmul_impl``. The one place a grouped-matmul kernel
            plugs in (``kernels_pallas.grouped_matmul.gmm`` takes the same arguments).

    Raises:
        ValueError: an ``impl`` not in ``GROUPED_MATMUL_IMPLS``.
    """
    impl = resolve_grouped_matmul_impl(impl)
    if impl == "xla":
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        return out.astype(lhs.dtype)
    return grouped_matmul_tiled(lhs, rhs, group_sizes)


def grouped_matmul_tiled(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int = TILE_ROWS
) -> jax.Array:
    """``grouped_matmul`` as a loop over (row tile, group) visits, MegaBlox's schedule in XLA:
    the rows are cut in tiles of ``tile``; each non-empty group visits the tiles its rows touch
    and adds ``lhs[tile] @ rhs[g]`` to the rows it owns. At most ``ceil(M / tile) + G - 1``
    visits (a tile shared by two groups is computed twice), each one small dense matmul, and an
    empty group costs nothing; ``ragged_dot``'s CPU expansion costs every group on every row.

    Args and result as ``grouped_matmul``.
    """
    m, k = lhs.shape
    n = rhs.shape[-1]
    tiles = max(1, -(-m // tile))
    lhs_p = jnp.pad(lhs, ((0, tiles * tile - m), (0, 0)))
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    visits = jnp.where(sizes > 0, (ends - 1) // tile - first + 1, 0)  # tiles per group
    visit_ends = jnp.cumsum(visits)
    rows = jnp.arange(tile, dtype=jnp.int32)

    def body(carry):
        v, out = carry
        g = jnp.searchsorted(visit_ends, v, side="right")  # the group of visit v
        t = first[g] + v - (visit_ends[g] - visits[g])  # its tile
        x = jax.lax.dynamic_slice(lhs_p, (t * tile, 0), (tile, k))
        y = jnp.dot(x, rhs[g], preferred_element_type=jnp.float32)
        r = t * tile + rows
        owned = ((r >= starts[g]) & (r < ends[g]))[:, None]
        cur = jax.lax.dynamic_slice(out, (t * tile, 0), (tile, n))
        out = jax.lax.dynamic_update_slice(out, jnp.where(owned, y, cur), (t * tile, 0))
        return v + 1, out

    out = jnp.zeros((tiles * tile, n), jnp.float32)
    _, out = jax.lax.while_loop(lambda c: c[0] < visit_ends[-1], body, (jnp.int32(0), out))
    return out[:m].astype(lhs.dtype)


def route(
    cfg: ModelConfig, router: jax.Array, router_bias: jax.Array | None, h: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Routing of tokens h [T, D] with router weights [D, E] (and bias [E] or None).

    Returns:
        (weights f32[T, k], experts i32[T, k]): each token's k experts, in descending order of
        router probability (ties: lower expert index first), and their routing weights.
    """
    logits = jnp.einsum("TD,DE->TE", h, router, preferred_element_type=jnp.float32)
    logits = logits.astype(h.dtype).astype(jnp.float32)  # as transformers: F.linear, then .float()
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    k = cfg.num_experts_per_tok
    if cfg.router_order == "softmax_topk":
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    else:  # "topk_softmax"
        top, experts = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _silu_glu(gate_up: jax.Array) -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def expert_mlp(
    cfg: ModelConfig,
    expert_gate_up: jax.Array,
    expert_down: jax.Array,
    h: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    impl: str = "auto",
) -> jax.Array:
    """The routed experts' SwiGLU outputs of tokens h [T, D], weighted and summed: [T, D] in h's
    dtype.

    Args:
        expert_gate_up: [E, D, 2I]; expert_down: [E, I, D].
        h: [T, D] normed residual stream.
        weights: f32[T, k]; experts: i32[T, k] (``route``).
        impl: the grouped matmul's (``grouped_matmul``).
    """
    t, k = experts.shape
    flat = experts.reshape(-1)  # [T*k] pair p = (token p // k, slot p % k)
    order = jnp.argsort(flat, stable=True)  # sorted row -> pair
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    rows = h[order // k]  # [T*k, D] sorted by expert
    act = _silu_glu(grouped_matmul(rows, expert_gate_up, group_sizes, impl))
    out = grouped_matmul(act, expert_down, group_sizes, impl)  # [T*k, D] sorted
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    pairs = out[inverse].reshape(t, k, -1)  # back in pair order
    y = jnp.einsum("TKD,TK->TD", pairs.astype(jnp.float32), weights)
    return y.astype(h.dtype)


def moe_mlp(cfg: ModelConfig, lp: LayerParams, h: jax.Array, impl: str = "auto") -> jax.Array:
    """One sparse layer's MLP of normed tokens h [T, D] -> [T, D] in h's dtype: the routed
    experts plus, when the family has one, the (gated) shared expert. ``lp`` holds one layer's
    weights (no L axis)."""
    weights, experts = route(cfg, lp.router, lp.router_bias, h)
    y = expert_mlp(cfg, lp.expert_gate_up, lp.expert_down, h, weights, experts, impl)
    if lp.shared_w_gate is not None:
        f32 = jnp.float32

        def proj(x, w, spec):
            return jnp.einsum(spec, x, w, preferred_element_type=f32).astype(h.dtype)

        gate = proj(h, lp.shared_w_gate, "TD,DS->TS")
        up = proj(h, lp.shared_w_up, "TD,DS->TS")
        shared = proj(jax.nn.silu(gate) * up, lp.shared_w_down, "TS,SD->TD")
        if lp.shared_expert_gate is not None:
            g = proj(h, lp.shared_expert_gate, "TD,D->T")
            shared = jax.nn.sigmoid(g)[:, None] * shared
        y = y + shared
    return y
