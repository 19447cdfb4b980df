"""Pure-jnp reference of the grouped matmul, on the kernels' own inputs.

Written for plain readability, independently of the kernels: each row finds its group by a
search in the cumulative group sizes, gathers that group's weight matrix and multiplies in f32.
Memory is O(T * D * F): a test reference, not a kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm_reference(
    lhs: jax.Array,  # [T, D]
    rhs: jax.Array,  # [E_local, D, F]
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array | int = 0,  # i32[]
    *,
    preferred_element_type=None,
) -> jax.Array:
    """[T, F]; the same contract as ``kernels_pallas.grouped_matmul.gmm``.

    Row t belongs to group ``e`` with ``sum(group_sizes[:e]) <= t < sum(group_sizes[:e + 1])``;
    its output is ``lhs[t] @ rhs[e - group_offset]`` when ``group_offset <= e < group_offset +
    E_local``, else 0 (as are rows at or past ``sum(group_sizes)``).
    """
    t = lhs.shape[0]
    e_local = rhs.shape[0]
    out_dtype = preferred_element_type or lhs.dtype
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # i32[E]
    row = jnp.arange(t, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right").astype(jnp.int32)  # i32[T]; E past the end
    local = group - jnp.asarray(group_offset, jnp.int32)
    owned = (local >= 0) & (local < e_local) & (group < group_sizes.shape[0])  # bool[T]
    w = rhs[jnp.clip(local, 0, e_local - 1)].astype(jnp.float32)  # f32[T, D, F]
    out = jnp.einsum("TD,TDF->TF", lhs.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(owned[:, None], out, 0.0).astype(out_dtype)
