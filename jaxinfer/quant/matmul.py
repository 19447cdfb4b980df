"""The quantized projection behind ``model.linear``: w8a16 and w8a8 matmuls, one formulation per
backend and batch regime.

Formulations of ``y[R, O] = x[R, I] . q[O, I] * s[O]`` (R rows = flattened T or B axis). Which
one runs where was chosen by timing whole forward steps (``python scripts/bench_quant.py
--formulations`` and ``scripts/bench_quant_batch.py``; the figures are in docs/performance.md,
"Design measurements"):

- ``"int_dot"``: w8a8's integer ``dot_general`` (int8 x int8, ``preferred_element_type=int32``),
  rescaled by ``s_x[r] * s[o]`` -- the AQT scheme; the TPU/GPU path (MXU / tensor-core int8),
  and on XLA CPU the one dot that reads the int8 weight in place.
- ``"int_dot2"`` (w8a16 on CPU): x written as two int8 digits, ``x = x1 s1 + x2 s2 + e`` with
  ``s2 = s1 / 254``, both digits stacked as 2R rows of one integer dot: the weight is read once,
  as int8, and the activations keep ~16 bits (relative error < 1.6e-5, finer than bfloat16).
- ``"dot"`` (w8a16 on TPU/GPU): ``x . q.astype(x.dtype)``, exact; XLA TPU/GPU fuse the convert
  into the matmul's operand load. On XLA CPU it writes a float copy of the weight every step.
- ``"reduce"`` / ``"reduce_or"`` / ``"reduce_ro"``: a fused convert-multiply-reduce
  (``sum(x[r] * q.astype(f32), axis=-1)``; per row, output [O, R], output [R, O]). A single
  matrix-vector row reduction beats the float32 dot in isolation, but in the whole model XLA
  CPU's reduction loops lost to every dot, so they remain only as candidates for benchmarks.

w8a8 activations are quantized per row (token): ``s_x = max|x_r| / 127``, ``x_q = round(x / s_x)``.

Batch sizes (the engine's CPU layout, where wq/wk/wv and w_gate/w_up int8 weights are fused
into one ``QTensor`` each, ``qlinear_flat``): neither mode writes a float copy of the weight on
CPU. w8a8's integer dot runs as an XLA CPU "ynn" (YNNPACK) fusion, the fastest mode at every row
count; a single-row int8 dot there is much slower than a two-row one, hence the duplicated row.
w8a16's ``int_dot2`` costs two int8 products per product, and XLA CPU's int8 GEMM is not much
faster than its f32 GEMM once compute-bound, so at large row counts w8a16 is a little slower than
float32. The dequantize-then-f32-GEMM alternative (``"dot"``) is no way out: its convert writes
the whole float weight every step, and bfloat16 copies would too; keeping w8a16's ~16-bit
activations on CPU needs the two digits.

Error bounds (tests/test_quant.py checks them), ``w = q * s`` the dequantized weight:
- w8a16 ``"dot"`` and the reductions: ``y == x @ w`` up to float32 rounding of the sum (the weight
  error ``|W - w| <= s/2`` is the quantization's, not the matmul's); ``"int_dot2"``:
  ``|y - x @ w| <= s1[r] / 508 * s[o] * sum_i |q[o, i]|`` plus float rounding.
- w8a8: ``|y[r, o] - (x @ w)[r, o]| <= s_x[r] / 2 * s[o] * sum_i |q[o, i]|`` plus float rounding,
  since each ``|x[r, i] - x_q[r, i] s_x[r]| <= s_x[r] / 2``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.quant.tensor import QTensor

FORMULATIONS = ("reduce", "reduce_or", "reduce_ro", "dot", "int_dot", "int_dot2")


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric int8: (i8[R, I] values, f32[R, 1] scales) with ``x ~= values * scales``."""
    xf = x.astype(jnp.float32)
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127.0
    xq = jnp.clip(jnp.round(xf / jnp.where(sx == 0, 1.0, sx)), -127, 127)
    return xq.astype(jnp.int8), sx


def choose_formulation(act: str, rows: int, backend: str | None = None) -> str:
    """The formulation for ``rows`` rows (static) on ``backend`` (default: jax's); see the table
    in the module docstring. ``rows`` is kept in the signature for per-regime choices."""
    del rows  # the same choice won at 1-512 rows on CPU (docs/performance.md)
    backend = backend or jax.default_backend()
    if act == "int8":
        return "int_dot"
    return "int_dot2" if backend == "cpu" else "dot"


