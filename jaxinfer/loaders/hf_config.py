"""Hugging Face ``config.json`` -> ModelConfig, every field checked for type and range.

Supported ``model_type`` values: llama (Llama 2, Llama 3/3.1), mistral, qwen2, qwen3, gemma, gemma2,
gemma3_text and gemma3 (the text tower of the multimodal checkpoint). Both the transformers 4 config
layout (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``) and
the transformers 5 layout (``rope_parameters``, possibly nested per layer type, ``layer_types``) are
read. Missing config fields take the default of transformers' configuration class of the family.
A field of the wrong type (a string, a bool or a float where an integer belongs, a JSON list where
an object belongs), out of range (a size < 1 or >= 2**31, a non-finite or non-positive float) or
implying more weights than the checkpoint's files hold is a CheckpointError naming the file and
the field, raised before anything of that size is built.
"""

from __future__ import annotations

import math
import os

from jaxinfer.errors import CheckpointError
from jaxinfer.models.checks import INT32_MAX
from jaxinfer.models.config import ModelConfig, num_params
from jaxinfer.models.rope import RopeScaling

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


MIN_FILE_DTYPE_BYTES = 2  # the narrowest stored dtype read (F16, BF16)


class Fields:
    """Typed reads of one config dict; every error names the file and the field."""

    def __init__(self, c: dict, defaults: dict, where: str, family: str):
        self.c, self.d, self.where, self.family = c, defaults, where, family

    def err(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: field {key!r} {what}")

    def get(self, key: str):
        """The value; the family's default when absent or null; CheckpointError when neither."""
        if self.c.get(key) is not None:
            return self.c[key]
        if key in self.d:
            return self.d[key]
        raise CheckpointError(
            f"{self.where}: required field {key!r} is missing (model_type {self.family!r})"
        )

    def opt(self, key: str):
        """The value when present (null included), else the family's default or None."""
        return self.c[key] if key in self.c else self.d.get(key)

    def int(self, key: str, v, low: int = 1) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"is {v!r} ({type(v).__name__}); expected an integer")
        if not low <= v <= INT32_MAX:
            raise self.err(key, f"is {v}; expected an integer in [{low}, {INT32_MAX}]")
        return v

    def float(self, key: str, v, allow_zero: bool = False) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.err(key, f"is {v!r} ({type(v).__name__}); expected a number")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
            raise self.err(
                key, f"is {v!r}; expected a finite number {'>= 0' if allow_zero else '> 0'}"
            )
        return f

    def flag(self, key: str, v) -> bool:
        if not isinstance(v, bool):
            raise self.err(key, f"is {v!r} ({type(v).__name__}); expected true or false")
        return v

    def dict(self, key: str, v) -> dict | None:
        if v is not None and not isinstance(v, dict):
            raise self.err(key, f"is a JSON {_json_type(v)}; expected an object (or null)")
        return v


def _json_type(v) -> str:
    names = {
        dict: "object",
        list: "list",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }
    return names.get(type(v), type(v).__name__)


