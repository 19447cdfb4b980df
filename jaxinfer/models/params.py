"""Parameter pytrees of the transformer: frozen dataclasses of arrays, layers stacked on axis 0.

Weights are stored input-dim first so a projection is ``einsum("TD,DNH->TNH", x, wq)``. Optional
tensors (biases, q/k norms, Gemma's sandwich norms, an untied LM head) are None when the family
does not have them; None is an empty pytree node, so ``jax.tree.map`` skips it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Weights of all L layers, stacked on a leading L axis.

    Attributes:
        attn_norm: [L, D] RMSNorm before attention.
        wq: [L, D, N, H]; wk, wv: [L, D, K, H]; wo: [L, N, H, D].
        bq: [L, N, H] | None; bk, bv: [L, K, H] | None (Qwen2 and gpt-oss q/k/v bias).
        bo: [L, D] | None (gpt-oss o_proj bias, ``ModelConfig.attention_out_bias``).
        sinks: [L, N] | None (gpt-oss per-head attention-sink logits,
            ``ModelConfig.attention_sinks``).
        q_norm, k_norm: [L, H] | None (Qwen3, Gemma 3); [L, N, H] and [L, K, H] when the norm
            runs over the whole projection (``qk_norm_flat``, OLMoE).
        post_attn_norm: [L, D] | None (Gemma 2/3, applied to the attention output).
        mlp_norm: [L, D] RMSNorm before the MLP.
        post_mlp_norm: [L, D] | None (Gemma 2/3).
        w_gate, w_up: [L, D, F]; w_down: [L, F, D]: the dense MLP (None when every layer is
            sparse; zeros in the sparse layers of a model that mixes both).
        router: [L, D, E] | None, the mixture-of-experts router (zeros in dense layers).
        router_bias: [L, E] | None (``router_bias``).
        expert_gate_up: [L, E, D, 2I] | None, each expert's gate (first I columns) and up
            (last I) projections; expert_down: [L, E, I, D] | None.
        shared_w_gate, shared_w_up: [L, D, U] | None; shared_w_down: [L, U, D] | None: the shared
            expert (Qwen2-MoE).
        shared_expert_gate: [L, D] | None, the shared expert's sigmoid gate weight.
        wqkv: ``OutInWeight`` [L, (N + 2K) H, D] | None: wq, wk, wv fused output-first (then
            those three are None); w_gate_up: ``OutInWeight`` [L, 2F, D] | None, likewise
            (``out_in_projections``).
    """

    attn_norm: jax.Array
    wq: jax.Array | None
    wk: jax.Array | None
    wv: jax.Array | None
    wo: jax.Array
    mlp_norm: jax.Array
    w_gate: jax.Array | None
    w_up: jax.Array | None
    w_down: jax.Array
    bq: jax.Array | None = None
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    bo: jax.Array | None = None
    sinks: jax.Array | None = None
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    post_attn_norm: jax.Array | None = None
    post_mlp_norm: jax.Array | None = None
    wqkv: OutInWeight | None = None
    w_gate_up: OutInWeight | None = None
    router: jax.Array | None = None
    router_bias: jax.Array | None = None
    expert_gate_up: jax.Array | None = None
    expert_down: jax.Array | None = None
    shared_w_gate: jax.Array | None = None
    shared_w_up: jax.Array | None = None
    shared_w_down: jax.Array | None = None
    shared_expert_gate: jax.Array | None = None