def qmatmul_2d(
    x: jax.Array,  # [R, I] float
    values: jax.Array,  # i8[O, I]
    scales: jax.Array,  # f32[O]
    act: str,
    formulation: str | None = None,
) -> jax.Array:
    """``x . dequant(values, scales)^T`` as f32[R, O]; see the module docstring for the modes."""
    rows = x.shape[0]
    formulation = formulation or choose_formulation(act, rows)
    if act == "int8":
        xq, sx = quantize_rows(x)
    else:
        xq, sx = x.astype(jnp.float32), None
    if formulation.startswith("reduce"):
        # Materialise x first: otherwise XLA fuses x's producer (norm, SiLU) into the reduction
        # and recomputes it for every weight element.
        xq = jax.lax.optimization_barrier(xq.astype(jnp.float32))
    if formulation == "reduce":
        wf = values.astype(jnp.float32)
        xf = xq
        # One 2-D row reduction per row: a rank-3 broadcast-reduce fuses worse on XLA CPU.
        acc = jnp.stack([jnp.sum(xf[r][None, :] * wf, axis=-1) for r in range(rows)])
    elif formulation == "reduce_or":
        # Output [O, R]: the R outputs of one weight row are adjacent, so the row is read once.
        wf = values.astype(jnp.float32)
        acc = jnp.sum(wf[:, None, :] * xq.astype(jnp.float32)[None, :, :], axis=-1).T
    elif formulation == "reduce_ro":
        wf = values.astype(jnp.float32)
        acc = jnp.sum(xq.astype(jnp.float32)[:, None, :] * wf[None, :, :], axis=-1)
    elif formulation == "dot":
        if act == "int8":
            raise ValueError("formulation 'dot' is for w8a16; w8a8 uses 'int_dot' or 'reduce'")
        acc = jax.lax.dot_general(
            x, values.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    elif formulation == "int_dot2":
        if act == "int8":
            raise ValueError("formulation 'int_dot2' is for w8a16 (float activations)")
        # Two int8 digits of x: x = x1 s1 + x2 s2 + e, s2 = s1 / 254, |e| <= s2 / 2; both digits
        # go through one integer dot (2R rows), which reads the int8 weight once.
        x1, s1 = quantize_rows(x)
        s2 = s1 / 254.0
        r = x.astype(jnp.float32) - x1.astype(jnp.float32) * s1
        x2 = jnp.clip(jnp.round(r / jnp.where(s2 == 0, 1.0, s2)), -127, 127).astype(jnp.int8)
        acc2 = jax.lax.dot_general(
            jnp.concatenate([x1, x2], axis=0),
            values,
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.int32,
        ).astype(jnp.float32)
        acc = acc2[:rows] * s1 + acc2[rows:] * s2
    elif formulation == "int_dot":
        if act != "int8":
            raise ValueError("formulation 'int_dot' is for w8a8 (int8 activations)")
        # XLA CPU's int8 dot of a single row is several times slower than of two (YNNPACK
        # fusions; docs/performance.md): a batch-1 decode step dots its row twice.
        x2 = jnp.concatenate([xq, xq]) if rows == 1 and jax.default_backend() == "cpu" else xq
        acc = jax.lax.dot_general(
            x2, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
        )[:rows].astype(jnp.float32)
    else:
        raise ValueError(f"formulation {formulation!r}; supported: {FORMULATIONS}")
    acc = acc * scales[None, :]
    return acc * sx if sx is not None else acc


def _parse(spec: str) -> tuple[str, str, str]:
    lhs, out = spec.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
    return xs, ws, out


def qlinear(x: jax.Array, w: QTensor, spec: str, formulation: str | None = None) -> jax.Array:
    """``einsum(spec, x, dequant(w))`` with ``w`` quantized, returned in x's dtype.

    ``spec`` is written for the float weight's layout (e.g. ``"TD,DNH->TNH"``, ``"TNH,NHD->TD"``);
    x must be ``[*rows, *contracted]`` with the contracted axes in the weight's order, and the
    output ``[*rows, *weight outputs]`` -- true of every projection in ``model.forward``.

    Raises:
        ValueError: a spec of another shape.
    """
    xs, ws, out = _parse(spec)
    contracted = "".join(c for c in ws if c in xs and c not in out)
    w_out = "".join(c for c in ws if c not in contracted)
    rows = xs[: len(xs) - len(contracted)]
    if len(contracted) != w.num_in or not xs.endswith(contracted) or out != rows + w_out:
        raise ValueError(
            f"quantized linear needs spec '<rows><in>,<in><out>-><rows><out>', got {spec!r}"
        )
    row_shape = x.shape[: len(rows)]
    n_in = math.prod(x.shape[len(rows) :])
    out_shape = w.values.shape[: w.values.ndim - w.num_in]
    y = qmatmul_2d(
        x.reshape(math.prod(row_shape), n_in),
        w.values.reshape(math.prod(out_shape), n_in),
        w.scales.reshape(-1),
        w.act,
        formulation,
    )
    return y.reshape(row_shape + out_shape).astype(x.dtype)


def qlinear_flat(x: jax.Array, w: QTensor) -> jax.Array:
    """``x [*rows, I]`` times an int8 weight with one input axis (``values i8[S, I]``, e.g. a
    fused ``QTensor``), as ``[*rows, S]`` in x's dtype.

    Raises:
        ValueError: ``w`` has more than one input axis or x's last axis is not I.
    """
    n_in = w.values.shape[-1]
    if w.num_in != 1 or x.shape[-1] != n_in:
        raise ValueError(
            f"qlinear_flat needs a one-input-axis weight matching x: x {x.shape}, "
            f"values {w.values.shape}, num_in {w.num_in}"
        )
    rows = x.shape[:-1]
    y = qmatmul_2d(x.reshape(-1, n_in), w.values.reshape(-1, n_in), w.scales.reshape(-1), w.act)
    return y.reshape(rows + (y.shape[-1],)).astype(x.dtype)
