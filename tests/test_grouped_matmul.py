"""Grouped matmul (mixture-of-experts expert matmuls): each kernel in interpret mode, the XLA
paths (``jax.lax.ragged_dot``, the tiled loop) and the pure-jnp reference == a numpy loop of
per-group matmuls.

The numpy loop (float64, on the inputs as rounded to the test dtype) is the outside reference:
group e's rows ``[sum(sizes[:e]), sum(sizes[:e + 1]))`` times ``rhs[e - offset]`` when e is a
local group, zeros elsewhere. Cases: ragged sizes with empty groups (first, middle, last), rows
past the total, T not a multiple of the row tile and D / F not multiples of their tiles; all rows
in one group; local groups (expert parallelism) with a traced and an int ``group_offset``; f32
and bf16 (dtype-keyed tolerances).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import (
    VERIFIED_BACKENDS,
    BlockSizes,
    check_supported,
    gmm,
    gmm_reference,
    resolve_backend,
)

# JAXINFER_KERNEL_DEVICE=tpu|gpu (a device check) runs that backend's cases compiled on the device
# and skips the other's, as tests/test_ragged_paged_attention.py does.
DEVICE = os.environ.get("JAXINFER_KERNEL_DEVICE")
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# (T, D, F, block sizes) per implementation: T = 45 rows, not a multiple of the 16-row tile; D and
# F one tile and a part (TPU blocks of D / F are multiples of 128 lanes; Triton's powers of two).
SHAPES = {
    "tpu": (45, 136, 136, BlockSizes(16, 128, 128)),
    "gpu": (45, 40, 40, BlockSizes(16, 16, 16)),
    "xla": (45, 40, 40, None),
    "xla_tiled": (45, 40, 40, BlockSizes(8, 8, 8)),
    "reference": (45, 40, 40, None),
}
# (name, group_sizes, E_local, group_offset): sizes sum to at most T = 45.
CASES = {
    # empty first, middle and last groups; groups straddling 16-row tiles; 6 rows past the total
    "ragged": ([0, 3, 0, 20, 9, 7, 0], 7, 0),
    "one_group": ([0, 45, 0], 3, 0),
    # local groups 2..4 of 8 (traced offset): rows of groups 0-1 and 5-7 give 0
    "local_traced": ([3, 0, 20, 9, 7, 4, 1, 1], 3, "traced 2"),
    # the last local groups (int offset), ending on the total with rows past it
    "local_last": ([3, 5, 17, 0, 6, 9], 2, 4),
}


def numpy_gmm(lhs, rhs, sizes, offset):
    """float64 loop of per-group matmuls: the outside reference."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for e, size in enumerate(sizes):
        if offset <= e < offset + rhs.shape[0]:
            out[start : start + size] = lhs[start : start + size] @ rhs[e - offset]
        start += size
    return out


def interpret_for(impl):
    if impl not in ("tpu", "gpu"):
        return False
    if DEVICE is None:
        return True
    if impl != DEVICE:
        pytest.skip(f"device run on {DEVICE}")
    return False


def run_case(impl, case, dtype):
    sizes, e_local, offset = CASES[case]
    t, d, f, bs = SHAPES[impl]
    interpret = interpret_for(impl)
    rng = np.random.default_rng(len(sizes) * 100 + e_local)
    lhs = jnp.asarray(rng.standard_normal((t, d)), dtype)
    rhs = jnp.asarray(rng.standard_normal((e_local, d, f)) / np.sqrt(d), dtype)
    traced = isinstance(offset, str)
    off = int(offset.split()[-1]) if traced else offset
    if impl == "reference":
        call = lambda a, b, s, o: gmm_reference(a, b, s, o)  # noqa: E731
    else:
        kw = dict(block_sizes=bs, interpret=interpret)
        call = lambda a, b, s, o: gmm(a, b, s, o, backend=impl, **kw)  # noqa: E731
    sizes_j = jnp.asarray(sizes, jnp.int32)
    if traced:
        out = jax.jit(call)(lhs, rhs, sizes_j, jnp.int32(off))
    else:
        out = jax.jit(lambda a, b, s: call(a, b, s, off))(lhs, rhs, sizes_j)
    assert out.shape == (t, f) and out.dtype == dtype
    want = numpy_gmm(
        np.asarray(lhs.astype(jnp.float32)), np.asarray(rhs.astype(jnp.float32)), sizes, off
    )
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, **TOL[dtype])
    return out