# Projection weights of a layer and the number of their input (contracted) axes (after any
# stacked L axis): wq [D, N, H] contracts one axis, wo [N, H, D] two.
LAYER_PROJECTIONS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutInWeight:
    """A float projection weight stored output axes first, contracted (input) axes last.

    ``model.linear`` computes ``x @ w`` with it as ``w @ x^T`` (``model.linear_out_in``), the
    form XLA CPU's GEMM runs fastest for a few rows (see ``out_in_projections``).

    A fused weight (``parts`` given) holds several projections of the same input concatenated on
    one flat output axis, e.g. wq, wk, wv as ``[(N + 2K) H, D]`` with parts ``((N, H), (K, H),
    (K, H))``: one GEMM instead of three (vLLM's QKVParallelLinear / MergedColumnParallelLinear);
    ``model.linear_parts`` splits its product.

    Attributes:
        values: [*out, *in], e.g. wq [D, N, H] is stored [N, H, D] and wo [N, H, D] as [D, N, H];
            fused: [sum of the parts' sizes, *in].
        num_in: static, number of trailing input axes.
        parts: static output shape of each fused projection, or None for a single projection.
    """

    values: jax.Array
    num_in: int = dataclasses.field(metadata=dict(static=True), default=1)
    parts: tuple[tuple[int, ...], ...] | None = dataclasses.field(
        metadata=dict(static=True), default=None
    )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """All weights of a model.

    Attributes:
        embed: [V, D] token embedding.
        layers: stacked per-layer weights ([L, ...] arrays, run under ``lax.scan``), or a tuple of
            L unstacked ``LayerParams`` (one buffer per layer, run as an unrolled loop; see
            ``unstack_layers``).
        final_norm: [D].
        lm_head: [D, V], or None when tied to ``embed``.
        scan_from_tokens: static; with unstacked layers, a forward over at least this many
            tokens runs them as ``lax.scan`` all the same (``model.forward``: each layer's
            buffers picked by ``lax.switch``), a shorter one unrolled; None = always unrolled.
            Ignored for stacked layers (always a scan). Set by ``unstack_layers``.
    """

    embed: jax.Array
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: jax.Array
    lm_head: jax.Array | None = None
    scan_from_tokens: int | None = dataclasses.field(metadata=dict(static=True), default=None)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every (non-None) field, keyed ``"embed"``, ``"layers.wq"``, ...

    Loaders check tensors against this and name the field on a mismatch.
    """
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {
        "embed": (V, D),
        "final_norm": (D,),
        "layers.attn_norm": (L, D),
        "layers.wq": (L, D, N, H),
        "layers.wk": (L, D, K, H),
        "layers.wv": (L, D, K, H),
        "layers.wo": (L, N, H, D),
        "layers.mlp_norm": (L, D),
    }
    if cfg.has_dense_mlp:
        shapes.update(
            {"layers.w_gate": (L, D, F), "layers.w_up": (L, D, F), "layers.w_down": (L, F, D)}
        )
    if cfg.is_moe:
        E, In, U = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update(
            {
                "layers.router": (L, D, E),
                "layers.expert_gate_up": (L, E, D, 2 * In),
                "layers.expert_down": (L, E, In, D),
            }
        )
        if cfg.router_bias:
            shapes["layers.router_bias"] = (L, E)
        if U:
            shapes.update(
                {
                    "layers.shared_w_gate": (L, D, U),
                    "layers.shared_w_up": (L, D, U),
                    "layers.shared_w_down": (L, U, D),
                }
            )
        if cfg.shared_expert_gate:
            shapes["layers.shared_expert_gate"] = (L, D)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, N, H), "layers.bk": (L, K, H), "layers.bv": (L, K, H)})
    if cfg.attention_out_bias:
        shapes["layers.bo"] = (L, D)
    if cfg.attention_sinks:
        shapes["layers.sinks"] = (L, N)
    if cfg.qk_norm_flat:
        shapes.update({"layers.q_norm": (L, N, H), "layers.k_norm": (L, K, H)})
    elif cfg.qk_norm:
        shapes.update({"layers.q_norm": (L, H), "layers.k_norm": (L, H)})
    if cfg.post_norms:
        shapes.update({"layers.post_attn_norm": (L, D), "layers.post_mlp_norm": (L, D)})
    return shapes


def params_from_flat(flat: dict[str, jax.Array]) -> Params:
    """Builds Params from a ``param_shapes``-keyed dict (missing optional keys become None)."""
    layer_kwargs = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("layers.")}
    for name in ("w_gate", "w_up", "w_down"):  # absent when every layer is sparse
        layer_kwargs.setdefault(name, None)
    return Params(
        embed=flat["embed"],
        layers=LayerParams(**layer_kwargs),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def init_random(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random normal(0, scale) weights, norms at their neutral value. For tests and benchmarks."""
    shapes = param_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    flat = {}
    for k, (name, shape) in zip(keys, sorted(shapes.items()), strict=False):
        if name.endswith("norm"):
            flat[name] = jnp.full(shape, 1.0 - cfg.norm_weight_offset, dtype)
        else:
            flat[name] = (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return params_from_flat(flat)


def unstack_layers(params: Params, scan_from_tokens: int | None = None) -> Params:
    """The same weights with one buffer per layer (``layers`` becomes a tuple of L LayerParams),
    and ``Params.scan_from_tokens`` set to ``scan_from_tokens`` (already unstacked params only
    get that set).

    Why: inside ``lax.scan`` XLA on CPU copies each layer's slice of a stacked weight into a fresh
    buffer before its dot (a dynamic-slice fusion), tripling the memory traffic of a
    bandwidth-bound decode step; separate buffers are read in place. Costs a longer compile
    (the loop is unrolled), which ``scan_from_tokens`` spares the many-token steps (see
    ``model.forward``). The stacked arrays are released once unstacked.

    Raises:
        ValueError: ``scan_from_tokens`` not None or an integer >= 1.
    """
    if scan_from_tokens is not None and (
        not isinstance(scan_from_tokens, int)
        or isinstance(scan_from_tokens, bool)
        or scan_from_tokens < 1
    ):
        raise ValueError(
            f"scan_from_tokens must be None or an integer >= 1, got {scan_from_tokens!r}"
        )
    if isinstance(params.layers, tuple):
        return dataclasses.replace(params, scan_from_tokens=scan_from_tokens)
    n = jax.tree.leaves(params.layers)[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], params.layers) for i in range(n))
    return dataclasses.replace(params, layers=layers, scan_from_tokens=scan_from_tokens)


