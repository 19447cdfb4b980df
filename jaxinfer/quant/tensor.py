"""The quantized tensor pytree (int8 values, float32 per-output-channel scales) and ``quantize``.

Layout: a float weight is stored input-axes first (``wq: [L, D, N, H]``, contracted over D). Its
``QTensor`` keeps the same leading (layer) axes, then the output axes, then the contracted axes
last: ``values: i8[L, N, H, D]``, ``scales: f32[L, N, H]``. With the contracted axes minor, a
matrix-vector product is a row reduction over contiguous int8, which XLA CPU fuses with the
int8 -> float conversion (see ``matmul``). ``lax.scan`` over the stacked layers slices both leaves
on axis 0, so a per-layer slice is again a ``QTensor``.

Symmetric per-channel quantization (AQT's default for weights): ``s = max|w| / 127`` over the
contracted axes, ``q = round(w / s)`` in [-127, 127], ``w ~= q * s`` with ``|w - q * s| <= s / 2``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.params import (
    LAYER_PROJECTIONS,
    WEIGHT_FUSERS,
    LayerParams,
    OutInWeight,
    Params,
    output_first,
)

MODES = ("int8", "w8a8")
"""``"int8"``: weight-only (w8a16), activations stay float. ``"w8a8"``: activations quantized
per token at run time, integer dot."""

# Linear weights of a layer and the number of their input (contracted) axes, after the L axis:
# the attention projections, the dense MLP and the shared expert (mixture of experts).
LAYER_WEIGHTS = {**LAYER_PROJECTIONS, "shared_w_gate": 1, "shared_w_up": 1, "shared_w_down": 1}
# Expert weights [L, E, *in, *out], one input axis: quantized per expert and output channel
# (values i8[L, E, out, in], scales f32[L, E, out]). The router (and the shared expert's
# sigmoid gate) stay float: they choose experts, and int8 rounding would flip near-ties.
EXPERT_WEIGHTS = ("expert_gate_up", "expert_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """An int8 weight with float32 scales, one per output channel.

    Attributes:
        values: i8[*lead, *out, *in] quantized weight, contracted axes last.
        scales: f32[*lead, *out] per-output-channel scales.
        num_in: static, number of trailing contracted (input) axes of ``values``.
        act: static, ``"float"`` (w8a16: activations stay float) or ``"int8"`` (w8a8).
        dtype: static, the float dtype the weight stands for (activations and outputs).
        parts: static, for a fused weight (``fuse_qtensors``): the output shape of each fused
            projection, concatenated on one flat output axis of ``values``; None otherwise.
    """

    values: jax.Array
    scales: jax.Array
    num_in: int = dataclasses.field(metadata=dict(static=True), default=1)
    act: str = dataclasses.field(metadata=dict(static=True), default="float")
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True), default=jnp.dtype(jnp.float32))
    parts: tuple[tuple[int, ...], ...] | None = dataclasses.field(
        metadata=dict(static=True), default=None
    )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def __getitem__(self, idx) -> jax.Array:
        """Dequantized rows along axis 0 (an embedding lookup ``embed[tokens]``), in ``dtype``."""
        return (self.values[idx].astype(jnp.float32) * self.scales[idx][..., None]).astype(
            self.dtype
        )


def quantize_tensor(w: jax.Array, num_lead: int, num_in: int, act: str = "float") -> QTensor:
    """Quantizes a float weight ``[*lead, *in, *out]`` to a ``QTensor`` ``[*lead, *out, *in]``.

    Args:
        w: float weight, input axes before output axes (the params' layout).
        num_lead: leading axes kept in place (1 for stacked layer weights, else 0).
        num_in: input (contracted) axes following the leading ones.
        act: ``"float"`` or ``"int8"``, see ``QTensor.act``.
    """
    wt = output_first(w.astype(jnp.float32), num_lead, num_in)
    red = tuple(range(wt.ndim - num_in, wt.ndim))
    scales = jnp.max(jnp.abs(wt), axis=red) / 127.0
    safe = jnp.where(scales == 0, 1.0, scales)
    values = jnp.clip(jnp.round(wt / safe.reshape(safe.shape + (1,) * num_in)), -127, 127)
    return QTensor(
        values.astype(jnp.int8), scales.astype(jnp.float32), num_in, act, jnp.dtype(w.dtype)
    )


def fuse_qtensors(qs: list[QTensor], num_lead: int) -> QTensor:
    """Projections of the same input (wq, wk, wv; w_gate, w_up), each ``values i8[*lead, *out,
    I]``, as one ``QTensor`` ``values i8[*lead, S, I]``, ``scales f32[*lead, S]`` (S: the summed
    flat output sizes) with ``parts`` their output shapes: one integer dot (and one quantization
    of the activations) instead of one per projection; ``model.linear_parts`` splits the product.
    Exact: per-output-channel scales and per-row activation scales do not mix across outputs.

    Raises:
        ValueError: not all single-input-axis, unfused ``QTensor`` of one mode and dtype.
    """
    q0 = qs[0]
    if any(
        not isinstance(q, QTensor)
        or q.num_in != 1
        or q.parts is not None
        or (q.act, q.dtype) != (q0.act, q0.dtype)
        for q in qs
    ):
        raise ValueError(
            "fuse_qtensors needs unfused QTensor weights with one input axis, "
            "all of one mode and dtype"
        )
    lead = q0.values.shape[:num_lead]
    parts = tuple(q.values.shape[num_lead:-1] for q in qs)
    values = jnp.concatenate(
        [q.values.reshape(*lead, -1, q.values.shape[-1]) for q in qs], axis=num_lead
    )
    scales = jnp.concatenate([q.scales.reshape(*lead, -1) for q in qs], axis=num_lead)
    return QTensor(values, scales, 1, q0.act, q0.dtype, parts)


WEIGHT_FUSERS[QTensor] = fuse_qtensors  # params.out_in_projections fuses int8 weights too


def dequantize(q: QTensor) -> jax.Array:
    """The float weight ``q`` stands for, f32[*lead, *out, *in] (the stored, contracted-last
    layout; ``embed`` is ``[V, D]`` as in the params)."""
    return q.values.astype(jnp.float32) * q.scales.reshape(q.scales.shape + (1,) * q.num_in)


def _act(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r}; supported: {MODES}")
    return "int8" if mode == "w8a8" else "float"


def quantize(
    params: Params, mode: str = "int8", *, embed: bool = False, lm_head: bool = False
) -> Params:
    """Quantizes every linear weight of ``params`` (attention projections, MLP) to int8.

    Mixture of experts: the experts (per expert and output channel) and the shared expert too;
    the router and the shared expert's gate stay float. Norms, biases and (unless selected)
    the embedding and LM head stay float.

    Args:
        params: float params.
        mode: ``"int8"`` (weight-only, w8a16) or ``"w8a8"`` (int8 activations too).
        embed: also quantize the embedding ``[V, D]`` (per row; when tied, it is also the LM
            head).
        lm_head: also quantize an untied LM head ``[D, V]`` (per vocabulary column).

    Raises:
        ValueError: unknown mode, params already quantized, or params an engine has converted
            to its output-first CPU layout (quantize the loaded params, before the engine).
    """
    act = _act(mode)
    if is_quantized(params):
        raise ValueError("params are already quantized")
    if any(
        isinstance(x, OutInWeight)
        for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, OutInWeight))
    ):
        raise ValueError(
            "params are in an engine's output-first layout (OutInWeight); quantize "
            "the loaded params before building the engine (LLM(quantization=...))"
        )

    def qlayers(lp: LayerParams, lead: int) -> LayerParams:
        qs = {
            n: quantize_tensor(getattr(lp, n), lead, k, act)
            for n, k in LAYER_WEIGHTS.items()
            if getattr(lp, n) is not None  # no dense MLP when every layer is sparse
        }
        qs.update(
            {
                n: quantize_tensor(getattr(lp, n), lead + 1, 1, act)  # per expert and output
                for n in EXPERT_WEIGHTS
                if getattr(lp, n) is not None
            }
        )
        return dataclasses.replace(lp, **qs)

    if isinstance(params.layers, tuple):  # unstacked (params.unstack_layers)
        new_layers = tuple(qlayers(lp, 0) for lp in params.layers)
    else:
        new_layers = qlayers(params.layers, 1)
    new_embed = params.embed
    if embed:  # [V, D] is already output-first: V rows, contracted over D.
        new_embed = quantize_tensor(params.embed.T, 0, 1, act)
    new_head = params.lm_head
    if lm_head and params.lm_head is not None:
        new_head = quantize_tensor(params.lm_head, 0, 1, act)
    return dataclasses.replace(params, embed=new_embed, layers=new_layers, lm_head=new_head)


def with_mode(params: Params, mode: str) -> Params:
    """The same int8 weights run in another mode (w8a16 and w8a8 share their weights)."""
    act = _act(mode)
    return jax.tree.map(
        lambda x: dataclasses.replace(x, act=act) if isinstance(x, QTensor) else x,
        params,
        is_leaf=lambda x: isinstance(x, QTensor),
    )


def apply_quantization(params: Params, mode: str) -> Params:
    """``quantize(params, mode)`` for float params; quantized params (a quantized checkpoint)
    are switched to ``mode`` (w8a16 and w8a8 share the int8 weights)."""
    return with_mode(params, mode) if is_quantized(params) else quantize(params, mode)


def quant_mode(params: Params) -> str | None:
    """``"int8"``, ``"w8a8"`` or None (float params)."""
    qs = [
        x
        for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QTensor))
        if isinstance(x, QTensor)
    ]
    if not qs:
        return None
    return "w8a8" if qs[0].act == "int8" else "int8"


def is_quantized(params: Params) -> bool:
    return quant_mode(params) is not None


def weight_bytes(params: Params) -> int:
    """Bytes of all weights (int8 values, scales and float tensors), counted once."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


__all__ = [
    "MODES",
    "apply_quantization",
    "QTensor",
    "dequantize",
    "fuse_qtensors",
    "quantize",
    "quantize_tensor",
    "quant_mode",
    "is_quantized",
    "weight_bytes",
    "with_mode",
]