IMPLS = ("tpu", "gpu", "xla", "xla_tiled", "reference")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_gmm_equals_numpy_loop_f32(impl, case):
    run_case(impl, case, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_gmm_equals_numpy_loop_bf16(impl):
    run_case(impl, "ragged", jnp.bfloat16)


@pytest.mark.parametrize("backend", ["auto", "tpu"])
def test_ragged_dot_is_the_all_local_contract(backend):
    """``gmm`` with every group local equals ``jax.lax.ragged_dot`` itself (the semantics the MoE
    model relies on), rows past the total included: "auto" with its default tiling (on CPU the
    tiled XLA loop) and the TPU kernel (interpreted, or compiled in a TPU device check)."""
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((45, 40)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((7, 40, 24)), jnp.float32)
    sizes = jnp.asarray(CASES["ragged"][0], jnp.int32)
    want = jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST)
    if backend == "auto":
        call = lambda a, b, s: gmm(a, b, s)  # noqa: E731
    else:
        kw = dict(backend="tpu", interpret=interpret_for("tpu"), block_sizes=BlockSizes(16, 40, 24))
        call = lambda a, b, s: gmm(a, b, s, **kw)  # noqa: E731
    got = jax.jit(call)(lhs, rhs, sizes)  # one compilation, not one per operation
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL[jnp.float32])


def test_auto_is_xla_on_cpu_and_kernels_need_their_platform():
    # CPU: the tiled loop (XLA:CPU's ragged_dot multiplies every row by every group's weights)
    assert resolve_backend("auto", platform="cpu") == "xla_tiled"
    for platform in ("tpu", "gpu"):  # a kernel only once its device check passed
        want = platform if platform in VERIFIED_BACKENDS else "xla"
        assert resolve_backend("auto", platform=platform) == want
    assert resolve_backend("tpu", interpret=True, platform="cpu") == "tpu"
    with pytest.raises(ValueError, match=r"backend='tpu' cannot run on jax backend 'cpu'.*'xla'"):
        resolve_backend("tpu", platform="cpu")
    with pytest.raises(ValueError, match=r"backend='gpu' cannot run on jax backend 'tpu'.*'tpu'"):
        resolve_backend("gpu", platform="tpu")
    with pytest.raises(ValueError, match=r"backend='triton' is not available; supported"):
        resolve_backend("triton")
    with pytest.raises(ValueError, match="interpret=True runs a Pallas kernel"):
        resolve_backend("xla", interpret=True)


def test_bad_inputs_and_tilings_raise():
    lhs, rhs = jnp.zeros((8, 16), jnp.float32), jnp.zeros((2, 16, 16), jnp.float32)
    sizes = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"lhs \[T, D\] and rhs \[E_local, D, F\]"):
        gmm(lhs, rhs[:, :8], sizes)
    with pytest.raises(ValueError, match="group_sizes must be an integer vector"):
        gmm(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="rhs holds 2 groups but group_sizes has 1"):
        gmm(lhs, rhs, sizes[:1])
    with pytest.raises(ValueError, match="lhs bfloat16 and rhs float32"):
        gmm(lhs.astype(jnp.bfloat16), rhs, sizes)
    with pytest.raises(ValueError, match="group_offset=1 with 2 local groups of 2"):
        gmm(lhs, rhs, sizes, 1)
    with pytest.raises(ValueError, match=r"pallas_tpu .* block_d=64 for a width of 136"):
        check_supported("tpu", 8, 136, 16, BlockSizes(8, 64, 16))
    with pytest.raises(ValueError, match=r"pallas_gpu .* block_t=24 \(supported: powers of two"):
        check_supported("gpu", 8, 16, 16, BlockSizes(24, 16, 16))
    with pytest.raises(ValueError, match="must be a multiple of 8"):
        BlockSizes(block_t=12)
