"""Grouped matmul, TPU variant (Mosaic): a tile -> group table as scalar prefetch.

Rows are cut into aligned tiles of ``block_t``; a tile whose rows belong to two or more local
groups is visited once per group, consecutively (so its output block stays in VMEM between
visits), and each visit stores only its group's rows (the row mask) over what the earlier visits
stored. Grid ``(F tiles, visits, D tiles)``: the visit axis reads ``group_ids`` / ``row_tile_ids``
from SMEM in the index maps, so each step's DMAs fetch the visit's row tile of ``lhs`` and its
group's ``[block_d, block_f]`` tile of ``rhs``; the D axis accumulates in an f32 VMEM scratch and
stores at its last step. The visit axis has a static length (at most ``T tiles + E_local - 1``
visits are needed); steps past the real count repeat the last visit's block indices (no DMA) and
do nothing. A last D tile past D is masked to zero in both operands; rows outside the local
groups (other experts' rows, rows past ``sum(group_sizes)``) are set to zero after the call.

Learned from jax's ``pallas/ops/tpu/megablox/gmm.py`` (group metadata, consecutive revisits of a
straddling tile, the store mask); the code is our own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.grouped_matmul.block_sizes import BlockSizes
from kernels_pallas.grouped_matmul.metadata import local_group_bounds

_LANES = 128


def check_supported(t: int, d: int, f: int, block_sizes: BlockSizes) -> None:
    """Raises ValueError naming the combination when the TPU kernel cannot tile it: Mosaic
    blocks' last dimension must be a multiple of the 128 lanes or the whole dimension."""
    problems = []
    for name, block, dim in (
        ("block_d", block_sizes.block_d, d),
        ("block_f", block_sizes.block_f, f),
    ):
        if block % _LANES and block != dim:
            problems.append(
                f"{name}={block} for a width of {dim} (supported: a multiple of {_LANES}, or "
                "the whole width)"
            )
    if problems:
        raise ValueError("pallas_tpu grouped matmul cannot run " + "; ".join(problems))


