"""Group metadata of a grouped matmul: which rows each local group owns, and those rows cut into
per-group tiles (shared by the kernels and the XLA paths)."""

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


def tile_table(
    bounds: jax.Array,  # i32[E_local + 1]
    *,
    num_tiles: int,
    block_t: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-group row tiles (the GPU kernel's and the tiled XLA path's): local group e's rows
    ``[bounds[e], bounds[e + 1])`` in ``ceil(size / block_t)`` tiles, tile j starting at
    ``bounds[e] + j * block_t``; the tiles of all groups number at most
    ``ceil(T / block_t) + E_local``.

    Returns:
        first_row: i32[num_tiles] first row of each tile.
        row_end: i32[num_tiles] end of the tile's group's rows (its rows are those below it);
            equal to ``first_row`` for tiles past the real count (nothing to do).
        group_ids: i32[num_tiles] local group of each tile.
        num_real: i32[] tiles with rows (they come first).
    """
    e_local = bounds.shape[0] - 1
    lo, hi = bounds[:-1], bounds[1:]
    tiles = (hi - lo + block_t - 1) // block_t  # i32[E_local]
    ends = jnp.cumsum(tiles)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    group_ids = jnp.minimum(jnp.searchsorted(ends, i, side="right"), e_local - 1).astype(jnp.int32)
    first_row = lo[group_ids] + (i - (ends - tiles)[group_ids]) * block_t
    real = i < ends[-1]
    first_row = jnp.where(real, first_row, 0).astype(jnp.int32)
    row_end = jnp.where(real, hi[group_ids], 0).astype(jnp.int32)
    return first_row, row_end, group_ids, ends[-1]