def _text_config(config: dict, where: str) -> tuple[str, dict]:
    """(family, the text model's config) of a config.json dict; gemma3 nests it in text_config."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: field 'model_type' is {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type != "gemma3":
        return model_type, config
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(
            f"{where}: field 'text_config' is a JSON {_json_type(text)}; expected an object"
        )
    text = dict(text or {})  # absent: transformers builds the default Gemma3TextConfig
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return "gemma3_text", text


def _rope(f: Fields, params, field: str, max_pos: int) -> tuple[float | None, RopeScaling | None]:
    """(rope_theta or None, scaling) of one rope dict (``rope_scaling`` or ``rope_parameters``).

    llama3's ``original_max_position_embeddings`` defaults to ``max_pos``, as in transformers.
    """
    params = f.dict(field, params)
    if not params:
        return None, None
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta")
    if theta is not None:
        theta = f.float(f"{field}.rope_theta", theta)
    prf = params.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise f.err(
            f"{field}.partial_rotary_factor",
            f"is {prf!r}; only 1.0 (RoPE over the whole head) is supported",
        )
    if rope_type == "default":
        return theta, None

    def num(key):
        if key not in params:
            raise f.err(field, f"of rope_type {rope_type!r} lacks {key!r}")
        return f.float(f"{field}.{key}", params[key])

    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=num("factor"))
    if rope_type == "yarn":
        from jaxinfer.loaders.hf_gpt_oss import yarn_from_hf

        return theta, yarn_from_hf(params, where=f.where, field=field, max_pos=max_pos)
    if rope_type == "llama3":
        omax = params.get("original_max_position_embeddings", max_pos)
        lo, hi = num("low_freq_factor"), num("high_freq_factor")
        if lo >= hi:
            raise f.err(
                f"{field}.low_freq_factor",
                f"is {lo}; expected below "
                f"high_freq_factor={hi} (llama3 RoPE divides by their difference)",
            )
        return theta, RopeScaling(
            "llama3",
            factor=num("factor"),
            low_freq_factor=lo,
            high_freq_factor=hi,
            original_max_position_embeddings=f.int(
                f"{field}.original_max_position_embeddings", omax
            ),
        )
    raise f.err(
        f"{field}.rope_type", f"is {rope_type!r}; supported: 'default', 'linear', 'llama3', 'yarn'"
    )


def config_from_hf(
    config: dict,
    path_for_errors: str | os.PathLike = "config.json",
    checkpoint_bytes: int | None = None,
) -> ModelConfig:
    """Maps a Hugging Face ``config.json`` dict to a ModelConfig.

    Args:
        config: the parsed config.json.
        path_for_errors: the file named in error messages.
        checkpoint_bytes: bytes of the checkpoint's weight files; when given, a config whose
            sizes imply more weights (at 2 bytes a parameter, the narrowest stored dtype) is
            refused before anything per layer is built.

    Returns:
        The architecture. Sliding windows come from ``layer_types`` when present, otherwise from the
        family's rule (Mistral: every layer; Qwen2/3: layers >= ``max_window_layers`` when
        ``use_sliding_window``; Gemma 2: even layers; Gemma 3: all but every
        ``sliding_window_pattern``-th layer).

    Raises:
        CheckpointError: the config is not a JSON object; unknown ``model_type``; a missing
            required field; a field of the wrong type or out of range (sizes in [1, 2**31 - 1],
            floats finite, eps >= 0, theta > 0); num_attention_heads not a multiple of
            num_key_value_heads; sizes implying more than ``checkpoint_bytes``; an unsupported
            RoPE type, activation, bias or layer type; for gpt-oss, what
            ``hf_gpt_oss.gpt_oss_config_from_hf`` refuses. The message names the file and the
            field.
    """
    where = str(path_for_errors)
    if isinstance(config, dict) and config.get("model_type") == "gpt_oss":
        from jaxinfer.loaders.hf_gpt_oss import gpt_oss_config_from_hf

        return gpt_oss_config_from_hf(config, where, checkpoint_bytes)
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{where}: the config is a JSON {_json_type(config)}; expected an object with fields "
            "such as 'model_type' and 'hidden_size'"
        )
    family, c = _text_config(config, where)
    f = Fields(c, _DEFAULTS[family], where, family)
    get, opt = f.get, f.opt

    def size(key):
        return f.int(key, get(key))

    hidden, n_heads, n_layers = (
        size("hidden_size"),
        size("num_attention_heads"),
        size("num_hidden_layers"),
    )
    vocab, inter = size("vocab_size"), size("intermediate_size")
    n_kv = c.get("num_key_value_heads")
    if n_kv is None:  # transformers: MHA for these families, else the class default
        n_kv = (
            n_heads
            if family in ("llama", "mistral", "qwen2", "qwen3")
            else f.d["num_key_value_heads"]
        )
    n_kv = f.int("num_key_value_heads", n_kv)
    if n_heads % n_kv:
        raise f.err(
            "num_attention_heads", f"is {n_heads}, not a multiple of num_key_value_heads={n_kv}"
        )
    if c.get("head_dim") is not None:
        head_dim = f.int("head_dim", c["head_dim"])
    elif f.d.get("head_dim") is not None:
        head_dim = f.d["head_dim"]
    else:  # transformers: hidden_size // num_attention_heads
        if hidden < n_heads:
            raise f.err(
                "hidden_size",
                f"is {hidden}, fewer than num_attention_heads={n_heads} "
                "and no head_dim is given (head_dim = hidden_size // num_attention_heads "
                "would be 0)",
            )
        head_dim = hidden // n_heads
    tie = f.flag("tie_word_embeddings", get("tie_word_embeddings"))
    max_pos = size("max_position_embeddings")
    if checkpoint_bytes is not None:
        need = MIN_FILE_DTYPE_BYTES * num_params(
            vocab, hidden, inter, n_layers, n_heads, n_kv, head_dim, tied=True
        )
        if need > checkpoint_bytes:
            raise CheckpointError(
                f"{where}: the config's sizes (vocab_size={vocab}, hidden_size={hidden}, "
                f"intermediate_size={inter}, num_hidden_layers={n_layers}, num_attention_heads="
                f"{n_heads}, num_key_value_heads={n_kv}, head_dim={head_dim}) imply at least "
                f"{need} bytes of weights (2 bytes a parameter), but the checkpoint's weight "
                f"files hold {checkpoint_bytes} bytes: a size in the config is wrong"
            )

    act_key = "hidden_activation" if family in ("gemma2", "gemma3_text") else "hidden_act"
    act_name = get(act_key)
    if family == "gemma" and act_name == "gelu":  # legacy Gemma value, meant as the tanh gelu
        act_name = "gelu_pytorch_tanh"
    if not isinstance(act_name, str) or act_name not in _ACTS:
        raise f.err(act_key, f"is {act_name!r}; supported: {', '.join(_ACTS)}")
    for key in ("mlp_bias", "attention_bias", "use_bidirectional_attention", "use_sliding_window"):
        if c.get(key) is not None:
            f.flag(key, c[key])
    if c.get("mlp_bias"):
        raise f.err("mlp_bias", "is true; MLP biases are not supported")
    attention_bias = family == "qwen2"
    if family != "qwen2" and c.get("attention_bias"):
        raise f.err(
            "attention_bias",
            f"is true for {family!r} (this adds an o_proj bias); "
            "only Qwen2's q/k/v biases are supported",
        )
    if c.get("use_bidirectional_attention"):
        raise f.err("use_bidirectional_attention", "is true; only causal attention is supported")

    # RoPE: transformers 5 "rope_parameters" (flat, or nested per layer type) or 4's fields.
    rp = f.dict("rope_parameters", c.get("rope_parameters"))
    local_theta = None
    if rp and ("full_attention" in rp or "sliding_attention" in rp):
        rope_theta, scaling = _rope(
            f, rp.get("full_attention"), "rope_parameters.full_attention", max_pos
        )
        local_theta, local_scaling = _rope(
            f, rp.get("sliding_attention"), "rope_parameters.sliding_attention", max_pos
        )
        if local_scaling is not None:
            raise f.err(
                "rope_parameters.sliding_attention.rope_type",
                "must be 'default'; scaled local RoPE is not supported",
            )
    elif rp:
        rope_theta, scaling = _rope(f, rp, "rope_parameters", max_pos)
    else:
        rope_theta, scaling = _rope(f, c.get("rope_scaling"), "rope_scaling", max_pos)
    if rope_theta is None:
        rope_theta = f.float("rope_theta", get("rope_theta"))
    if family == "gemma3_text":
        if local_theta is None:
            local_theta = f.float("rope_local_base_freq", get("rope_local_base_freq"))
    else:
        local_theta = None

    # Sliding windows per layer.
    if family in ("qwen2", "qwen3"):
        window = get("sliding_window") if c.get("use_sliding_window", False) else None
    elif family in ("llama", "gemma"):
        window = None  # these families' modeling code never slides
    else:
        window = opt("sliding_window")
    window = 0 if window is None else f.int("sliding_window", window, low=0)
    layer_types = c.get("layer_types")
    if family in ("mistral", "llama", "gemma"):
        layer_types = None  # ignored by these families' modeling code
    if layer_types is None:
        if family == "mistral":
            layer_types = ["sliding_attention"] * n_layers
        elif family in ("qwen2", "qwen3"):
            mwl = f.int("max_window_layers", get("max_window_layers"), low=0)
            layer_types = [
                "sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)
            ]
        elif family == "gemma2":
            layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
            ]
        elif family == "gemma3_text":
            pattern = f.int("sliding_window_pattern", get("sliding_window_pattern"))
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n_layers)
            ]
        else:
            layer_types = ["full_attention"] * n_layers
    if not isinstance(layer_types, list):
        raise f.err("layer_types", f"is a JSON {_json_type(layer_types)}; expected a list")
    if len(layer_types) != n_layers:
        raise f.err(
            "layer_types", f"has {len(layer_types)} entries, expected num_hidden_layers={n_layers}"
        )
    windows = []
    for i, t in enumerate(layer_types):
        if not isinstance(t, str) or t not in ("full_attention", "sliding_attention"):
            raise f.err(
                f"layer_types[{i}]", f"is {t!r}; supported: 'full_attention', 'sliding_attention'"
            )
        windows.append(window if t == "sliding_attention" else 0)

    gemma = family in _GEMMAS
    gemma23 = family in ("gemma2", "gemma3_text")

    def opt_float(key):
        v = opt(key) if gemma23 else None
        return None if v is None else f.float(key, v)

    qpas = f.float("query_pre_attn_scalar", get("query_pre_attn_scalar")) if gemma23 else None
    try:
        return ModelConfig(
            model_type=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=f.float("rms_norm_eps", get("rms_norm_eps"), allow_zero=True),
            norm_weight_offset=1.0 if gemma else 0.0,
            hidden_act=_ACTS[act_name],
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            attention_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3_text"),
            post_norms=gemma23,
            embed_scale=gemma,
            query_pre_attn_scalar=qpas,
            attn_logit_softcap=opt_float("attn_logit_softcapping"),
            final_logit_softcap=opt_float("final_logit_softcapping"),
            layer_windows=tuple(windows),
            tie_word_embeddings=tie,
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
