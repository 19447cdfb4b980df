"""Mixture-of-experts layers on a tensor-parallel mesh: expert parallelism (the experts split over
the "model" axis) or the experts' width split over it, and the sharded MoE MLP.

Shape letters beyond STYLE.md's (``moe``'s): E experts, A experts per token (top-k), I one
expert's MLP width, U the shared expert's width; ``tp`` the size of the "model" axis.

Two ways to split the routed experts (``ModelConfig.expert_split``, chosen by
``plan_experts``), both vLLM's:

- ``"experts"`` (``enable_expert_parallel``, vLLM's ``--enable-expert-parallel``): each device of
  the "model" axis holds E / tp whole experts (expert_gate_up [L, E, D, 2I] and expert_down
  [L, E, I, D] split on E). The activations are replicated over the axis (they are after
  attention's all-reduce); every device routes all T tokens, sorts all T*A (token, expert) pairs
  by expert, and runs the grouped matmul over its own experts only (``gmm``'s ``group_offset`` =
  shard index * E / tp: rows of the other experts give 0), so its partial output holds the
  weighted sum of its experts' contributions; a ``psum`` over "model" adds the partials. The
  token exchange is thus an all-gather (the replicated activations) and a reduce-sum, the shape
  of Megatron's tensor-parallel MLP: no all-to-all dispatch is built, because every device
  already holds every token after attention (whose output is all-reduced over the same axis),
  and sending each token only to its experts' devices pays off only when the tokens are split
  over the expert axis to begin with (sequence or data parallel attention), which this engine's
  tensor parallelism does not do.
- ``"width"`` (the default on a mesh, vLLM's default without the flag): each expert's width I is
  split over "model" like a dense MLP's F (gate and up columns, down rows), every device runs
  every expert on a slice of its width, and a ``psum`` adds the partial down projections.
  expert_gate_up's fused [gate | up] columns are laid out per shard at load
  (``prepare_expert``: shard s holds ``[gate_s | up_s]``), and I is zero-padded to a multiple of
  tp when it does not divide (a padded unit computes act(0) * 0 = 0, exactly).

``"none"``: one device, or a dense model. In both split modes the router (and its bias) is
replicated and routing runs on every device as on one; the shared expert (Qwen2-MoE, width U
zero-padded to a multiple of tp) and the dense layers of models that mix them are split like
dense MLPs and left to XLA's SPMD partitioner. gpt-oss's expert biases: the gate_up bias is split
with its weight; the down bias is added once, after the ``psum``, as ``sum_a w_a b[e_a]`` on
the replicated routing (``down_bias_term``).

Data parallel: the experts are split over each replica's "model" axis and replicated over
"data" (EP size = tp, not vLLM's tp * dp): this engine's data-parallel replicas are independent
engines with their own schedulers stepping in turn on their own devices, while experts split
across replicas would need every replica in every step (vLLM's lockstep DP + EP).

Source: vLLM's ``FusedMoE`` (``expert_map``, ``--enable-expert-parallel``); megablox's ``gmm``
``group_offset``; Megatron-LM's tensor-parallel MLP for the width split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ShardingError
from jaxinfer.models.config import EXPERT_SPLITS, ModelConfig
from jaxinfer.models.moe import add_shared_expert, expert_mlp_partial, route
from jaxinfer.models.params import LayerParams

AXIS = "model"

# PartitionSpec of each MoE field of ``param_shapes`` (stacked: leading L axis), per split.
_ROUTED = {
    "experts": {
        "expert_gate_up": P(None, AXIS, None, None),
        "expert_down": P(None, AXIS, None, None),
        "expert_gate_up_bias": P(None, AXIS, None),
    },
    "width": {
        "expert_gate_up": P(None, None, None, AXIS),
        "expert_down": P(None, None, AXIS, None),
        "expert_gate_up_bias": P(None, None, AXIS),
    },
}
_SHARED = {
    "shared_w_gate": P(None, None, AXIS),
    "shared_w_up": P(None, None, AXIS),
    "shared_w_down": P(None, AXIS, None),
}
# Replicated on every device: the router and its bias, the experts' down bias (added after the
# psum), the shared expert's gate.
_REPLICATED = ("router", "router_bias", "expert_down_bias", "shared_expert_gate")
MOE_FIELDS = (*_ROUTED["experts"], *_SHARED, *_REPLICATED)


def plan_experts(cfg: ModelConfig, tp: int, enable_expert_parallel: bool = False) -> ModelConfig:
    """The config an MoE model runs with on ``tp`` devices of the "model" axis: ``expert_split``
    set (module docstring), the expert width I and the shared expert's width U zero-padded to
    multiples of ``tp`` where they are split. A dense model or ``tp`` = 1 returns ``cfg``.

    Raises:
        ShardingError: ``enable_expert_parallel`` with a dense model or with ``tp`` = 1 (nothing
            to shard it over), or ``num_experts`` not divisible by ``tp`` (naming the sizes and
            what can run).
    """
    if enable_expert_parallel and not cfg.is_moe:
        raise ShardingError(
            f"enable_expert_parallel needs a mixture-of-experts model; {cfg.model_type!r} is "
            "dense: drop the option"
        )
    if enable_expert_parallel and tp == 1:
        raise ShardingError(
            "enable_expert_parallel splits the experts over the tensor_parallel_size devices of "
            "each replica, but tensor_parallel_size=1: give tensor_parallel_size > 1 (a divisor "
            f"of num_experts={cfg.num_experts}) or drop the option"
        )
    if not cfg.is_moe or tp == 1:
        return cfg
    e = cfg.num_experts
    if enable_expert_parallel and e % tp:
        divisors = [d for d in range(2, e + 1) if e % d == 0]
        raise ShardingError(
            f"cannot split num_experts={e} over tensor_parallel_size={tp} devices with "
            f"enable_expert_parallel ({e} % {tp} = {e % tp}): use a tensor_parallel_size among "
            f"{divisors}, or drop enable_expert_parallel to split each expert's width instead"
        )
    split = "experts" if enable_expert_parallel else "width"
    width = cfg.moe_intermediate_size
    if split == "width":
        width = -(-width // tp) * tp
    shared = -(-cfg.shared_expert_intermediate_size // tp) * tp
    return dataclasses.replace(
        cfg, expert_split=split, moe_intermediate_size=width, shared_expert_intermediate_size=shared
    )


def expert_field_spec(cfg: ModelConfig, name: str) -> P | None:
    """PartitionSpec of layer field ``name`` (stacked, leading L) under ``cfg.expert_split``;
    None when ``name`` is not an MoE field (or the model runs unsplit)."""
    if cfg.expert_split == "none" or name not in MOE_FIELDS:
        return None
    return _ROUTED[cfg.expert_split].get(name) or _SHARED.get(name) or P()


def prepare_expert(cfg: ModelConfig, tp: int, name: str, x: np.ndarray) -> np.ndarray:
    """One host tensor of an MoE field in the layout ``expert_field_spec`` splits: the width
    split's zero padding of I (and the shared expert's of U) and its per-shard [gate | up]
    column order; other fields unchanged.

    Args:
        cfg: the run config (``plan_experts``), whose widths are the padded ones.
        tp: the "model" axis size.
        name: the layer field (``"expert_gate_up"``, ...).
        x: its stacked host tensor as loaded ([L, E, D, 2I], ...).
    """
    if cfg.expert_split == "none":
        return x
    if name in ("shared_w_gate", "shared_w_up", "shared_w_down"):
        return _pad(x, 2 if name != "shared_w_down" else 1, cfg.shared_expert_intermediate_size)
    if cfg.expert_split != "width":
        return x
    width = cfg.moe_intermediate_size
    if name == "expert_down":  # [L, E, I, D]
        return _pad(x, 2, width)
    if name in ("expert_gate_up", "expert_gate_up_bias"):  # [..., 2I] = [gate | up]
        i = x.shape[-1] // 2
        gate = _pad(x[..., :i], x.ndim - 1, width)
        up = _pad(x[..., i:], x.ndim - 1, width)
        lead = x.shape[:-1]
        per = width // tp  # shard s: [gate_s | up_s]
        both = np.stack([gate.reshape(*lead, tp, per), up.reshape(*lead, tp, per)], axis=-2)
        return both.reshape(*lead, 2 * width)
    return x


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    if x.shape[axis] >= size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return np.pad(x, widths)


def down_bias_term(weights: jax.Array, experts: jax.Array, down_bias: jax.Array) -> jax.Array:
    """Each token's routed down-projection biases, weighted: f32[T, D] ``sum_a w[t, a] *
    down_bias[experts[t, a]]`` for weights f32[T, A], experts i32[T, A], down_bias [E, D]."""
    b = down_bias[experts].astype(jnp.float32)  # [T, A, D]
    return jnp.einsum("TAD,TA->TD", b, weights)


def sharded_moe_mlp(
    cfg: ModelConfig, lp: LayerParams, h: jax.Array, impl: str = "auto"
) -> jax.Array:
    """``moe.moe_mlp`` with the routed experts split over the "model" axis of the context mesh
    (``jax.set_mesh``) as ``cfg.expert_split`` says: normed tokens h [T, D] (replicated) -> [T, D]
    in h's dtype, replicated.

    Raises:
        ValueError: ``cfg.expert_split`` is "none" or unknown; traced with no mesh in context
            (jax's own error).
    """
    if cfg.expert_split not in ("experts", "width"):
        raise ValueError(
            f"sharded_moe_mlp needs expert_split 'experts' or 'width', got {cfg.expert_split!r}"
        )
    weights, experts = route(cfg, lp.router, lp.router_bias, h)  # replicated: every device
    specs = _ROUTED[cfg.expert_split]
    gu_bias = lp.expert_gate_up_bias
    by_experts = cfg.expert_split == "experts"

    def local(gate_up, down, gate_up_bias, h, weights, experts):
        # Expert split: this shard holds experts [first, first + E / tp); width split: all E.
        first = jax.lax.axis_index(AXIS) * gate_up.shape[0] if by_experts else 0
        y = expert_mlp_partial(
            cfg, gate_up, down, h, weights, experts, impl, gate_up_bias, None, first
        )
        return jax.lax.psum(y, AXIS)

    bias_spec = P(*specs["expert_gate_up_bias"][1:])
    y = jax.shard_map(
        local,
        in_specs=(
            P(*specs["expert_gate_up"][1:]),
            P(*specs["expert_down"][1:]),
            bias_spec,
            P(),
            P(),
            P(),
        ),
        out_specs=P(),
        # The grouped-matmul kernels (loops, Pallas calls) do not track varying manual axes.
        check_vma=False,
    )(lp.expert_gate_up, lp.expert_down, gu_bias, h, weights, experts)
    if lp.expert_down_bias is not None:
        y = y + down_bias_term(weights, experts, lp.expert_down_bias)
    return add_shared_expert(lp, h, y.astype(h.dtype))


__all__ = [
    "EXPERT_SPLITS",
    "MOE_FIELDS",
    "down_bias_term",
    "expert_field_spec",
    "plan_experts",
    "prepare_expert",
    "sharded_moe_mlp",
]
