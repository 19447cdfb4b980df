"""Loader of Hugging Face checkpoint directories: config.json -> ModelConfig, safetensors -> Params.

Supported ``model_type`` values: llama (Llama 2, Llama 3/3.1), mistral, qwen2, qwen3, gemma, gemma2,
gemma3_text and gemma3 (the text tower of the multimodal checkpoint). Both the transformers 4 config
layout (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``) and
the transformers 5 layout (``rope_parameters``, possibly nested per layer type, ``layer_types``) are
read. Missing config fields take the default of transformers' configuration class of the family.

Tensors are read one at a time with ``safetensors.safe_open(framework="numpy")`` (bf16 comes back
as an ``ml_dtypes.bfloat16`` array), cast to the target dtype and written into one preallocated
numpy array per Params field (layers stacked on axis 0), which is moved to the device before the
next field is filled. Each shard is opened per tensor so its memory map is released at once. The
loader's transient host memory is one field (measured by ``scripts/load_memory.py``).

Layout changes (HF ``nn.Linear`` weights are ``[out, in]``; jaxinfer's are input-dim first):
``q_proj [N*H, D] -> wq [D, N, H]``, ``k/v_proj [K*H, D] -> [D, K, H]``, ``o_proj [D, N*H] -> wo
[N, H, D]``, ``gate/up_proj [F, D] -> [D, F]``, ``down_proj [D, F] -> [F, D]``, ``lm_head [V, D] ->
[D, V]``. The model uses the HF "rotate_half" RoPE layout, so q/k rows are not permuted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.errors import CheckpointError
from jaxinfer.params import Params, param_shapes, params_from_flat

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
)
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
_FILE_DTYPES = ("F32", "F16", "BF16")

# Defaults of transformers' configuration classes, for fields a config.json may omit.
_DEFAULTS: dict[str, dict] = {
    "llama": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_theta=10000.0,
        head_dim=None,
        sliding_window=None,
    ),
    "mistral": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=4096 * 32,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_theta=10000.0,
        head_dim=None,
        sliding_window=4096,
        num_key_value_heads=8,
    ),
    "qwen2": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_theta=10000.0,
        head_dim=None,
        sliding_window=4096,
        num_key_value_heads=32,
        use_sliding_window=False,
        max_window_layers=28,
    ),
    "qwen3": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_theta=10000.0,
        head_dim=128,
        sliding_window=4096,
        num_key_value_heads=32,
        use_sliding_window=False,
        max_window_layers=28,
    ),
    "gemma": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        rope_theta=10000.0,
        head_dim=256,
        num_key_value_heads=16,
        sliding_window=None,
    ),
    "gemma2": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        rope_theta=10000.0,
        head_dim=256,
        num_key_value_heads=4,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        head_dim=256,
        num_key_value_heads=4,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    ),
}
_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def _text_config(config: dict, where: str) -> tuple[str, dict]:
    """(family, the text model's config) of a config.json dict; gemma3 nests it in text_config."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: field 'model_type' is {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type != "gemma3":
        return model_type, config
    text = config.get("text_config")
    if not isinstance(text, dict):
        text = {}  # transformers builds the default Gemma3TextConfig
    text = dict(text)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return "gemma3_text", text


def _rope(
    params: dict | None, where: str, field: str, max_pos: int
) -> tuple[float | None, RopeScaling | None]:
    """(rope_theta or None, scaling) of one rope dict (``rope_scaling`` or ``rope_parameters``).

    llama3's ``original_max_position_embeddings`` defaults to ``max_pos``, as in transformers.
    """
    if not params:
        return None, None
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"{where}: field '{field}.partial_rotary_factor' is {params['partial_rotary_factor']}; "
            "only 1.0 (RoPE over the whole head) is supported"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        try:
            return theta, RopeScaling(
                "llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", max_pos)
                ),
            )
        except KeyError as e:
            raise CheckpointError(
                f"{where}: field '{field}' of rope_type 'llama3' lacks {e}"
            ) from None
    raise CheckpointError(
        f"{where}: field '{field}.rope_type' is {rope_type!r}; "
        "supported: 'default', 'linear', 'llama3'"
    )


