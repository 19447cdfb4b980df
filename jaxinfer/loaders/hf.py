"""Loader of Hugging Face checkpoint directories: config.json -> ModelConfig, safetensors -> Params.

The config is read by ``jaxinfer.loaders.hf_config`` (supported families and layouts are listed
there). Before anything is allocated, every tensor's dtype and shape is read from the safetensors
headers and checked against the config, the config's sizes against the files' bytes, and the
weights' bytes against free memory; every tensor in the checkpoint must be used, except a
documented allowlist that is ignored with a ``CheckpointWarning``:

- ``*.rotary_emb.inv_freq`` (RoPE caches saved by old transformers; recomputed from the config);
- ``lm_head.weight`` when the config ties the head (transformers ignores it too);
- the vision tower and projector of a multimodal ``gemma3`` checkpoint (only the text runs).

Tensors are read one at a time with ``safetensors.safe_open(framework="numpy")`` (bf16 comes back
as an ``ml_dtypes.bfloat16`` array), checked to be finite, cast to the target dtype and written
into one preallocated numpy array per Params field (layers stacked on axis 0), which is moved to
the device before the next field is filled. Each shard is opened per tensor so its memory map is
released at once. The loader's transient host memory is one field
(``scripts/load_memory.py`` shows it).

Layout changes (HF ``nn.Linear`` weights are ``[out, in]``; jaxinfer's are input-dim first):
``q_proj [N*H, D] -> wq [D, N, H]``, ``k/v_proj [K*H, D] -> [D, K, H]``, ``o_proj [D, N*H] -> wo
[N, H, D]``, ``gate/up_proj [F, D] -> [D, F]``, ``down_proj [D, F] -> [F, D]``, ``lm_head [V, D] ->
[D, V]``. The model uses the HF "rotate_half" RoPE layout, so q/k rows are not permuted.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.checks import (
    CheckpointWarning,
    check_cast,
    check_finite,
    check_fits,
    param_bytes,
)
from jaxinfer.loaders.hf_moe import SUPPORTED_MODEL_TYPES, LayerSource, config_from_hf, moe_sources
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import Params, param_shapes, params_from_flat

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "load_hf"]

_FILE_DTYPES = ("F32", "F16", "BF16")
_MAX_LISTED = 10  # unexpected tensors named in one message

# ----------------------------------------------------------------------------------------------
# Tensors.

# Params field -> (HF name under the model prefix ("{i}" = layer), HF shape, layout change).
_Spec = tuple[
    str, Callable[[ModelConfig], tuple[int, ...]], Callable[[np.ndarray, ModelConfig], np.ndarray]
]


def _same(x, cfg):
    return x


def _t(x, cfg):
    return x.T


def _q_like(heads_attr):
    def f(x, cfg):  # [heads*H, D] -> [D, heads, H]
        return x.reshape(getattr(cfg, heads_attr), cfg.head_dim, cfg.hidden_size).transpose(2, 0, 1)

    return f


def _bias_like(heads_attr):
    def f(x, cfg):  # [heads*H] -> [heads, H]
        return x.reshape(getattr(cfg, heads_attr), cfg.head_dim)

    return f


def _o(x, cfg):  # [D, N*H] -> [N, H, D]
    return x.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)


def _specs(cfg: ModelConfig) -> dict[str, _Spec]:
    D, F, V, H = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    NH, KH = cfg.num_heads * H, cfg.num_kv_heads * H
    a = "layers.{i}.self_attn."
    mlp_norm = "post_attention_layernorm" if not cfg.post_norms else "pre_feedforward_layernorm"
    specs: dict[str, _Spec] = {
        "embed": ("embed_tokens.weight", lambda c: (V, D), _same),
        "final_norm": ("norm.weight", lambda c: (D,), _same),
        "layers.attn_norm": ("layers.{i}.input_layernorm.weight", lambda c: (D,), _same),
        "layers.wq": (a + "q_proj.weight", lambda c: (NH, D), _q_like("num_heads")),
        "layers.wk": (a + "k_proj.weight", lambda c: (KH, D), _q_like("num_kv_heads")),
        "layers.wv": (a + "v_proj.weight", lambda c: (KH, D), _q_like("num_kv_heads")),
        "layers.wo": (a + "o_proj.weight", lambda c: (D, NH), _o),
        "layers.mlp_norm": (f"layers.{{i}}.{mlp_norm}.weight", lambda c: (D,), _same),
        "layers.w_gate": ("layers.{i}.mlp.gate_proj.weight", lambda c: (F, D), _t),
        "layers.w_up": ("layers.{i}.mlp.up_proj.weight", lambda c: (F, D), _t),
        "layers.w_down": ("layers.{i}.mlp.down_proj.weight", lambda c: (D, F), _t),
        "lm_head": ("lm_head.weight", lambda c: (V, D), _t),
        "layers.bq": (a + "q_proj.bias", lambda c: (NH,), _bias_like("num_heads")),
        "layers.bk": (a + "k_proj.bias", lambda c: (KH,), _bias_like("num_kv_heads")),
        "layers.bv": (a + "v_proj.bias", lambda c: (KH,), _bias_like("num_kv_heads")),
        "layers.bo": (a + "o_proj.bias", lambda c: (D,), _same),
        "layers.sinks": (a + "sinks", lambda c: (cfg.num_heads,), _same),
        "layers.q_norm": (a + "q_norm.weight", lambda c: (H,), _same),
        "layers.k_norm": (a + "k_norm.weight", lambda c: (H,), _same),
        **(
            {  # OLMoE: one norm over the whole projection [N*H] -> [N, H]
                "layers.q_norm": (a + "q_norm.weight", lambda c: (NH,), _bias_like("num_heads")),
                "layers.k_norm": (a + "k_norm.weight", lambda c: (KH,), _bias_like("num_kv_heads")),
            }
            if cfg.qk_norm_flat
            else {}
        ),
        "layers.post_attn_norm": (
            "layers.{i}.post_attention_layernorm.weight",
            lambda c: (D,),
            _same,
        ),
        "layers.post_mlp_norm": (
            "layers.{i}.post_feedforward_layernorm.weight",
            lambda c: (D,),
            _same,
        ),
    }
    return specs


def _weight_map(path: str) -> tuple[dict[str, str], str]:
    """(HF tensor name -> safetensors file path, the file that lists them for error messages).

    Raises CheckpointError: no weights file; an index that is not JSON or whose ``weight_map`` is
    not an object of tensor names to file names inside the directory."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(
                f"{index}: unreadable index, expected a JSON object with a 'weight_map' field "
                f"({type(e).__name__}: {e})"
            ) from None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in wm.items()
        ):
            raise CheckpointError(
                f"{index}: field 'weight_map' must map tensor names to shard file names (strings)"
            )
        for k, v in wm.items():
            if os.path.isabs(v) or ".." in v.replace("\\", "/").split("/"):
                raise CheckpointError(
                    f"{index}: tensor {k!r} is mapped to {v!r}; shard files must lie in the "
                    "checkpoint directory"
                )
        return {k: os.path.join(path, v) for k, v in wm.items()}, index
    if os.path.exists(single):
        with _open(single, None) as f:
            return {k: single for k in f.keys()}, single
    raise CheckpointError(
        f"{path}: no model.safetensors or model.safetensors.index.json found "
        f"(files: {sorted(os.listdir(path))[:20]})"
    )