def output_first(w: jax.Array, num_lead: int, num_in: int) -> jax.Array:
    """A weight ``[*lead, *in, *out]`` transposed to ``[*lead, *out, *in]`` (contracted axes last):
    the layout of ``OutInWeight`` and of ``QTensor`` values."""
    lead = list(range(num_lead))
    ins = list(range(num_lead, num_lead + num_in))
    outs = list(range(num_lead + num_in, w.ndim))
    return jnp.transpose(w, lead + outs + ins)


# Float projections of the same input that ``out_in_projections`` fuses into one weight.
FUSED_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
# Other weight types ``out_in_projections`` fuses, with their fuse function ``(ws, num_lead)``:
# ``quant.tensor`` registers ``QTensor`` (int8), so this module need not import it.
WEIGHT_FUSERS: dict[type, Callable] = {}


def out_in_projections(params: Params) -> Params:
    """The same weights with every float layer projection stored output-first (``OutInWeight``),
    and wq/wk/wv and w_gate/w_up each fused into one weight (``wqkv``, ``w_gate_up``).

    Why: on XLA CPU, ``x [R, D] @ w [D, F]`` runs its GEMM slower for a few rows (R = 2..32)
    than ``w^T [F, D] @ x^T``, and a decode step is such a product. Each dot also has a fixed
    cost, so fusing the projections of one input (7 -> 4 dots per layer) brings a batch-1 decode
    step closer to the weight-streaming bound (figures in docs/performance.md). Quantized
    (``QTensor``) weights keep their int8 layout (already output-first), but are fused alike
    (``quant.tensor.fuse_qtensors``); already converted weights are left as they are; the original
    arrays are released once converted. Stacked layers keep their L axis.
    """

    def convert(w, num_lead: int, num_in: int):
        if not isinstance(w, jax.Array):  # QTensor or OutInWeight
            return w
        return OutInWeight(output_first(w, num_lead, num_in), num_in)

    def fuse(ws: list[OutInWeight], num_lead: int) -> OutInWeight:
        lead = ws[0].values.shape[:num_lead]
        parts = tuple(w.values.shape[num_lead : w.values.ndim - 1] for w in ws)
        flat = [w.values.reshape(*lead, -1, w.values.shape[-1]) for w in ws]
        return OutInWeight(jnp.concatenate(flat, axis=num_lead), 1, parts)

    def layer(lp: LayerParams, num_lead: int) -> LayerParams:
        new = {n: convert(getattr(lp, n), num_lead, k) for n, k in LAYER_PROJECTIONS.items()}
        for fused, names in FUSED_PROJECTIONS.items():
            ws = [new[n] for n in names]
            if all(isinstance(w, OutInWeight) and w.parts is None and w.num_in == 1 for w in ws):
                new[fused] = fuse(ws, num_lead)
                new.update({n: None for n in names})
            elif (
                type(ws[0]) in WEIGHT_FUSERS
                and all(type(w) is type(ws[0]) for w in ws)
                and all(w.parts is None and w.num_in == 1 for w in ws)
            ):
                new[fused] = WEIGHT_FUSERS[type(ws[0])](ws, num_lead)  # int8: one integer dot
                new.update({n: None for n in names})
        return dataclasses.replace(lp, **new)

    if isinstance(params.layers, tuple):
        return dataclasses.replace(params, layers=tuple(layer(lp, 0) for lp in params.layers))
    return dataclasses.replace(params, layers=layer(params.layers, 1))
