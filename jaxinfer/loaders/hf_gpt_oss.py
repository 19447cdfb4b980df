"""gpt-oss ``config.json`` (transformers' ``GptOssConfig``) -> ModelConfig.

gpt-oss (OpenAI, 2025) is a mixture-of-experts decoder whose attention differs from Llama's in
four ways, each a ModelConfig field: per-head attention sinks (``attention_sinks``), q/k/v and
o_proj biases (``attention_bias``, ``attention_out_bias``), alternating sliding-window and full
layers (``layer_windows`` from ``layer_types`` and ``sliding_window``), and YaRN RoPE
(``RopeScaling("yarn", ...)``). Its MLP is a top-k router (with a bias, softmax after the top-k:
``router_bias``, ``router_order="topk_softmax"``) over experts with biases (``expert_bias``) and
a clamped SwiGLU (``expert_glu="gpt_oss_clamped"``, ``swiglu_limit``, ``swiglu_alpha``), every
layer sparse, the expert width ``intermediate_size``. Both the transformers 5 layout
(``rope_parameters``) and the one the checkpoints ship (``rope_scaling`` + ``rope_theta``) are
read; defaults are ``GptOssConfig``'s.

Every field that changes the model and is not supported is refused naming it (CheckpointError
naming the file and the field); fields without effect at inference (``attention_dropout``,
``router_aux_loss_coef``, ``output_router_logits``, ``initializer_range``, ``hidden_act``, which
gpt-oss's experts ignore) are not read.
"""

from __future__ import annotations

import math

from jaxinfer.errors import CheckpointError
from jaxinfer.models.checks import INT32_MAX
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.rope import RopeScaling

MODEL_TYPE = "gpt_oss"
MIN_FILE_DTYPE_BYTES = 2  # the narrowest float dtype read (F16, BF16), as hf_config
MXFP4_BYTES_PER_VALUE = 17 / 32  # 16 bytes of FP4 pairs + 1 scale byte per 32 values

# GptOssConfig's defaults (transformers 5), for fields a config.json may omit.
DEFAULTS = dict(
    num_hidden_layers=36,
    num_local_experts=128,
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    head_dim=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    sliding_window=128,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    num_experts_per_tok=4,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    attention_bias=True,
    rope_theta=150000.0,
)
DEFAULT_ROPE = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)
QUANT_METHODS = ("mxfp4",)


