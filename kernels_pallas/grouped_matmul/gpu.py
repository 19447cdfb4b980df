"""Grouped matmul, GPU variant (Pallas on Triton): one program per (row tile, F tile).

Each local group's rows are cut into tiles of ``block_t`` rows starting at the group's first row,
so every tile belongs to one group and no two tiles share a row: programs run in any order and
store disjoint rows. The tile table (first row, end of the group's rows, group) is computed in
jnp before the launch; the grid has a static ``T tiles + E_local`` row-tile programs (the most
that ragged groups can need), and programs past the real count do nothing. A program loops over
the D tiles with ``lax.fori_loop``, accumulating in f32 registers, and stores only the rows of its
group (the row mask: a group's last tile reaches into the next group's rows). Rows no program
stores (other groups' rows, rows past ``sum(group_sizes)``) keep the zeros of the output's initial
value. ``lhs`` gets ``block_t`` zero rows appended so a tile's loads stay inside the array; D and
F are zero-padded to whole tiles when the blocks do not divide them (a copy of ``rhs``: pick
blocks that divide D and F to avoid it).

Learned from jax's ``pallas/ops/tpu/megablox/gmm.py`` (tile -> group metadata) and the Triton
grouped GEMM tutorial (one program per group tile); the code is our own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.grouped_matmul.block_sizes import BlockSizes
from kernels_pallas.grouped_matmul.metadata import local_group_bounds, tile_table


def _pow2(x: int) -> bool:
    return x > 0 and not x & (x - 1)


def check_supported(t: int, d: int, f: int, block_sizes: BlockSizes) -> None:
    """Raises ValueError naming the combination when the GPU kernel cannot tile it (Triton tile
    shapes are powers of two, ``tl.dot`` needs >= 16; offsets are int32)."""
    problems = [
        f"{field.name}={getattr(block_sizes, field.name)} (supported: powers of two >= 16)"
        for field in dataclasses.fields(block_sizes)
        if not _pow2(getattr(block_sizes, field.name)) or getattr(block_sizes, field.name) < 16
    ]
    if (t + block_sizes.block_t) * max(d, f) >= 2**31:
        problems.append(f"T={t}, D={d}, F={f} (supported: < 2**31 elements, int32 offsets)")
    if problems:
        raise ValueError("pallas_gpu grouped matmul cannot run " + "; ".join(problems))


def _kernel(
    first_row_ref,  # i32[num_tiles]
    row_end_ref,  # i32[num_tiles]
    group_ids_ref,  # i32[num_tiles]
    lhs_ref,  # [T + block_t, Dp]
    rhs_ref,  # [E_local, Dp, Fp]
    _,  # the output's initial zeros, aliased to out_ref
    out_ref,  # [T + block_t, Fp]
    *,
    block_t: int,
    block_d: int,
    block_f: int,
    num_d_tiles: int,
    precision,
):
    i, n = pl.program_id(0), pl.program_id(1)
    r0, r1, g = first_row_ref[i], row_end_ref[i], group_ids_ref[i]

    @pl.when(r0 < r1)
    def _():
        cols = pl.ds(n * block_f, block_f)

        def body(kd, acc):
            x = lhs_ref[pl.ds(r0, block_t), pl.ds(kd * block_d, block_d)]
            w = rhs_ref[g, pl.ds(kd * block_d, block_d), cols]
            return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, num_d_tiles, body, jnp.zeros((block_t, block_f), jnp.float32))
        mine = r0 + jnp.arange(block_t, dtype=jnp.int32) < r1  # this group's rows of the tile
        plgpu.store(
            out_ref.at[pl.ds(r0, block_t), cols],
            acc.astype(out_ref.dtype),
            mask=jnp.broadcast_to(mine[:, None], acc.shape),
        )


def gmm_gpu(
    lhs: jax.Array,  # [T, D]
    rhs: jax.Array,  # [E_local, D, F]
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array,  # i32[]
    *,
    block_sizes: BlockSizes,
    preferred_element_type,
    interpret: bool = False,
    num_warps: int = 4,
) -> jax.Array:
    """GPU grouped matmul; the contract is ``kernels_pallas.grouped_matmul.gmm``'s."""
    t, d = lhs.shape
    e_local, _, f = rhs.shape
    bt, bd, bf = block_sizes.block_t, block_sizes.block_d, block_sizes.block_f
    dp, fp = pl.cdiv(d, bd) * bd, pl.cdiv(f, bf) * bf
    lhs_p = jnp.pad(lhs, ((0, bt), (0, dp - d)))
    rhs_p = jnp.pad(rhs, ((0, 0), (0, dp - d), (0, fp - f))) if (dp, fp) != (d, f) else rhs
    bounds = local_group_bounds(group_sizes, group_offset, e_local, t)
    num_tiles = pl.cdiv(t, bt) + e_local
    first_row, row_end, group_ids, _ = tile_table(bounds, num_tiles=num_tiles, block_t=bt)
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, block_t=bt, block_d=bd, block_f=bf, num_d_tiles=dp // bd, precision=precision
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    zeros = jnp.zeros((t + bt, fp), preferred_element_type)
    args = (first_row, row_end, group_ids, lhs_p, rhs_p, zeros)
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, fp // bf),
        in_specs=[whole(a) for a in args],
        out_specs=whole(zeros),
        out_shape=jax.ShapeDtypeStruct(zeros.shape, zeros.dtype),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="grouped_matmul",
    )(*args)
    return out[:t, :f]
