"""The grouped matmul of int8 expert weights (mixture of experts), w8a16 and w8a8.

``y[m] = x[m] . dequant(w[g(m)])`` for rows ``x`` [M, K] sorted by group and an int8 ``QTensor``
``w`` (``values i8[G, N, K]``, ``scales f32[G, N]``, one scale per expert and output channel),
computed as a float grouped matmul of the int8 values (cast to the activation dtype, exact: every
integer in [-127, 127] is exact in bfloat16 and float16) followed by each row's own expert's
scales on its output columns: ``y[m, n] = (x[m] . q[g(m), n]) * s[g(m), n]``, the same product
as with the dequantized weight (per-output-channel scales factor out of the contraction).

w8a8 quantizes each row first (``matmul.quantize_rows``: ``s_x = max|x_m| / 127``) and runs the
grouped matmul on the integer values in float32, rescaled by ``s_x[m] * s[g(m), n]``: the
numerics of w8a8's integer dot (exact while ``127 * 127 * K < 2**24``, beyond that float32
rounding of the sum), without an integer grouped-matmul kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.quant.matmul import quantize_rows
from jaxinfer.quant.tensor import QTensor


def grouped_qmatmul(
    lhs: jax.Array,
    w: QTensor,
    group_sizes: jax.Array,
    row_groups: jax.Array,
    matmul: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """Rows of ``lhs`` [M, K] times their group's int8 weight, [M, N] in ``lhs``' dtype.

    Args:
        lhs: [M, K] rows sorted by group (float).
        w: ``QTensor`` with ``values i8[G, N, K]`` (one input axis) and ``scales f32[G, N]``.
        group_sizes: i32[G], rows of each group; sum(group_sizes) == M.
        row_groups: i32[M], the group of each row (consistent with ``group_sizes``).
        matmul: the float grouped matmul ``(lhs [M, K], rhs [G, K, N], group_sizes) -> [M, N]``
            (``models.moe.grouped_matmul`` with its impl), accumulating in float32.

    Raises:
        ValueError: ``w`` not a one-input-axis ``QTensor`` ``[G, N, K]`` matching ``lhs``.
    """
    if not isinstance(w, QTensor) or w.num_in != 1 or w.values.ndim != 3:
        raise ValueError("grouped_qmatmul needs a QTensor with values i8[G, N, K], one input axis")
    if w.values.shape[-1] != lhs.shape[-1]:
        raise ValueError(
            f"grouped_qmatmul: rows [M, K] = {lhs.shape} do not match values {w.values.shape}"
        )
    rhs = jnp.swapaxes(w.values, -1, -2)  # i8[G, K, N]
    scales = w.scales[row_groups]  # f32[M, N], each row's own expert's
    if w.act == "int8":  # w8a8
        xq, sx = quantize_rows(lhs)
        acc = matmul(xq.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes)
        out = acc.astype(jnp.float32) * scales * sx
    else:  # w8a16
        acc = matmul(lhs, rhs.astype(lhs.dtype), group_sizes)
        out = acc.astype(jnp.float32) * scales
    return out.astype(lhs.dtype)