def _open(file: str, tensor: str | None):
    try:
        return safe_open(file, framework="numpy")
    except FileNotFoundError:
        raise CheckpointError(
            f"{file}: shard file is missing"
            + (f" (needed for tensor {tensor!r})" if tensor else "")
        ) from None
    except Exception as e:  # SafetensorError: truncated header, bad JSON, data past the end...
        raise CheckpointError(
            f"{file}: not a readable safetensors file (truncated or corrupt?)"
            + (f" while reading tensor {tensor!r}" if tensor else "")
            + f": {e}"
        ) from None


def _headers(
    where: dict[str, str], listing: str
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """({name: (dtype, shape)}, {name: file}) of every tensor stored in the weight files, read
    from their headers (no tensor data is read). safetensors checks on opening that each header's
    offsets match its dtypes, shapes and the file's size.

    Raises CheckpointError: a missing or unreadable shard; a tensor the index puts in a shard
    that does not hold it; a tensor stored in two files."""
    by_file: dict[str, list[str]] = {}
    for name, file in where.items():
        by_file.setdefault(file, []).append(name)
    info: dict[str, tuple[str, tuple[int, ...]]] = {}
    stored_in: dict[str, str] = {}
    for file, names in sorted(by_file.items()):
        with _open(file, names[0] if file != listing else None) as f:
            for name in f.keys():
                if name in stored_in:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} is also stored in {stored_in[name]}"
                    )
                sl = f.get_slice(name)
                info[name], stored_in[name] = (sl.get_dtype(), tuple(sl.get_shape())), file
        lost = [n for n in names if stored_in.get(n) != file]
        if lost:
            raise CheckpointError(
                f"{listing}: tensor {lost[0]!r} is listed in {os.path.basename(file)}, which does "
                f"not hold it ({len(lost)} such tensor(s))"
            )
    return info, stored_in


def _read(file: str, name: str, expected: tuple[int, ...], field: str) -> np.ndarray:
    """One tensor as a numpy array in its file dtype, shape-checked."""
    with _open(file, name) as f:
        try:
            sl = f.get_slice(name)
            _check_tensor(file, name, sl.get_dtype(), tuple(sl.get_shape()), expected, field)
            return f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"{file}: tensor {name!r} cannot be read (truncated or corrupt?): {e}"
            ) from None


