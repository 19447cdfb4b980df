"""FlashAttention forward and backward Pallas kernels (TPU and GPU/Triton variants).

Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691): the forward pass tiles queries and
keys, keeps a running row max `m`, row sum `l` and f32 accumulator per query tile (online
softmax) and never materialises the [T, S] score matrix; it saves the output and the per-row
log-sum-exp. The backward pass recomputes each score tile from q, k and the log-sum-exp and
runs as two kernels, one accumulating dK/dV over query tiles, one accumulating dQ over key
tiles (as in jax's `pallas/ops/tpu/flash_attention.py`).

Two variants share the per-tile math (`_logits`, `_softmax_step`, `_grad_tile`):
- `backend="tpu"`: the key axis is the innermost ("arbitrary") grid axis; m, l and the
  accumulators live in VMEM scratch across its steps; index maps clamp skipped key tiles to a
  visible one so no DMA is issued for them. m/l are kept lane-replicated as f32[bq, 128].
- `backend="gpu"`: Triton grid programs run in parallel, so each program holds a whole
  query tile (or key tile for dK/dV) and loops over the other axis with `lax.fori_loop`,
  carrying m, l and the accumulators in registers. head_dim is zero-padded to a power of two.
Causal and sliding-window tiles that are entirely masked are skipped by both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.flash_attention.block_sizes import BlockSizes
from kernels_pallas.flash_attention.common import (
    _LANES,
    BACKENDS,  # noqa: F401
    _Config,
)
from kernels_pallas.flash_attention.gpu import gpu_backward, gpu_forward
from kernels_pallas.flash_attention.reference import SegmentIds, split_segment_ids
from kernels_pallas.flash_attention.tpu import tpu_backward, tpu_forward


def _forward(cfg, q, k, v, q_ids, kv_ids, sinks):
    impl = tpu_forward if cfg.backend == "tpu" else gpu_forward
    return impl(cfg, q, k, v, q_ids, kv_ids, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, q_ids, kv_ids, sinks):
    return _forward(cfg, q, k, v, q_ids, kv_ids, sinks)[0]


def _flash_fwd(cfg, q, k, v, q_ids, kv_ids, sinks):
    o, lse = _forward(cfg, q, k, v, q_ids, kv_ids, sinks)
    return o, (q, k, v, q_ids, kv_ids, sinks, o, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, q_ids, kv_ids, sinks, o, lse = residuals
    impl = tpu_backward if cfg.backend == "tpu" else gpu_backward
    # The sinks sit in lse (the forward joined them), so the kernels' p = exp(s - lse) are the
    # probabilities with sinks, and dq, dk, dv need nothing more.
    dq, dk, dv = impl(cfg, q, k, v, q_ids, kv_ids, o, lse, do)
    dsinks = None
    if sinks is not None:  # d out / d sink = -p_sink out: dsink = -sum p_sink (do . out)
        lse_rows = lse[..., 0] if lse.ndim == 4 else lse  # f32[B, N, T]
        delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse_rows)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    return dq, dk, dv, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public API


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check(
    q, k, v, q_ids, kv_ids, block_sizes: BlockSizes, backend: str, sliding_window, logit_softcap
):
    """Static checks; every message names the offending combination and what is supported."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {BACKENDS}")
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q [B, N, T, H] and k, v [B, K, S, H] of equal shape; got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    b, n, t, h = q.shape
    kb, kh, s, kh_dim = k.shape
    if kb != b or kh_dim != h:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of KV heads K={kh} (GQA/MQA)")
    for x in (q, k, v):
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"dtype {x.dtype} is not supported; use float32 or bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q_ids is not None and (q_ids.shape != (b, t) or kv_ids.shape != (b, s)):
        raise ValueError(
            f"segment ids must be i32[B, T]={(b, t)} and i32[B, S]={(b, s)}; got "
            f"{q_ids.shape} and {kv_ids.shape}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 token")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap={logit_softcap} must be > 0")
    if h % 8:
        raise ValueError(f"head_dim={h} is not supported: it must be a multiple of 8")
    for name, (bq, bk) in (
        ("forward", (block_sizes.block_q, block_sizes.block_k)),
        ("dkv", block_sizes.dkv),
        ("dq", block_sizes.dq),
    ):
        if t % bq or s % bk:
            raise ValueError(
                f"{name} blocks (block_q={bq}, block_k={bk}) must divide the query length "
                f"T={t} and key length S={s}; pick blocks that divide them or pad the sequence"
            )
        if backend == "gpu" and not (_is_pow2(bq) and _is_pow2(bk) and bq >= 16 and bk >= 16):
            raise ValueError(
                f"backend='gpu' {name} blocks (block_q={bq}, block_k={bk}) must be powers of "
                "two >= 16 (Triton tile shapes)"
            )
        if backend == "tpu" and bk % _LANES and bk != s:
            raise ValueError(
                f"backend='tpu' {name} block_k={bk} must be a multiple of {_LANES} (TPU lanes) "
                f"or equal the key length S={s}"
            )


