"""Grouped matmul through XLA's ``jax.lax.ragged_dot`` (the path ``backend="auto"`` takes where
no kernel is verified, the CPU included), with local groups for expert parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul.metadata import local_group_bounds


def gmm_xla(
    lhs: jax.Array,  # [T, D]
    rhs: jax.Array,  # [E_local, D, F]
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array,  # i32[]
    *,
    preferred_element_type,
) -> jax.Array:
    """``jax.lax.ragged_dot`` on the local groups; the contract is ``gmm``'s.

    With all groups local (``E_local == E`` and offset 0) this is one ``ragged_dot``. Otherwise
    the local groups' rows are rolled to the front, multiplied with the local group sizes (rows
    past their total give 0 in ``ragged_dot``), rolled back and every row outside the local
    groups set to 0.
    """
    t, e_local = lhs.shape[0], rhs.shape[0]
    if e_local == group_sizes.shape[0] and isinstance(group_offset, int) and group_offset == 0:
        return jax.lax.ragged_dot(
            lhs, rhs, group_sizes, preferred_element_type=preferred_element_type
        )
    bounds = local_group_bounds(group_sizes, jnp.asarray(group_offset, jnp.int32), e_local, t)
    first, last = bounds[0], bounds[-1]
    out = jax.lax.ragged_dot(
        jnp.roll(lhs, -first, axis=0),
        rhs,
        jnp.diff(bounds),
        preferred_element_type=preferred_element_type,
    )
    out = jnp.roll(out, first, axis=0)
    row = jnp.arange(t, dtype=jnp.int32)[:, None]
    return jnp.where((row >= first) & (row < last), out, jnp.zeros((), out.dtype))