def _check_tensor(file, name, dtype: str, shape: tuple[int, ...], expected, field: str) -> None:
    if dtype not in _FILE_DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name!r} has dtype {dtype}; supported: {', '.join(_FILE_DTYPES)}"
        )
    if shape != tuple(expected):
        raise CheckpointError(
            f"{file}: tensor {name!r} (for {field}) has shape {list(shape)}, "
            f"expected {list(expected)}"
        )


def _prefixes(names: set[str], family_config: dict) -> tuple[str, str]:
    """(prefix of the decoder's tensors, name of the LM head) as stored in this checkpoint."""
    for prefix, head in (
        ("model.", "lm_head.weight"),
        ("model.language_model.", "lm_head.weight"),
        ("language_model.model.", "language_model.lm_head.weight"),
    ):
        if prefix + "embed_tokens.weight" in names:
            return prefix, head
    return "model.", "lm_head.weight"


def _ignored(name: str, model_type, cfg: ModelConfig, head_name: str) -> str | None:
    """Why an unused tensor is on the allowlist (warned, not loaded), or None."""
    if name.endswith(".rotary_emb.inv_freq"):
        return "RoPE caches saved by old transformers (recomputed from the config)"
    if name == head_name and cfg.tie_word_embeddings:
        return (
            "the config ties the head to the embedding (tie_word_embeddings true), so the "
            "stored head is not used, as in transformers"
        )
    if model_type == "gemma3" and ("vision_tower." in name or "multi_modal_projector." in name):
        return "the vision tower of a multimodal Gemma 3 checkpoint (only the text model runs)"
    return None


def _check_unused(
    unused: list[str],
    stored_in: dict[str, str],
    raw: dict,
    cfg: ModelConfig,
    head_name: str,
    cfg_file: str,
) -> None:
    """Warns about allowlisted unused tensors; raises CheckpointError naming the others."""
    by_reason: dict[str, list[str]] = {}
    unexpected = []
    for name in sorted(unused):
        why = _ignored(name, raw.get("model_type"), cfg, head_name)
        (by_reason.setdefault(why, []) if why else unexpected).append(name)
    if unexpected:
        first = unexpected[0]
        shown = ", ".join(repr(n) for n in unexpected[:_MAX_LISTED])
        more = f" and {len(unexpected) - _MAX_LISTED} more" if len(unexpected) > _MAX_LISTED else ""
        raise CheckpointError(
            f"{stored_in[first]}: tensor {first!r} is not used by a {cfg.model_type!r} model "
            f"with the architecture of {cfg_file} ({len(unexpected)} unexpected tensor(s): "
            f"{shown}{more}); the checkpoint does not match its config (e.g. a bias or layer "
            "the config does not describe)"
        )
    for why, names in by_reason.items():
        warnings.warn(
            f"{stored_in[names[0]]}: {len(names)} tensor(s) not loaded (e.g. {names[0]!r}): {why}",
            CheckpointWarning,
            stacklevel=3,
        )


def _read_layers(
    sources: list[LayerSource | None], shape, np_dtype, stored_in: dict[str, str], field: str, cfg
) -> np.ndarray:
    """One stacked [L, ...] field of an MoE model read layer by layer (``hf_moe.moe_sources``);
    a layer without the weight (None) holds zeros."""
    out = np.zeros(shape, np_dtype)
    for i, src in enumerate(sources):
        if src is None:
            continue
        xs = []
        for name, hf_shape in zip(src.names, src.shapes, strict=True):
            x = _read(stored_in[name], name, hf_shape, field)
            check_finite(x, stored_in[name], name)
            xs.append(x)
        with np.errstate(over="ignore"):  # overflow is reported by check_cast
            out[i] = src.combine(xs, cfg)
        if xs[0].dtype != np_dtype:
            check_cast(out[i], stored_in[src.names[0]], src.names[0])
        del xs
    return out