_DEFAULT_BLOCK_SIZES = BlockSizes()


def flash_attention(
    q: jax.Array,  # f32/bf16[B, N, T, H]
    k: jax.Array,  # f32/bf16[B, K, S, H]
    v: jax.Array,  # f32/bf16[B, K, S, H]
    *,
    segment_ids: jax.Array | SegmentIds | None = None,
    causal: bool = True,
    sm_scale: float,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: BlockSizes = _DEFAULT_BLOCK_SIZES,
    backend: str = "tpu",
    interpret: bool | pltpu.InterpretParams = False,
    sinks: jax.Array | None = None,  # f32[N]
) -> jax.Array:  # q.dtype[B, N, T, H]
    """Exact attention without materialising the [T, S] score matrix (FlashAttention-2).

    Args:
      q: f32/bf16[B, N, T, H] queries (RoPE applied).
      k: f32/bf16[B, K, S, H] keys; N % K == 0, query head n reads KV head n // (N // K)
        (K == N: MHA, 1 < K < N: GQA, K == 1: MQA).
      v: f32/bf16[B, K, S, H] values; same dtype as q and k.
      segment_ids: None; i32[B, T] ids for queries and keys (needs T == S), which makes a
        ragged prefill batch of many packed sequences one call; or `SegmentIds(q, kv)`.
        Query and key attend only when their ids are equal.
      causal: keep key positions <= query position. Positions are bottom-right aligned:
        query t is at `t + S - T`, key s at `s`.
      sm_scale: logit scale, usually H ** -0.5.
      logit_softcap: if set, logits become `cap * tanh(sm_scale * q.k / cap)` (Gemma 2).
      sliding_window: if set, keep `q_pos - k_pos < sliding_window` (Mistral, Gemma), tokens.
      block_sizes: tile sizes of the forward and the two backward kernels.
      backend: "tpu" (Mosaic: BlockSpecs + VMEM scratch for m, l, acc) or "gpu" (Triton:
        in-kernel loop over tiles; head_dim zero-padded to a power of two >= 16).
      interpret: False runs the compiled kernel on the device. True runs Pallas' generic
        interpreter (any backend, CPU included). For backend="tpu",
        `pltpu.InterpretParams()` runs the TPU interpreter instead (Mosaic semantics: VMEM
        scratch, DMAs, grid order; slower).
      sinks: f32[N] attention-sink logits (gpt-oss), or None: one more logit per query head in
        every row's max and denominator, with no value; its gradient is returned too.

    Returns:
      q.dtype[B, N, T, H]; a row with no visible key is 0. Accumulation is in float32.
      Differentiable: a `jax.custom_vjp` saves (q, k, v, out, log-sum-exp) and recomputes
      score tiles in a dK/dV kernel and a dQ kernel.

    Raises:
      ValueError: unknown backend; shapes/dtypes that do not match; head_dim not a multiple
        of 8; blocks that do not divide T and S; gpu blocks that are not powers of two >= 16;
        tpu block_k neither a multiple of 128 nor equal to S; sliding_window < 1;
        logit_softcap <= 0; sinks not of shape [N].
    """
    q_ids, kv_ids = split_segment_ids(segment_ids)
    _check(q, k, v, q_ids, kv_ids, block_sizes, backend, sliding_window, logit_softcap)
    if q_ids is not None:
        q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected ({q.shape[1]},)")
    cfg = _Config(
        causal=bool(causal),
        sm_scale=float(sm_scale),
        softcap=None if logit_softcap is None else float(logit_softcap),
        window=None if sliding_window is None else int(sliding_window),
        offset=k.shape[2] - q.shape[2],
        groups=q.shape[1] // k.shape[1],
        block_sizes=block_sizes,
        backend=backend,
        interpret=interpret,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    return _flash(cfg, q, k, v, q_ids, kv_ids, sinks)
