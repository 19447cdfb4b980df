"""Grouped matmul kernels (Pallas): the expert matmuls of a mixture-of-experts layer in one call.

``lhs`` rows are sorted by group (expert): group e owns the next ``group_sizes[e]`` rows, and
row t's output is ``lhs[t] @ rhs[e]``, as ``jax.lax.ragged_dot``. With expert parallelism a
device holds ``E_local`` of the E experts' weights (``rhs``) from ``group_offset`` on, and rows
of the other experts give 0 (megablox's ``gmm`` with ``group_offset``).

Shapes: T rows (token copies, each token once per chosen expert), E groups (experts), D the
contracted width, F the output width (an up projection's model width and MLP width; the down
projection swaps them).

Variants: ``tpu.py`` (Mosaic, tile -> group table as scalar prefetch), ``gpu.py`` (Triton, one
program per group row tile), ``xla.py`` (``jax.lax.ragged_dot``, and a loop over per-group row
tiles, CPU's "auto"); ``reference.py`` is the pure-jnp reference; ``metadata.py`` the group
bounds and tile tables; ``block_sizes.py`` the tiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul.block_sizes import BlockSizes, default_block_sizes
from kernels_pallas.grouped_matmul.reference import gmm_reference

BACKENDS = ("auto", "xla", "xla_tiled", "reference", "tpu", "gpu")
KERNEL_BACKENDS = ("tpu", "gpu")
# Backends whose kernel has passed a device check un-interpreted (none yet: no TPU or GPU has run
# them); "auto" picks the kernel only there. Add a backend after its device check passes.
VERIFIED_BACKENDS: tuple[str, ...] = ()
# "auto" elsewhere: on CPU the tiled XLA loop (XLA:CPU expands ragged_dot to a dense matmul over
# every group: docs/kernels.md has the figures), on other platforms ragged_dot.
AUTO_CPU = "xla_tiled"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

__all__ = [
    "BACKENDS",
    "AUTO_CPU",
    "KERNEL_BACKENDS",
    "VERIFIED_BACKENDS",
    "BlockSizes",
    "check_supported",
    "default_block_sizes",
    "gmm",
    "gmm_reference",
    "resolve_backend",
]


def resolve_backend(backend: str, *, interpret: bool = False, platform: str | None = None) -> str:
    """The implementation ``gmm`` runs for ``backend`` on ``platform`` (default: jax's backend):
    "xla", "xla_tiled", "reference", "tpu" or "gpu".

    "auto": the platform's kernel where verified (``VERIFIED_BACKENDS``), else "xla_tiled" on
    CPU (``AUTO_CPU``) and "xla" (``jax.lax.ragged_dot``) elsewhere. "tpu" / "gpu": that
    kernel, on its own platform, or on any platform with ``interpret=True``.

    Raises:
        ValueError: an unknown backend; a kernel asked on another platform without
            ``interpret``; ``interpret=True`` with a backend that is not a kernel.
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"grouped matmul backend={backend!r} is not available; supported: {BACKENDS}"
        )
    platform = platform or jax.default_backend()
    if interpret and backend not in KERNEL_BACKENDS:
        raise ValueError(
            f"grouped matmul interpret=True runs a Pallas kernel: use backend='tpu' or 'gpu' "
            f"(got backend={backend!r})"
        )
    if backend == "auto":
        if platform in VERIFIED_BACKENDS:
            return platform
        return AUTO_CPU if platform == "cpu" else "xla"
    if backend in KERNEL_BACKENDS and not interpret and platform != backend:
        raise ValueError(
            f"grouped matmul backend={backend!r} cannot run on jax backend {platform!r}; "
            f"here run backend='auto', 'xla', 'xla_tiled' or 'reference'"
            + (f", or '{platform}'" if platform in KERNEL_BACKENDS else "")
            + f", or backend={backend!r} with interpret=True (tests)"
        )
    return backend


def check_supported(
    backend: str, t: int, d: int, f: int, block_sizes: BlockSizes | None = None
) -> BlockSizes:
    """Static checks of a kernel backend ("tpu" / "gpu") for rows ``t``, contracted width ``d``,
    output width ``f``. Returns the block sizes it would use (``block_sizes`` or the default).

    Raises:
        ValueError: naming the combination the kernel cannot tile and what it supports.
    """
    bs = block_sizes or default_block_sizes(t, d, f, backend)
    if backend == "tpu":
        from kernels_pallas.grouped_matmul import tpu

        tpu.check_supported(t, d, f, bs)
    elif backend == "gpu":
        from kernels_pallas.grouped_matmul import gpu

        gpu.check_supported(t, d, f, bs)
    else:
        raise ValueError(
            f"backend={backend!r} is not a kernel backend; supported: {KERNEL_BACKENDS}"
        )
    return bs


