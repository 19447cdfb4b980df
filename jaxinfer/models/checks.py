"""Checks of configuration values: integers, floats and booleans in range, with errors naming the
field (``ModelConfig``, ``RopeScaling`` and the checkpoint loaders use them)."""

from __future__ import annotations

import math
import numbers

import numpy as np

INT32_MAX = 2**31 - 1  # token ids, positions and sizes are int32 on device


def check_int(name: str, v, low: int = 1, high: int = INT32_MAX) -> int:
    """``v`` as an int when it is an integer (not a bool) in [low, high]; else ValueError naming
    ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r} ({type(v).__name__})")
    if not low <= v <= high:
        raise ValueError(f"{name}={v} is out of range: expected an integer in [{low}, {high}]")
    return int(v)


def check_float(name: str, v, positive: bool = True, allow_zero: bool = False) -> float:
    """``v`` as a float when it is a finite real number (not a bool), > 0 when ``positive``
    (>= 0 with ``allow_zero``); else ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name}={v!r} must be finite")
    if positive and not (f > 0 or (allow_zero and f == 0)):
        raise ValueError(f"{name}={v!r} must be {'>= 0' if allow_zero else '> 0'}")
    if f != 0 and not _F32_TINY <= abs(f) <= _F32_MAX:
        raise ValueError(
            f"{name}={v!r} cannot be represented in float32, where the model "
            f"computes (non-zero magnitudes must be in [{_F32_TINY:.8g}, "
            f"{_F32_MAX:.8g}])"
        )
    return f


_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)


def check_bool(name: str, v) -> bool:
    if not isinstance(v, bool | np.bool_):
        raise ValueError(f"{name} must be true or false, got {v!r} ({type(v).__name__})")
    return bool(v)
