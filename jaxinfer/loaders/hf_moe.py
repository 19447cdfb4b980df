"""Mixture-of-experts families of Hugging Face checkpoints: their config and where their expert
weights are stored.

Families (``model_type``): mixtral, qwen2_moe, qwen3_moe, olmoe. Their attention is that of a
dense family (mixtral: mistral's; qwen2_moe: qwen2's; qwen3_moe: qwen3's; olmoe: llama's with a
q/k norm over the whole projection), read by ``hf_config.config_from_hf`` under that family's
name with the MoE family's defaults; the MoE fields are read here. ``config_from_hf`` of this
module takes every supported family, dense or MoE.

Expert weights are read in both layouts met on disk:

- one tensor per expert, as shipped on the Hub (and as transformers 5 saves them):
  ``layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (Mixtral; gate, up, down) or
  ``layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (the others), the router
  ``block_sparse_moe.gate.weight`` / ``mlp.gate.weight`` [E, D];
- fused, transformers 5's in-memory layout: ``layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, D]
  (gate rows first) and ``layers.{i}.mlp.experts.down_proj`` [E, D, I], router
  ``mlp.gate.weight``.

Qwen2-MoE's shared expert: ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
``mlp.shared_expert_gate.weight`` [1, D]. Dense layers of a Qwen MoE model (``mlp_only_layers``,
``decoder_sparse_step``) hold ``mlp.{gate,up,down}_proj.weight``.

Refused, naming the field: qwen2_moe / qwen3_moe ``use_sliding_window`` true, olmoe ``clip_qkv``,
``num_experts`` (or ``num_local_experts``) 0, ``num_experts_per_tok`` above it, ``mlp_only_layers``
naming no layer of the model, and every field ``hf_config`` refuses.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.hf_config import (
    MIN_FILE_DTYPE_BYTES,
    Fields,
)
from jaxinfer.loaders.hf_config import SUPPORTED_MODEL_TYPES as DENSE_MODEL_TYPES
from jaxinfer.loaders.hf_config import config_from_hf as dense_config_from_hf
from jaxinfer.loaders.hf_gpt_oss import MODEL_TYPE as GPT_OSS
from jaxinfer.models.config import ModelConfig

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES

# The dense family whose attention each MoE family has, and the MoE family's defaults
# (transformers' configuration classes) for fields that family's defaults would get wrong.
_BASE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "olmoe": "llama"}
_DEFAULTS: dict[str, dict] = {
    "mixtral": dict(
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        sliding_window=None,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        qkv_bias=True,
    ),
    "qwen3_moe": dict(
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=False,
        decoder_sparse_step=1,
    ),
    "olmoe": dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
    ),
}


_E_DEFAULT = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
    "olmoe": "num_experts",
}


def config_from_hf(
    config: dict,
    path_for_errors: str | os.PathLike = "config.json",
    checkpoint_bytes: int | None = None,
) -> ModelConfig:
    """``hf_config.config_from_hf`` for every supported family, dense or mixture-of-experts.

    Args and Raises as ``hf_config.config_from_hf``; for an MoE family also CheckpointError naming
    the file and field for: an unsupported option (module docstring), an expert count, top-k or
    expert width of the wrong type or out of range, ``mlp_only_layers`` not a list of layer
    indices. ``checkpoint_bytes`` is checked against the MoE sizes (experts included).
    """
    where = str(path_for_errors)
    family = config.get("model_type") if isinstance(config, dict) else None
    if family not in MOE_MODEL_TYPES:
        if isinstance(config, dict) and family not in (*DENSE_MODEL_TYPES, GPT_OSS):
            raise CheckpointError(
                f"{where}: field 'model_type' is {family!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        return dense_config_from_hf(config, path_for_errors, checkpoint_bytes)
    d = _DEFAULTS[family]
    f = Fields(config, d, where, family)
    c = dict(config)
    for key in ("rms_norm_eps", "max_position_embeddings", "num_key_value_heads"):
        if c.get(key) is None and key in d:
            c[key] = d[key]
    if family == "mixtral":
        c.setdefault("sliding_window", None)  # mistral's default is 4096, Mixtral's None
        if c.get("rope_parameters") is None and c.get("rope_theta") is None:
            c["rope_theta"] = d["rope_theta"]
    if family in ("qwen2_moe", "qwen3_moe"):
        if c.get("use_sliding_window"):
            raise f.err("use_sliding_window", "is true; sliding windows are not supported for MoE")
        c.pop("layer_types", None)  # all full attention without use_sliding_window
    if family in ("qwen3_moe", "olmoe") and c.get("head_dim") is None:
        # these families' attention takes hidden_size // num_attention_heads (qwen3's default is
        # 128)
        heads = f.int("num_attention_heads", f.get("num_attention_heads"))
        c["head_dim"] = max(1, f.int("hidden_size", f.get("hidden_size")) // heads)
    if family == "olmoe" and c.get("clip_qkv") is not None:
        raise f.err("clip_qkv", f"is {c['clip_qkv']!r}; q/k/v clipping is not supported")
    if family == "olmoe" and c.get("head_dim") is not None:
        hidden, heads = f.get("hidden_size"), f.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads * c["head_dim"] != hidden:
            raise f.err(
                "head_dim",
                f"is {c['head_dim']}; OLMoE's q norm spans hidden_size={hidden} = "
                "num_attention_heads * head_dim",
            )
    c["model_type"] = _BASE[family]
    dense = dense_config_from_hf(c, path_for_errors, None)

    n_layers = dense.num_layers
    # transformers maps one name onto the other (attribute_map); a config may carry either
    e_key = "num_local_experts" if family in ("mixtral", "qwen3_moe") else "num_experts"
    other = "num_experts" if e_key == "num_local_experts" else "num_local_experts"
    if config.get(e_key) is None and config.get(other) is not None:
        e_key = other
    e = f.int(e_key, config[e_key] if config.get(e_key) is not None else d[_E_DEFAULT[family]])
    k = f.int("num_experts_per_tok", f.get("num_experts_per_tok"))
    if k > e:
        raise f.err("num_experts_per_tok", f"is {k}, more than {e_key}={e}")
    if family in ("mixtral", "olmoe"):
        width = dense.intermediate_size
        norm_topk = (
            True if family == "mixtral" else f.flag("norm_topk_prob", f.get("norm_topk_prob"))
        )
        sparse = (True,) * n_layers
    else:
        width = f.int("moe_intermediate_size", f.get("moe_intermediate_size"))
        norm_topk = f.flag("norm_topk_prob", f.get("norm_topk_prob"))
        sparse = _sparse_layers(f, n_layers)
    shared = 0
    if family == "qwen2_moe":
        shared = f.int("shared_expert_intermediate_size", f.get("shared_expert_intermediate_size"))
    changes = dict(
        model_type=family,
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=width,
        norm_topk_prob=norm_topk,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=family == "qwen2_moe",
        sparse_layers=sparse,
    )
    if family == "qwen2_moe":
        changes["attention_bias"] = f.flag("qkv_bias", f.get("qkv_bias"))
    if family == "olmoe":
        changes.update(qk_norm=True, qk_norm_flat=True)
    try:
        cfg = dataclasses.replace(dense, **changes)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    if checkpoint_bytes is not None:
        need = MIN_FILE_DTYPE_BYTES * cfg.num_params()
        if need > checkpoint_bytes:
            raise CheckpointError(
                f"{where}: the config's sizes ({e_key}={e}, expert width {width}, "
                f"num_hidden_layers={n_layers}, hidden_size={cfg.hidden_size}, vocab_size="
                f"{cfg.vocab_size}, ...) imply at least {need} bytes of weights (2 bytes a "
                f"parameter), but the checkpoint's weight files hold {checkpoint_bytes} bytes: a "
                "size in the config is wrong"
            )
    return cfg


def _sparse_layers(f: Fields, n_layers: int) -> tuple[bool, ...]:
    """Qwen-MoE: layer i is sparse unless listed in ``mlp_only_layers``, and only every
    ``decoder_sparse_step``-th (i + 1 divisible by it)."""
    step = f.int("decoder_sparse_step", f.get("decoder_sparse_step"))
    only = f.opt("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in only
    ):
        raise f.err("mlp_only_layers", f"is {only!r}; expected a list of layer indices")
    bad = [i for i in only if not 0 <= i < n_layers]
    if bad:
        raise f.err("mlp_only_layers", f"names layer {bad[0]}, not in [0, {n_layers})")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(n_layers))


# ----------------------------------------------------------------------------------------------
# Weights.


@dataclasses.dataclass(frozen=True)
class LayerSource:
    """Where one layer's slice of a Params field is stored.

    Attributes:
        names: the checkpoint tensors read (full names).
        shapes: their expected shapes.
        combine: ``combine(arrays, cfg) -> np.ndarray`` of the field's per-layer shape.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: object


