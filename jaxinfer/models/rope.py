"""Rotary position embeddings: the ``rope_scaling`` entry of a config (``RopeScaling``) and the
inverse frequencies and attention factor it gives, as transformers' ``modeling_rope_utils``."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxinfer.models.checks import check_bool, check_float, check_int

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling`` config entry.

    Attributes:
        rope_type: ``"linear"`` (positions divided by ``factor``), ``"llama3"`` (Llama 3.1's
            wavelength-dependent scaling, transformers' ``_compute_llama3_parameters``) or
            ``"yarn"`` (YaRN, Peng et al. 2023, as transformers' ``_compute_yarn_parameters``:
            inverse frequencies blended between interpolated and extrapolated by a linear ramp
            over the dimensions, and cos/sin multiplied by an attention factor).
        factor: scaling factor.
        low_freq_factor: llama3 only.
        high_freq_factor: llama3 only.
        original_max_position_embeddings: llama3 and yarn, in tokens.
        beta_fast, beta_slow: yarn only, the ramp's bounds in rotations (extrapolation above
            ``beta_fast``, interpolation below ``beta_slow``).
        truncate: yarn only, round the ramp's bounds outward to whole dimensions.
        attention_factor: yarn only, the cos/sin multiplier; None: derived from ``factor``
            (and ``mscale`` / ``mscale_all_dim`` when both are set), as transformers does.
        mscale, mscale_all_dim: yarn only, DeepSeek's attention-factor terms, or None.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported: "
                + ", ".join(repr(t) for t in ROPE_SCALING_TYPES)
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            object.__setattr__(self, name, check_float(f"rope_scaling.{name}", getattr(self, name)))
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                object.__setattr__(
                    self, name, check_float(f"rope_scaling.{name}", getattr(self, name))
                )
        object.__setattr__(self, "truncate", check_bool("rope_scaling.truncate", self.truncate))
        object.__setattr__(
            self,
            "original_max_position_embeddings",
            check_int(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
            ),
        )
        if self.rope_type == "llama3" and self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(
                f"rope_scaling.low_freq_factor={self.low_freq_factor} must be below "
                f"high_freq_factor={self.high_freq_factor} (llama3 divides by their difference)"
            )


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies of RoPE, f32[H // 2].

    Follows transformers' ``modeling_rope_utils`` (default, linear, llama3 and yarn types).
    """
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, pos_freqs)
    # llama3: Llama 3.1 "Scaling RoPE" (wavelength-dependent interpolation).
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq_llama / scaling.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling, pos_freqs: np.ndarray
) -> np.ndarray:
    """YaRN's inverse frequencies f32[H // 2] (transformers' ``_compute_yarn_parameters``): the
    dimensions rotating fewer than ``beta_slow`` times over the original context are interpolated
    (divided by ``factor``), those rotating more than ``beta_fast`` times kept, a linear ramp
    between."""

    def correction_dim(rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return (head_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(scaling.beta_fast)
    high = correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    extrapolated = 1.0 / pos_freqs
    return (interpolated * (1 - extrapolation) + extrapolated * extrapolation).astype(np.float32)


def rope_attention_scaling(scaling: RopeScaling | None) -> float:
    """The factor RoPE's cos and sin are multiplied by: 1.0, except for yarn, whose
    ``attention_factor`` defaults to ``0.1 * ln(factor) + 1`` (or DeepSeek's ratio of two such
    terms when ``mscale`` and ``mscale_all_dim`` are both set), as transformers'
    ``_compute_yarn_parameters``."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(
            get_mscale(scaling.factor, scaling.mscale)
            / get_mscale(scaling.factor, scaling.mscale_all_dim)
        )
    return get_mscale(scaling.factor)