def _check_inputs(lhs, rhs, group_sizes, group_offset) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"grouped matmul needs lhs [T, D] and rhs [E_local, D, F]; got lhs "
            f"{list(lhs.shape)}, rhs {list(rhs.shape)}"
        )
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be an integer vector [E]; got {group_sizes.dtype}"
            f"{list(group_sizes.shape)}"
        )
    if rhs.shape[0] > group_sizes.shape[0] or rhs.shape[0] == 0:
        raise ValueError(
            f"rhs holds {rhs.shape[0]} groups but group_sizes has {group_sizes.shape[0]}: "
            "rhs must hold 1..E groups (E_local <= E)"
        )
    if lhs.dtype != rhs.dtype or lhs.dtype not in _DTYPES:
        raise ValueError(
            f"lhs {lhs.dtype} and rhs {rhs.dtype}: supported are equal dtypes among "
            f"{[str(x) for x in _DTYPES]}"
        )
    if (
        isinstance(group_offset, int)
        and not 0 <= group_offset <= group_sizes.shape[0] - rhs.shape[0]
    ):
        raise ValueError(
            f"group_offset={group_offset} with {rhs.shape[0]} local groups of "
            f"{group_sizes.shape[0]}: supported 0..{group_sizes.shape[0] - rhs.shape[0]}"
        )


def gmm(
    lhs: jax.Array,  # [T, D]
    rhs: jax.Array,  # [E_local, D, F]
    group_sizes: jax.Array,  # i32[E]
    group_offset: jax.Array | int = 0,  # i32[]
    *,
    block_sizes: BlockSizes | None = None,
    backend: str = "auto",
    interpret: bool = False,
    preferred_element_type=None,
) -> jax.Array:
    """Grouped matmul: ``out[t] = lhs[t] @ rhs[e - group_offset]`` for row t of group e.

    Args:
        lhs: f32/bf16/f16[T, D] rows sorted by group: group e owns rows
            ``[sum(group_sizes[:e]), sum(group_sizes[:e + 1]))``.
        rhs: [E_local, D, F] weights of groups ``group_offset .. group_offset + E_local - 1``,
            the same dtype as ``lhs``.
        group_sizes: int[E] rows per group (all E groups, local or not); their sum is at most T
            (rows at or past it give 0; a sum past T is cut at T).
        group_offset: i32[] (or int) first local group; rows of groups outside
            ``[group_offset, group_offset + E_local)`` give 0. An int is checked against
            ``0..E - E_local``; a traced value is taken as given (a value outside gives
            unspecified rows).
        block_sizes: kernel tiling; None for ``default_block_sizes``. "xla_tiled" reads only
            ``block_t`` (default ``default_tiled_block_t``).
        backend: "auto" (``resolve_backend``: the platform's kernel where verified, else the
            tiled XLA loop on CPU and ``ragged_dot`` elsewhere), "xla" (``jax.lax.ragged_dot``),
            "xla_tiled" (a loop over per-group row tiles), "reference" (``gmm_reference``),
            "tpu" or "gpu" (the Pallas kernels).
        interpret: run the kernel's semantics on CPU (TPU: ``pltpu.InterpretParams``); only with
            backend "tpu" or "gpu".
        preferred_element_type: output dtype (default: ``lhs.dtype``); the kernels accumulate
            in f32 whatever it is.

    Returns:
        [T, F] of ``preferred_element_type``; equal to ``jax.lax.ragged_dot(lhs, rhs,
        group_sizes)`` when all groups are local.

    Raises:
        ValueError: bad shapes or dtypes (naming the tensor), an int ``group_offset`` out of
            range, an unknown backend, a kernel asked on another platform without
            ``interpret``, or tiling a kernel cannot run (``check_supported``).
    """
    _check_inputs(lhs, rhs, group_sizes, group_offset)
    impl = resolve_backend(backend, interpret=interpret)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "reference":
        return gmm_reference(lhs, rhs, group_sizes, group_offset, preferred_element_type=out_dtype)
    if impl == "xla":
        from kernels_pallas.grouped_matmul.xla import gmm_xla

        return gmm_xla(lhs, rhs, group_sizes, group_offset, preferred_element_type=out_dtype)
    t, d = lhs.shape
    if impl == "xla_tiled":
        from kernels_pallas.grouped_matmul.xla import default_tiled_block_t, gmm_xla_tiled

        bt = block_sizes.block_t if block_sizes else default_tiled_block_t(t, rhs.shape[0])
        offset = jnp.asarray(group_offset, jnp.int32)
        return gmm_xla_tiled(
            lhs, rhs, group_sizes, offset, block_t=bt, preferred_element_type=out_dtype
        )
    bs = check_supported(impl, t, d, rhs.shape[2], block_sizes)
    offset = jnp.asarray(group_offset, jnp.int32)
    kw = dict(block_sizes=bs, preferred_element_type=out_dtype, interpret=interpret)
    if impl == "tpu":
        from kernels_pallas.grouped_matmul.tpu import gmm_tpu

        return gmm_tpu(lhs, rhs, group_sizes, offset, **kw)
    from kernels_pallas.grouped_matmul.gpu import gmm_gpu

    return gmm_gpu(lhs, rhs, group_sizes, offset, **kw)