def _t(xs, cfg):
    return xs[0].T


def _row(xs, cfg):  # [1, D] -> [D]
    return xs[0].reshape(-1)


def _stack_gate_up(xs, cfg):  # E gates [I, D], then E ups [I, D] -> [E, D, 2I]
    e = cfg.num_experts
    return np.concatenate(
        [np.stack([x.T for x in xs[:e]]), np.stack([x.T for x in xs[e:]])], axis=-1
    )


def _stack_down(xs, cfg):  # E downs [D, I] -> [E, I, D]
    return np.stack([x.T for x in xs])


def _fused_gate_up(xs, cfg):  # [E, 2I, D] -> [E, D, 2I]
    return np.swapaxes(xs[0], 1, 2)


def _fused_down(xs, cfg):  # [E, D, I] -> [E, I, D]
    return xs[0].transpose(0, 2, 1)


def moe_sources(
    cfg: ModelConfig, prefix: str, stored: set[str]
) -> dict[str, list[LayerSource | None]]:
    """The checkpoint tensors of every MLP field of an MoE model, per layer (None: the layer
    has no such weight, its slice is zeros: the experts of a dense layer, the dense MLP of a
    sparse one).

    Args:
        cfg: the model (``cfg.is_moe``).
        prefix: the decoder's tensor prefix (``"model."``).
        stored: the names of the tensors the checkpoint holds (the fused layout is chosen per
            layer when its ``gate_up_proj`` is stored).
    """
    D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    In, S = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out: dict[str, list[LayerSource | None]] = {}
    mixtral = cfg.model_type == "mixtral"
    for i, sparse in enumerate(cfg.sparse_layers):
        p = f"{prefix}layers.{i}."
        fields: dict[str, LayerSource | None] = {}
        if cfg.has_dense_mlp:
            for name, proj, shape in (
                ("w_gate", "gate_proj", (F, D)),
                ("w_up", "up_proj", (F, D)),
                ("w_down", "down_proj", (D, F)),
            ):
                fields[name] = (
                    None if sparse else LayerSource((f"{p}mlp.{proj}.weight",), (shape,), _t)
                )
        if not sparse:
            fields.update(
                {n: None for n in ("router", "expert_gate_up", "expert_down", "router_bias")}
            )
            fields.update({n: None for n in ("shared_w_gate", "shared_w_up", "shared_w_down")})
            fields["shared_expert_gate"] = None
        else:
            fused = f"{p}mlp.experts.gate_up_proj" in stored
            block = f"{p}block_sparse_moe." if mixtral and not fused else f"{p}mlp."
            fields["router"] = LayerSource((f"{block}gate.weight",), ((E, D),), _t)
            if fused:
                fields["expert_gate_up"] = LayerSource(
                    (f"{p}mlp.experts.gate_up_proj",), ((E, 2 * In, D),), _fused_gate_up
                )
                fields["expert_down"] = LayerSource(
                    (f"{p}mlp.experts.down_proj",), ((E, D, In),), _fused_down
                )
            else:
                g, u, dn = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                ex = f"{block}experts."
                fields["expert_gate_up"] = LayerSource(
                    tuple(f"{ex}{e}.{g}.weight" for e in range(E))
                    + tuple(f"{ex}{e}.{u}.weight" for e in range(E)),
                    ((In, D),) * (2 * E),
                    _stack_gate_up,
                )
                fields["expert_down"] = LayerSource(
                    tuple(f"{ex}{e}.{dn}.weight" for e in range(E)), ((D, In),) * E, _stack_down
                )
            if S:
                sh = f"{p}mlp.shared_expert."
                fields["shared_w_gate"] = LayerSource((f"{sh}gate_proj.weight",), ((S, D),), _t)
                fields["shared_w_up"] = LayerSource((f"{sh}up_proj.weight",), ((S, D),), _t)
                fields["shared_w_down"] = LayerSource((f"{sh}down_proj.weight",), ((D, S),), _t)
            if cfg.shared_expert_gate:
                fields["shared_expert_gate"] = LayerSource(
                    (f"{p}mlp.shared_expert_gate.weight",), ((1, D),), _row
                )
        for name, src in fields.items():
            out.setdefault(f"layers.{name}", []).append(src)
    return out
