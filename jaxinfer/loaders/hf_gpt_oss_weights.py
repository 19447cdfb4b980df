"""Where a gpt-oss checkpoint stores its router and expert weights, and how each becomes a
``LayerParams`` field (``hf_moe.LayerSource``, read by ``hf.load_hf``).

Per layer i (prefix ``model.layers.{i}.mlp.``):

- ``router.weight`` [E, D] and ``router.bias`` [E] -> ``router`` [D, E], ``router_bias`` [E];
- the experts as transformers saves them (``GptOssForCausalLM.save_pretrained``):
  ``experts.gate_up_proj`` [E, D, 2I] (input first), ``experts.down_proj`` [E, I, D];
- or as shipped on the Hub, MXFP4 (``quantization_config.quant_method: "mxfp4"``):
  ``experts.gate_up_proj_blocks`` u8[E, 2I, D/32, 16] + ``experts.gate_up_proj_scales``
  u8[E, 2I, D/32] and ``experts.down_proj_blocks`` u8[E, D, I/32, 16] +
  ``experts.down_proj_scales`` u8[E, D, I/32], dequantized at load (``mxfp4``, bit for bit as
  transformers' ``convert_moe_packed_tensors``), then rounded once to the compute dtype;
- the biases ``experts.gate_up_proj_bias`` [E, 2I] and ``experts.down_proj_bias`` [E, D].

gpt-oss interleaves gate and up on the fused axis (``gate_up[..., ::2]`` the gate,
``[..., 1::2]`` the up projection; transformers' ``GptOssExperts._apply_gate``); they are
de-interleaved here into jaxinfer's layout (the I gate columns, then the I up columns) for the
weight and its bias alike, so the grouped matmul is the other families'.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.hf_moe import LayerSource
from jaxinfer.loaders.mxfp4 import BLOCK_BYTES, dequantize_expert_weight
from jaxinfer.models.config import ModelConfig

MXFP4_DTYPES = ("U8",)
MXFP4_BLOCK = 2 * BLOCK_BYTES  # values per scale


def deinterleave_gate_up(x: np.ndarray) -> np.ndarray:
    """[..., 2I] with gate and up interleaved (gate at even columns) -> [..., 2I] with the I gate
    columns first, then the I up columns."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _t(xs, cfg):
    return xs[0].T


def _same(xs, cfg):
    return xs[0]


def _gate_up(xs, cfg):  # [E, D, 2I] interleaved -> [E, D, 2I] gates first
    return deinterleave_gate_up(xs[0])


def _gate_up_bias(xs, cfg):  # [E, 2I] interleaved -> gates first
    return deinterleave_gate_up(xs[0])


def _gate_up_mxfp4(xs, cfg):  # blocks, scales -> [E, D, 2I] gates first, f32
    return deinterleave_gate_up(dequantize_expert_weight(xs[0], xs[1], np.float32))


def _down_mxfp4(xs, cfg):  # blocks, scales -> [E, I, D], f32
    return dequantize_expert_weight(xs[0], xs[1], np.float32)


def _mxfp4_source(name: str, rows: int, inputs: int, cfg: ModelConfig, combine) -> LayerSource:
    """The blocks + scales pair of one MXFP4 expert weight of ``rows`` outputs and ``inputs``
    inputs per expert; CheckpointError naming the tensor when ``inputs`` is not a multiple of 32."""
    if inputs % MXFP4_BLOCK:
        raise CheckpointError(
            f"tensor {name + '_blocks'!r}: MXFP4 needs the input width ({inputs}) to be a "
            f"multiple of {MXFP4_BLOCK}"
        )
    e, g = cfg.num_experts, inputs // MXFP4_BLOCK
    return LayerSource(
        (f"{name}_blocks", f"{name}_scales"),
        ((e, rows, g, BLOCK_BYTES), (e, rows, g)),
        combine,
        file_dtypes=MXFP4_DTYPES,
    )


def gpt_oss_sources(
    cfg: ModelConfig, prefix: str, stored: set[str]
) -> dict[str, list[LayerSource | None]]:
    """The checkpoint tensors of every MLP field of a gpt-oss model, per layer (as
    ``hf_moe.moe_sources``; every gpt-oss layer is sparse).

    Args:
        cfg: the model (``model_type`` "gpt_oss").
        prefix: the decoder's tensor prefix (``"model."``).
        stored: the names the checkpoint holds: a layer whose ``gate_up_proj_blocks`` is stored
            is read as MXFP4, else as float tensors.

    Raises:
        CheckpointError: MXFP4 experts whose input width (hidden_size for gate_up,
            intermediate_size for down) is not a multiple of 32.
    """
    D, E, In = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, list[LayerSource | None]] = {}
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}.mlp."
        ex = f"{p}experts."
        fields = {
            "router": LayerSource((f"{p}router.weight",), ((E, D),), _t),
            "router_bias": LayerSource((f"{p}router.bias",), ((E,),), _same),
            "expert_gate_up_bias": LayerSource(
                (f"{ex}gate_up_proj_bias",), ((E, 2 * In),), _gate_up_bias
            ),
            "expert_down_bias": LayerSource((f"{ex}down_proj_bias",), ((E, D),), _same),
        }
        if f"{ex}gate_up_proj_blocks" in stored:
            fields["expert_gate_up"] = _mxfp4_source(
                f"{ex}gate_up_proj", 2 * In, D, cfg, _gate_up_mxfp4
            )
            fields["expert_down"] = _mxfp4_source(f"{ex}down_proj", D, In, cfg, _down_mxfp4)
        else:
            fields["expert_gate_up"] = LayerSource(
                (f"{ex}gate_up_proj",), ((E, D, 2 * In),), _gate_up
            )
            fields["expert_down"] = LayerSource((f"{ex}down_proj",), ((E, In, D),), _same)
        for name, src in fields.items():
            out.setdefault(f"layers.{name}", []).append(src)
    return out