class _Reader:
    """Typed reads of the config dict; every error names the file and the field."""

    def __init__(self, c: dict, where: str):
        self.c, self.where = c, where

    def err(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: field {key!r} {what}")

    def get(self, key: str, default=None):
        v = self.c.get(key)
        return DEFAULTS.get(key, default) if v is None else v

    def int(self, key: str, v=None, low: int = 1) -> int:
        v = self.get(key) if v is None else v
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= INT32_MAX:
            raise self.err(key, f"is {v!r}; expected an integer in [{low}, {INT32_MAX}]")
        return v

    def float(self, key: str, v=None, allow_zero: bool = False) -> float:
        v = self.get(key) if v is None else v
        ok = not isinstance(v, bool) and isinstance(v, int | float)
        f = float(v) if ok and math.isfinite(v) else math.nan
        if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
            raise self.err(
                key, f"is {v!r}; expected a finite number {'>= 0' if allow_zero else '> 0'}"
            )
        return f

    def flag(self, key: str, v=None) -> bool:
        v = self.get(key) if v is None else v
        if not isinstance(v, bool):
            raise self.err(key, f"is {v!r}; expected true or false")
        return v


def yarn_from_hf(params: dict, *, where: str, field: str, max_pos: int) -> RopeScaling:
    """A YaRN ``RopeScaling`` from a Hugging Face rope dict of ``rope_type`` "yarn" (the keys of
    transformers' ``_compute_yarn_parameters``: ``factor`` (default ``max_pos`` /
    ``original_max_position_embeddings``), ``original_max_position_embeddings`` (default
    ``max_pos``), ``beta_fast`` (32), ``beta_slow`` (1), ``truncate`` (true),
    ``attention_factor``, ``mscale``, ``mscale_all_dim``). Raises CheckpointError naming
    ``where`` and ``field.key`` for a value of the wrong type or range."""
    r = _Reader(params, where)

    def num(key, default=None):
        v = params.get(key)
        return default if v is None else r.float(f"{field}.{key}", v)

    omax = params.get("original_max_position_embeddings", max_pos)
    omax = r.int(f"{field}.original_max_position_embeddings", omax)
    factor = num("factor", max_pos / omax)
    truncate = params.get("truncate", True)
    try:
        return RopeScaling(
            "yarn",
            factor=factor,
            original_max_position_embeddings=omax,
            beta_fast=num("beta_fast", 32.0),  # transformers: `or 32`, so 0 means 32 too
            beta_slow=num("beta_slow", 1.0),
            truncate=r.flag(f"{field}.truncate", truncate),
            attention_factor=num("attention_factor"),
            mscale=num("mscale"),
            mscale_all_dim=num("mscale_all_dim"),
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {field}: {e}") from None


def _rope(r: _Reader, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    ``rope_theta`` (the shipped checkpoints); absent: GptOssConfig's yarn."""
    c = r.c
    field = "rope_parameters" if c.get("rope_parameters") is not None else "rope_scaling"
    params = c.get(field)
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict):
        raise r.err(field, f"is {params!r}; expected an object")
    theta = params.get("rope_theta", c.get("rope_theta"))
    theta = r.float(f"{field}.rope_theta" if "rope_theta" in params else "rope_theta", theta)
    prf = params.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise r.err(f"{field}.partial_rotary_factor", f"is {prf!r}; only 1.0 is supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, yarn_from_hf(params, where=r.where, field=field, max_pos=max_pos)
    raise r.err(f"{field}.rope_type", f"is {rope_type!r}; supported for gpt-oss: 'yarn', 'default'")


def gpt_oss_config_from_hf(
    config: dict, where: str = "config.json", checkpoint_bytes: int | None = None
) -> ModelConfig:
    """Maps a gpt-oss ``config.json`` dict to a ModelConfig (attention and MoE fields).

    Attention: ``attention_bias`` gives q/k/v and o_proj biases both; sinks always; head_dim as
    given (64); layer windows from ``layer_types`` (default: even layers sliding, odd full) with
    ``sliding_window`` tokens (a query at i sees keys j with ``i - j < sliding_window``).
    MoE: ``num_local_experts`` experts of width ``intermediate_size``, top ``num_experts_per_tok``
    of the router logits (bias added) then their softmax, expert biases, the clamped SwiGLU.

    ``checkpoint_bytes``: bytes of the weight files; when given, a config whose sizes imply more
    (2 bytes a parameter; 17/32 of a byte an expert weight when ``quantization_config`` is MXFP4)
    is refused.

    Raises:
        CheckpointError: naming the file and the field: ``model_type`` not "gpt_oss"; a size,
            flag or number of the wrong type or range; num_attention_heads not a multiple of
            num_key_value_heads; ``num_experts_per_tok`` above the expert count; ``layer_types``
            not a list of "sliding_attention" / "full_attention" of length num_hidden_layers;
            sliding layers without a ``sliding_window``; a RoPE other than yarn / default or a
            partial rotary factor; a ``quantization_config`` other than MXFP4; ``mlp_bias`` or
            ``use_bidirectional_attention`` true; sizes implying more bytes than
            ``checkpoint_bytes``.
    """
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        got = config.get("model_type") if isinstance(config, dict) else config
        raise CheckpointError(f"{where}: field 'model_type' is {got!r}; expected {MODEL_TYPE!r}")
    r = _Reader(config, where)
    n_layers, n_heads = r.int("num_hidden_layers"), r.int("num_attention_heads")
    n_kv = r.int("num_key_value_heads", config.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv:
        raise r.err("num_attention_heads", f"is {n_heads}, not a multiple of {n_kv} KV heads")
    for key in ("mlp_bias", "use_bidirectional_attention"):
        if config.get(key):
            raise r.err(key, "is set; gpt-oss as supported has no such option")
    max_pos = r.int("max_position_embeddings")
    theta, scaling = _rope(r, max_pos)

    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise r.err("layer_types", f"is {layer_types!r}; expected a list of {n_layers} entries")
    window = config.get("sliding_window", DEFAULTS["sliding_window"])
    windows = []
    for i, t in enumerate(layer_types):
        if t not in ("sliding_attention", "full_attention"):
            raise r.err(
                f"layer_types[{i}]", f"is {t!r}; supported: 'sliding_attention', 'full_attention'"
            )
        if t == "sliding_attention" and window is None:
            raise r.err("sliding_window", "is null but layer_types has sliding_attention layers")
        windows.append(r.int("sliding_window", window) if t == "sliding_attention" else 0)

    quant = config.get("quantization_config")
    mxfp4 = False
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method not in QUANT_METHODS:
            raise r.err(
                "quantization_config.quant_method",
                f"is {method!r}; supported: {', '.join(QUANT_METHODS)} (dequantized at load)",
            )
        mxfp4 = True
    n_experts = r.int(
        "num_local_experts", config.get("num_local_experts") or config.get("num_experts")
    )
    top_k = r.int(
        "num_experts_per_tok", config.get("num_experts_per_tok") or config.get("experts_per_token")
    )
    if top_k > n_experts:
        raise r.err("num_experts_per_tok", f"is {top_k}, above num_local_experts={n_experts}")
    bias = r.flag("attention_bias")
    width = r.int("intermediate_size")
    try:
        model = ModelConfig(
            model_type=MODEL_TYPE,
            vocab_size=r.int("vocab_size"),
            hidden_size=r.int("hidden_size"),
            intermediate_size=width,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=r.int("head_dim"),
            max_position_embeddings=max_pos,
            rms_norm_eps=r.float("rms_norm_eps", allow_zero=True),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bias,
            attention_out_bias=bias,
            attention_sinks=True,
            layer_windows=tuple(windows),
            tie_word_embeddings=r.flag("tie_word_embeddings"),
            num_experts=n_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=width,
            router_order="topk_softmax",
            router_bias=True,
            expert_bias=True,
            expert_glu="gpt_oss_clamped",
            swiglu_limit=r.float("swiglu_limit"),
            swiglu_alpha=r.float("swiglu_alpha"),
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if checkpoint_bytes is not None:
        need = min_checkpoint_bytes(model, mxfp4)
        if need > checkpoint_bytes:
            raise CheckpointError(
                f"{where}: the config's sizes (num_local_experts={n_experts}, intermediate_size="
                f"{width}, num_hidden_layers={n_layers}, hidden_size={model.hidden_size}, "
                f"vocab_size={model.vocab_size}, ...) imply at least {need} bytes of weights (2 "
                f"bytes a parameter{', 17/32 an MXFP4 expert weight' if mxfp4 else ''}), but the "
                f"checkpoint's weight files hold {checkpoint_bytes} bytes: a size in the config "
                "is wrong"
            )
    return model


def min_checkpoint_bytes(cfg: ModelConfig, experts_mxfp4: bool) -> int:
    """The fewest bytes a gpt-oss checkpoint of ``cfg`` can take: 2 bytes a parameter, the
    expert weights at 17/32 of a byte when stored as MXFP4."""
    expert_weights = sum(cfg.sparse_layers) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    expert_weights *= cfg.num_experts
    rest = cfg.num_params() - expert_weights
    per_expert_weight = MXFP4_BYTES_PER_VALUE if experts_mxfp4 else MIN_FILE_DTYPE_BYTES
    return int(MIN_FILE_DTYPE_BYTES * rest + per_expert_weight * expert_weights)
