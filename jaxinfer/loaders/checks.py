"""Checks shared by the checkpoint loaders, run on host arrays and sizes before device work:
non-finite weights, weights that overflow the target dtype, weights that do not fit in memory,
and the warning for tensors a checkpoint holds that the model does not use (each loader's
documented allowlist; any other unused tensor is a CheckpointError).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.memory_limits import available_host_bytes, fmt_bytes, shortfall


class CheckpointWarning(UserWarning):
    """A checkpoint holds tensors the model does not use, on a loader's documented allowlist
    (e.g. the rotary caches ``rotary_emb.inv_freq`` of old Llama checkpoints)."""


def check_finite(x: np.ndarray, file: str | os.PathLike, tensor: str) -> None:
    """Raises CheckpointError when ``x`` (any float dtype, ml_dtypes' bfloat16 included) holds
    NaN or +-Inf, naming the file, the tensor, how many values and the first one's index."""
    ok = np.isfinite(x)
    if ok.all():
        return
    bad = ok.size - int(np.count_nonzero(ok))
    first = np.unravel_index(int(np.argmin(ok)), x.shape)
    raise CheckpointError(
        f"{file}: tensor {tensor!r} holds {bad} non-finite value(s) (NaN or Inf; first "
        f"{x[first]} at index {[int(i) for i in first]}): the checkpoint is corrupt"
    )


def check_cast(x: np.ndarray, file: str | os.PathLike, tensor: str) -> None:
    """Raises CheckpointError when the finite tensor ``x``, cast to a narrower float dtype, holds
    Inf: values beyond the dtype's largest were read (e.g. 1e5 in float16)."""
    ok = np.isfinite(x)
    if ok.all():
        return
    bad = ok.size - int(np.count_nonzero(ok))
    raise CheckpointError(
        f"{file}: tensor {tensor!r} has {bad} value(s) beyond {x.dtype}'s range (largest "
        f"{float(np.finfo(x.dtype).max):g}); load it in float32 or bfloat16"
    )


def param_bytes(shapes, dtype) -> int:
    """Bytes of arrays of these shapes in ``dtype``, in Python ints (no overflow)."""
    return sum(math.prod(s) for s in shapes) * np.dtype(dtype).itemsize


def check_fits(file: str | os.PathLike, device_bytes: int, host_bytes: int, what: str) -> None:
    """Raises CheckpointError when the weights cannot fit: ``device_bytes`` in all, split over
    every device, and ``host_bytes`` held on the host while loading (on CPU the sum of the two
    is compared with the host's memory).

    The message names the file and says the bytes needed and available."""
    devices = jax.devices()
    if devices[0].platform == "cpu":  # the devices' memory is the host's
        short = shortfall(device_bytes + host_bytes, devices[:1])
    else:
        short = shortfall(-(-device_bytes // len(devices)), devices)
    if short is not None:
        raise CheckpointError(f"{file}: {what} do not fit in memory: {short}")
    if devices[0].platform != "cpu":
        avail = available_host_bytes()
        if avail is not None and host_bytes > avail:
            raise CheckpointError(
                f"{file}: loading {what} holds {fmt_bytes(host_bytes)} on the host at once, host "
                f"memory available: {fmt_bytes(avail)}"
            )