def _read_config(cfg_file: str):
    if not os.path.isfile(cfg_file):
        raise CheckpointError(
            f"{cfg_file}: config.json is missing (expected a Hugging Face model directory)"
        )
    try:
        with open(cfg_file, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise CheckpointError(f"{cfg_file}: not valid JSON: {e}") from None
    except (OSError, RecursionError) as e:
        raise CheckpointError(f"{cfg_file}: cannot be read: {type(e).__name__}: {e}") from None


def load_hf(path: str | os.PathLike, dtype=jnp.float32, place=None) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` + shards. Tensors may be f32, f16 or bf16.
        dtype: dtype of the returned Params (float32, bfloat16 or float16); each tensor is cast with
            round-to-nearest-even, as ``torch.Tensor.to``.
        place: optional ``place(cfg, field, x: np.ndarray) -> jax.Array`` that puts each host
            tensor on devices (``jaxinfer.models.sharding.ShardedPlacer`` shards it); default
            ``jnp.asarray``.

    Returns:
        (config, params). When the config ties the head, a stored ``lm_head`` is ignored with a
        ``CheckpointWarning`` (as transformers does).

    Raises:
        CheckpointError: missing config.json or safetensors files; a config that is not a JSON
            object or has a bad field (see ``config_from_hf``), or whose sizes imply more bytes
            than the weight files hold; a missing tensor (the LM head too, when the config says
            it is untied); a tensor of the wrong shape or dtype; a tensor the model does not use
            (outside the allowlist in the module docstring); weights that do not fit in memory;
            a tensor holding NaN or Inf, or overflowing ``dtype``; a truncated or corrupt file.
            Everything but the last three is found from the headers before any tensor is read.
            The message names the file, the HF tensor name or field, and what was expected.
    """
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    raw = _read_config(cfg_file)
    where, listing = _weight_map(path)
    info, stored_in = _headers(where, listing)
    ckpt_bytes = sum(os.path.getsize(f) for f in set(where.values()))
    cfg = config_from_hf(raw, cfg_file, checkpoint_bytes=ckpt_bytes)
    prefix, head_name = _prefixes(set(info), raw)
    if not cfg.tie_word_embeddings and head_name not in info:
        fields = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        said = (
            "is false"
            if "tie_word_embeddings" in fields
            else f"is absent (false by default for model_type {raw.get('model_type')!r})"
        )
        raise CheckpointError(
            f"{listing}: tensor {head_name!r} is missing, but tie_word_embeddings in {cfg_file} "
            f"{said}: an untied head must be stored; set it to true if the head is the "
            "embedding matrix"
        )
    specs = _specs(cfg)
    shapes = param_shapes(cfg)
    moe = moe_sources(cfg, prefix, set(info)) if cfg.is_moe else {}
    moe = {k: v for k, v in moe.items() if k in shapes}
    for field, sources in moe.items():  # checked from the headers like the others below
        for src in (s for s in sources if s is not None):
            for name, hf_shape in zip(src.names, src.shapes, strict=True):
                if name not in info:
                    raise CheckpointError(
                        f"{listing}: tensor {name!r} is missing (needed for {field}, expected "
                        f"shape {list(hf_shape)})"
                    )
                _check_tensor(stored_in[name], name, *info[name], hf_shape, field)
    plan: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for field in (f for f in shapes if f not in moe):  # every tensor checked from the headers
        hf_name, hf_shape_fn, _ = specs[field]
        hf_shape = hf_shape_fn(cfg)
        full = head_name if field == "lm_head" else prefix + hf_name
        names = (
            [full.format(i=i) for i in range(cfg.num_layers)]
            if field.startswith("layers.")
            else [full]
        )
        for name in names:
            if name not in info:
                raise CheckpointError(
                    f"{listing}: tensor {name!r} is missing (needed for {field}, expected shape "
                    f"{list(hf_shape)})"
                )
            _check_tensor(stored_in[name], name, *info[name], hf_shape, field)
        plan[field] = [(name, hf_shape) for name in names]
    used = {name for names in plan.values() for name, _ in names}
    used |= {n for sources in moe.values() for src in sources if src is not None for n in src.names}
    _check_unused([n for n in info if n not in used], stored_in, raw, cfg, head_name, cfg_file)
    np_dtype = np.dtype(dtype)
    biggest_field = max(param_bytes([s], np_dtype) for s in shapes.values())
    biggest_tensor = max(param_bytes([s], np.float32) for s in (info[n][1] for n in used))
    check_fits(
        listing,
        param_bytes(shapes.values(), np_dtype),
        biggest_field + 2 * biggest_tensor,
        f"the weights in {np_dtype}",
    )
    flat = {}
    for field, shape in shapes.items():
        if field in moe:
            out = _read_layers(moe[field], shape, np_dtype, stored_in, field, cfg)
            flat[field] = place(cfg, field, out) if place is not None else jnp.asarray(out)
            del out
            continue
        convert = specs[field][2]
        out = np.empty(shape, np_dtype)
        for i, (name, hf_shape) in enumerate(plan[field]):
            file = stored_in[name]
            x = _read(file, name, hf_shape, field)
            check_finite(x, file, name)
            dst = out[i] if field.startswith("layers.") else out
            with np.errstate(over="ignore"):  # overflow is reported by check_cast
                dst[...] = convert(x, cfg)
            if x.dtype != np_dtype:
                check_cast(dst, file, name)
            del x
        flat[field] = place(cfg, field, out) if place is not None else jnp.asarray(out)
        del out
    return cfg, params_from_flat(flat)
