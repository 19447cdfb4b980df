"""Group bounds of a grouped matmul: which rows each local group owns (shared by the kernels and
the XLA path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def local_group_bounds(
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array,  # i32[]
    num_local: int,
    num_rows: int,
) -> jax.Array:
    """i32[E_local + 1]: local group ``e`` (global group ``group_offset + e``) owns rows
    ``[bounds[e], bounds[e + 1])``. Ends are clamped to ``num_rows`` (rows past the array do not
    exist); local groups past the last global group own no rows.
    """
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)  # i32[E]
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # i32[E + 1]
    idx = group_offset + jnp.arange(num_local + 1, dtype=jnp.int32)
    return bounds[jnp.clip(idx, 0, group_sizes.shape[0])]