def config_from_hf(config: dict, path_for_errors: str | os.PathLike = "config.json") -> ModelConfig:
    """Maps a Hugging Face ``config.json`` dict to a ModelConfig.

    Args:
        config: the parsed config.json.
        path_for_errors: the file named in error messages.

    Returns:
        The architecture. Sliding windows come from ``layer_types`` when present, otherwise from the
        family's rule (Mistral: every layer; Qwen2/3: layers >= ``max_window_layers`` when
        ``use_sliding_window``; Gemma 2: even layers; Gemma 3: all but every
        ``sliding_window_pattern``-th layer).

    Raises:
        CheckpointError: unknown ``model_type``, missing required field, unsupported RoPE type,
            activation, bias or layer type; the message names the file and the field.
    """
    where = str(path_for_errors)
    family, c = _text_config(config, where)
    d = _DEFAULTS[family]

    def get(key):
        if key in c and c[key] is not None:
            return c[key]
        if key in d:
            return d[key]
        raise CheckpointError(f"{where}: required field {key!r} is missing (model_type {family!r})")

    def opt(key):
        return c[key] if key in c else d.get(key)

    hidden, n_heads, n_layers = (
        int(get("hidden_size")),
        int(get("num_attention_heads")),
        int(get("num_hidden_layers")),
    )
    n_kv = c.get("num_key_value_heads")
    if n_kv is None:
        n_kv = (
            n_heads
            if family in ("llama", "mistral", "qwen2", "qwen3")
            else d["num_key_value_heads"]
        )
    head_dim = c.get("head_dim") or d["head_dim"] or hidden // n_heads
    if family == "qwen2":  # Qwen2 has no head_dim field; transformers reads it with getattr.
        head_dim = c.get("head_dim") or hidden // n_heads

    act_key = "hidden_activation" if family in ("gemma2", "gemma3_text") else "hidden_act"
    act_name = get(act_key)
    if family == "gemma" and act_name == "gelu":  # legacy Gemma value, meant as the tanh gelu
        act_name = "gelu_pytorch_tanh"
    if act_name not in _ACTS:
        raise CheckpointError(
            f"{where}: field {act_key!r} is {act_name!r}; supported: {', '.join(_ACTS)}"
        )
    if c.get("mlp_bias"):
        raise CheckpointError(f"{where}: field 'mlp_bias' is true; MLP biases are not supported")
    attention_bias = family == "qwen2"
    if family != "qwen2" and c.get("attention_bias"):
        raise CheckpointError(
            f"{where}: field 'attention_bias' is true for {family!r} (this adds an o_proj bias); "
            "only Qwen2's q/k/v biases are supported"
        )
    if c.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{where}: field 'use_bidirectional_attention' is true; only causal "
            "attention is supported"
        )

    # RoPE: transformers 5 "rope_parameters" (flat, or nested per layer type) or 4's fields.
    rp = c.get("rope_parameters")
    max_pos = int(get("max_position_embeddings"))
    rope_theta = None
    scaling = None
    local_theta = None
    if rp and ("full_attention" in rp or "sliding_attention" in rp):
        rope_theta, scaling = _rope(
            rp.get("full_attention"), where, "rope_parameters.full_attention", max_pos
        )
        local_theta, local_scaling = _rope(
            rp.get("sliding_attention"), where, "rope_parameters.sliding_attention", max_pos
        )
        if local_scaling is not None:
            raise CheckpointError(
                f"{where}: field 'rope_parameters.sliding_attention.rope_type' "
                "must be 'default'; scaled local RoPE is not supported"
            )
    elif rp:
        rope_theta, scaling = _rope(rp, where, "rope_parameters", max_pos)
    else:
        rope_theta, scaling = _rope(c.get("rope_scaling"), where, "rope_scaling", max_pos)
    rope_theta = float(rope_theta if rope_theta is not None else get("rope_theta"))
    if family == "gemma3_text":
        if local_theta is None:
            local_theta = get("rope_local_base_freq")
        local_theta = float(local_theta)
    else:
        local_theta = None

    # Sliding windows per layer.
    if family in ("qwen2", "qwen3"):
        window = get("sliding_window") if c.get("use_sliding_window", False) else None
    elif family in ("llama", "gemma"):
        window = None  # these families' modeling code never slides
    else:
        window = opt("sliding_window")
    window = int(window) if window else 0
    layer_types = c.get("layer_types")
    if family in ("mistral", "llama", "gemma"):
        layer_types = None  # ignored by these families' modeling code
    if layer_types is None:
        if family == "mistral":
            layer_types = ["sliding_attention"] * n_layers
        elif family in ("qwen2", "qwen3"):
            mwl = int(get("max_window_layers"))
            layer_types = [
                "sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)
            ]
        elif family == "gemma2":
            layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
            ]
        elif family == "gemma3_text":
            pattern = int(get("sliding_window_pattern"))
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n_layers)
            ]
        else:
            layer_types = ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise CheckpointError(
            f"{where}: field 'layer_types' has {len(layer_types)} entries, "
            f"expected num_hidden_layers={n_layers}"
        )
    windows = []
    for i, t in enumerate(layer_types):
        if t not in ("full_attention", "sliding_attention"):
            raise CheckpointError(
                f"{where}: field 'layer_types[{i}]' is {t!r}; supported: "
                "'full_attention', 'sliding_attention'"
            )
        windows.append(window if t == "sliding_attention" else 0)

    gemma = family in _GEMMAS
    softcap = opt("attn_logit_softcapping") if family in ("gemma2", "gemma3_text") else None
    final_softcap = opt("final_logit_softcapping") if family in ("gemma2", "gemma3_text") else None
    qpas = get("query_pre_attn_scalar") if family in ("gemma2", "gemma3_text") else None
    try:
        return ModelConfig(
            model_type=family,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(n_kv),
            head_dim=int(head_dim),
            max_position_embeddings=int(get("max_position_embeddings")),
            rms_norm_eps=float(get("rms_norm_eps")),
            norm_weight_offset=1.0 if gemma else 0.0,
            hidden_act=_ACTS[act_name],
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            attention_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3_text"),
            post_norms=family in ("gemma2", "gemma3_text"),
            embed_scale=gemma,
            query_pre_attn_scalar=None if qpas is None else float(qpas),
            attn_logit_softcap=None if softcap is None else float(softcap),
            final_logit_softcap=None if final_softcap is None else float(final_softcap),
            layer_windows=tuple(windows),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


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
        "layers.q_norm": (a + "q_norm.weight", lambda c: (H,), _same),
        "layers.k_norm": (a + "k_norm.weight", lambda c: (H,), _same),
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
    """(HF tensor name -> safetensors file path, the file that lists them for error messages)."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index}: unreadable index, expected a JSON object with a 'weight_map' field ({e})"
            ) from None
        return {k: os.path.join(path, v) for k, v in wm.items()}, index
    if os.path.exists(single):
        return {k: single for k in _open(single, None).keys()}, single
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


def _read(file: str, name: str, expected: tuple[int, ...], field: str) -> np.ndarray:
    """One tensor as a numpy array in its file dtype, shape-checked."""
    with _open(file, name) as f:
        try:
            sl = f.get_slice(name)
            dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
        except Exception as e:
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read: {e}") from None
        if dtype not in _FILE_DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {dtype}; supported: {', '.join(_FILE_DTYPES)}"
            )
        if shape != expected:
            raise CheckpointError(
                f"{file}: tensor {name!r} (for {field}) has shape {list(shape)}, "
                f"expected {list(expected)}"
            )
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(
                f"{file}: tensor {name!r} cannot be read (truncated or corrupt?): {e}"
            ) from None


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


def load_hf(path: str | os.PathLike, dtype=jnp.float32, place=None) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` + shards. Tensors may be f32, f16 or bf16.
        dtype: dtype of the returned Params (float32, bfloat16 or float16); each tensor is cast with
            round-to-nearest-even, as ``torch.Tensor.to``.
        place: optional ``place(cfg, field, x: np.ndarray) -> jax.Array`` that puts each host
            tensor on devices (``jaxinfer.sharding.ShardedPlacer`` shards it); default
            ``jnp.asarray``.

    Returns:
        (config, params). When ``lm_head.weight`` is absent the head is tied to the embedding even
        if ``tie_word_embeddings`` is false; when the config ties, a stored ``lm_head`` is ignored
       (as
        transformers does).

    Raises:
        CheckpointError: missing config.json or safetensors files, unsupported config (see
            ``config_from_hf``), a missing tensor, a tensor of the wrong shape or dtype, a truncated
            or corrupt file. The message names the file, the HF tensor name and the expected and
            found shapes.
    """
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(
            f"{cfg_file}: config.json is missing (expected a Hugging Face model directory)"
        )
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON: {e}") from None
    cfg = config_from_hf(raw, cfg_file)
    where, listing = _weight_map(path)
    prefix, head_name = _prefixes(set(where), raw)
    if not cfg.tie_word_embeddings and head_name not in where:
        cfg = cfg.__class__(**{**cfg.__dict__, "tie_word_embeddings": True})
    np_dtype = np.dtype(dtype)
    specs = _specs(cfg)
    flat = {}
    for field, shape in param_shapes(cfg).items():
        hf_name, hf_shape_fn, convert = specs[field]
        hf_shape = hf_shape_fn(cfg)
        full = head_name if field == "lm_head" else prefix + hf_name
        names = (
            [full.format(i=i) for i in range(cfg.num_layers)]
            if field.startswith("layers.")
            else [full]
        )
        out = np.empty(shape, np_dtype)
        for i, name in enumerate(names):
            if name not in where:
                raise CheckpointError(
                    f"{listing}: tensor {name!r} is missing (needed for {field}, expected shape "
                    f"{list(hf_shape)})"
                )
            x = convert(_read(where[name], name, hf_shape, field), cfg)
            if field.startswith("layers."):
                out[i] = x
            else:
                out[...] = x
            del x
        flat[field] = place(cfg, field, out) if place is not None else jnp.asarray(out)
        del out
    return cfg, params_from_flat(flat)