def group_metadata(
    bounds: jax.Array,  # i32[E_local + 1]
    *,
    num_row_tiles: int,
    block_t: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The visit table of the TPU kernel.

    Local group e owns rows ``[bounds[e], bounds[e + 1])`` and is visited on the row tiles from
    ``bounds[e] // block_t`` to ``(bounds[e + 1] - 1) // block_t`` (none when empty). Visits
    are numbered group by group, so each group's tiles, and the tiles overall, come in
    non-decreasing order.

    Returns:
        group_ids: i32[V] local group of visit v, V = ``num_row_tiles + E_local - 1``.
        row_tile_ids: i32[V] row tile of visit v.
        num_visits: i32[1] visits that compute; later entries repeat the last one's.
    """
    e_local = bounds.shape[0] - 1
    lo, hi = bounds[:-1], bounds[1:]
    first_tile = lo // block_t
    tiles = jnp.where(hi > lo, (hi - 1) // block_t - first_tile + 1, 0)  # i32[E_local]
    ends = jnp.cumsum(tiles)  # visits up to and including each group
    num_visits = ends[-1]
    v = jnp.arange(num_row_tiles + e_local - 1, dtype=jnp.int32)
    v = jnp.minimum(v, jnp.maximum(num_visits - 1, 0))  # past the count: repeat the last visit
    group_ids = jnp.minimum(jnp.searchsorted(ends, v, side="right"), e_local - 1).astype(jnp.int32)
    row_tile_ids = first_tile[group_ids] + v - (ends - tiles)[group_ids]
    row_tile_ids = jnp.clip(row_tile_ids, 0, num_row_tiles - 1).astype(jnp.int32)
    return group_ids, row_tile_ids, num_visits.reshape(1).astype(jnp.int32)


def _kernel(
    group_ids_ref,  # i32[V] (SMEM)
    row_tile_ids_ref,  # i32[V] (SMEM)
    bounds_ref,  # i32[E_local + 1] (SMEM)
    num_visits_ref,  # i32[1] (SMEM)
    lhs_ref,  # [block_t, block_d]
    rhs_ref,  # [block_d, block_f]
    out_ref,  # [block_t, block_f]
    acc_ref,  # f32[block_t, block_f] (VMEM scratch)
    *,
    d: int,
    block_t: int,
    block_d: int,
    num_d_tiles: int,
    precision,
):
    visit, kd = pl.program_id(1), pl.program_id(2)
    active = visit < num_visits_ref[0]

    @pl.when(kd == 0)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(active)
    def _accumulate():
        x, w = lhs_ref[...], rhs_ref[...]
        if d % block_d:  # the last D tile reaches past D: zero both operands there
            col = kd * block_d + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
            x = jnp.where(col < d, x, jnp.zeros((), x.dtype))
            row = kd * block_d + jax.lax.broadcasted_iota(jnp.int32, w.shape, 0)
            w = jnp.where(row < d, w, jnp.zeros((), w.dtype))
        acc_ref[...] += jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    @pl.when(active & (kd == num_d_tiles - 1))
    def _store():
        g = group_ids_ref[visit]
        lo, hi = bounds_ref[g], bounds_ref[g + 1]
        row = row_tile_ids_ref[visit] * block_t + jax.lax.broadcasted_iota(
            jnp.int32, out_ref.shape, 0
        )
        mine = (row >= lo) & (row < hi)  # this visit's group's rows of the tile
        out_ref[...] = jnp.where(mine, acc_ref[...], out_ref[...].astype(jnp.float32)).astype(
            out_ref.dtype
        )


def gmm_tpu(
    lhs: jax.Array,  # [T, D]
    rhs: jax.Array,  # [E_local, D, F]
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array,  # i32[]
    *,
    block_sizes: BlockSizes,
    preferred_element_type,
    interpret=False,
) -> jax.Array:
    """TPU grouped matmul; the contract is ``kernels_pallas.grouped_matmul.gmm``'s.

    ``interpret``: False, or ``pltpu.InterpretParams()`` (True is taken as the latter) to run the
    Mosaic semantics on CPU.
    """
    if interpret is True:
        interpret = pltpu.InterpretParams()
    t, d = lhs.shape
    e_local, _, f = rhs.shape
    bt = block_sizes.block_t
    bd, bf = min(block_sizes.block_d, d), min(block_sizes.block_f, f)
    num_row_tiles, num_d_tiles, num_f_tiles = pl.cdiv(t, bt), pl.cdiv(d, bd), pl.cdiv(f, bf)
    tp = num_row_tiles * bt
    lhs_p = jnp.pad(lhs, ((0, tp - t), (0, 0))) if tp != t else lhs  # rows: whole tiles
    bounds = local_group_bounds(group_sizes, group_offset, e_local, t)
    group_ids, row_tile_ids, num_visits = group_metadata(
        bounds, num_row_tiles=num_row_tiles, block_t=bt
    )
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, d=d, block_t=bt, block_d=bd, num_d_tiles=num_d_tiles, precision=precision
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tp, f), preferred_element_type),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_f_tiles, group_ids.shape[0], num_d_tiles),
            in_specs=[
                pl.BlockSpec((bt, bd), lambda n, v, kd, gid, rt, *_: (rt[v], kd)),
                pl.BlockSpec((None, bd, bf), lambda n, v, kd, gid, rt, *_: (gid[v], kd, n)),
            ],
            out_specs=pl.BlockSpec((bt, bf), lambda n, v, kd, gid, rt, *_: (rt[v], n)),
            scratch_shapes=[pltpu.VMEM((bt, bf), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        name="grouped_matmul",
    )(group_ids, row_tile_ids, bounds, num_visits, lhs_p, rhs)[:t]
    # Rows no visit stored (other groups' rows, rows past the total, unvisited tiles) hold
    # whatever the output buffer held: zero them.
    row = jnp.arange(t, dtype=jnp.int32)[:, None]
    return jnp.where((row >= bounds[0]) & (row < bounds[-1]), out, jnp.zeros((), out.dtype))
