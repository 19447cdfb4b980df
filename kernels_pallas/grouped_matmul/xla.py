"""Grouped matmul in plain XLA, with local groups for expert parallelism: ``jax.lax.ragged_dot``
(``backend="xla"``) and a loop over per-group row tiles (``backend="xla_tiled"``).

On XLA's CPU backend ``ragged_dot`` is expanded to a dense matmul against every group's weights
(the rows spread into a ``[T, E * D]`` masked copy), E times the useful FLOPs; the tiled loop
multiplies each tile of ``block_t`` rows by its own group's weights only (at most
``ceil(T / block_t) + E_local`` tiles, the loop running only over tiles with rows), so it is what
``backend="auto"`` runs on CPU (figures: docs/kernels.md, ``scripts/bench_grouped_matmul.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul.metadata import local_group_bounds, tile_table


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


def default_tiled_block_t(t: int, e_local: int) -> int:
    """Rows per tile of the tiled path: half the mean rows per group, as a power of two in
    ``[8, 32]`` (smaller tiles waste less on each group's last tile; larger ones loop less)."""
    mean = max(1, -(-t // e_local))
    return min(32, max(8, (1 << (mean - 1).bit_length()) // 2))


def gmm_xla_tiled(
    lhs: jax.Array,  # [T, D]
    rhs: jax.Array,  # [E_local, D, F]
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array,  # i32[]
    *,
    block_t: int,
    preferred_element_type,
) -> jax.Array:
    """A ``lax.fori_loop`` over the per-group row tiles (``tile_table``), each one dot of
    ``block_t`` rows by its group's ``[D, F]`` weights in f32, its group's rows written into the
    output (the row mask: a group's last tile reaches into the next rows); the contract is
    ``gmm``'s. Rows no tile writes (other groups', past the total) stay 0."""
    t, d = lhs.shape
    e_local, _, f = rhs.shape
    bt = block_t
    bounds = local_group_bounds(group_sizes, group_offset, e_local, t)
    first_row, row_end, group_ids, num_real = tile_table(
        bounds, num_tiles=-(-t // bt) + e_local, block_t=bt
    )
    lhs_p = jnp.pad(lhs, ((0, bt), (0, 0)))  # a tile's rows stay inside the array
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    # XLA:CPU computes 16-bit float dots in f32, and its float normalization widens a loop's
    # 16-bit operands before the loop: all of rhs converted on every call (bf16, 8 tokens: 68 ms
    # against 4 ms in f32). Carried into the loop as raw bits, only each tile's operands widen.
    dtype = lhs.dtype
    narrow = dtype.itemsize == 2
    bits = (lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)) if narrow else (lambda a: a)
    unbits = (lambda a: jax.lax.bitcast_convert_type(a, dtype)) if narrow else (lambda a: a)
    lhs_p, rhs_b = bits(lhs_p), bits(rhs)

    def tile(i, out):  # out: [T + block_t, F]
        r0, r1 = first_row[i], row_end[i]
        x = unbits(jax.lax.dynamic_slice_in_dim(lhs_p, r0, bt))  # [block_t, D]
        w = unbits(jax.lax.dynamic_index_in_dim(rhs_b, group_ids[i], keepdims=False))  # [D, F]
        y = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)
        mine = (r0 + jnp.arange(bt, dtype=jnp.int32) < r1)[:, None]  # this group's rows
        old = jax.lax.dynamic_slice_in_dim(out, r0, bt)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(mine, y.astype(out.dtype), old), r0, 0
        )

    out = jax.lax.fori_loop(0, num_real, tile, jnp.zeros((t + bt, f), preferred_element_type))
    return out[:t]
