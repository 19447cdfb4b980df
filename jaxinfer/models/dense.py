"""Cache-less forward and greedy decoding over whole sequences: the simple path used by the
model-parity tests (the engine's paged path is checked against it), and the whole-sequence
(dense prefill) forward of a batch of sequences with no KV cache.

Attention is chosen with ``attn_impl``: "xla" runs ``attention.dense_attention`` (the
segment-masked reference, O(S^2) memory); the Pallas names run the FlashAttention kernel of
``kernels_pallas.flash_attention`` (tiles of queries and keys with an online softmax; the score
matrix is never materialised). Nothing falls back silently: a kernel asked by name that cannot run
here, or cannot serve the model, raises ValueError naming what is supported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.models.attention import dense_attn_fn
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import AttnFn, compute_logits, forward
from jaxinfer.models.params import Params

DENSE_ATTN_IMPLS = (
    "auto",
    "xla",
    "pallas",
    "pallas_tpu",
    "pallas_gpu",
    "pallas_tpu_interpret",
    "pallas_gpu_interpret",
)
# Backends where the FlashAttention kernel has passed its device check un-interpreted
# (scripts/device_check_kernels.py: forward and backward against the reference; then
# tests/test_dense_flash.py with JAXINFER_KERNEL_DEVICE=<backend>); "auto" picks the kernel only
# there (docs/kernels.md). Add a backend after its device check passes.
FLASH_VERIFIED_BACKENDS: tuple[str, ...] = ()
_FLASH_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_MAX_BLOCK = 128  # tokens per query/key tile for sequences longer than one tile


def flash_unsupported(cfg: ModelConfig, dtype) -> str | None:
    """Why the FlashAttention kernel cannot run ``cfg`` with activations of ``dtype``, or None."""
    if jnp.dtype(dtype) not in _FLASH_DTYPES:
        return f"{jnp.dtype(dtype).name} activations (it takes float32 or bfloat16)"
    if cfg.head_dim % 8:
        return f"head_dim={cfg.head_dim} (it needs a multiple of 8)"
    return None


def resolve_dense_attn_impl(
    attn_impl: str, cfg: ModelConfig, dtype, backend: str | None = None
) -> str:
    """The attention ``dense_logits`` runs for ``attn_impl`` on ``backend`` (default: jax's).

    "auto": "pallas_<backend>" where the kernel is verified (``FLASH_VERIFIED_BACKENDS``) and
    serves the model (``flash_unsupported``), else "xla" (the rule, not an error); "pallas": the
    current backend's kernel; "pallas_tpu" / "pallas_gpu": that kernel on its own backend;
    "*_interpret": the kernel interpreted (any backend, CPU included; tests).

    Raises:
        ValueError: unknown ``attn_impl``; "pallas" on CPU; a kernel for another backend; a kernel
            asked by name for a model or dtype it does not serve.
    """
    if attn_impl not in DENSE_ATTN_IMPLS:
        raise ValueError(
            f"attn_impl={attn_impl!r} is not available for the dense forward; supported: "
            f"{DENSE_ATTN_IMPLS}"
        )
    backend = backend or jax.default_backend()
    if attn_impl == "auto":
        if backend in FLASH_VERIFIED_BACKENDS and flash_unsupported(cfg, dtype) is None:
            return f"pallas_{backend}"
        return "xla"
    if attn_impl == "xla":
        return "xla"
    impl = attn_impl
    if attn_impl == "pallas":
        if backend not in ("tpu", "gpu"):
            raise ValueError(
                f"attn_impl='pallas' needs a TPU or GPU (jax backend is {backend!r}); on CPU use "
                "'xla', or 'pallas_tpu_interpret' / 'pallas_gpu_interpret' to test the kernel"
            )
        impl = f"pallas_{backend}"
    elif attn_impl in ("pallas_tpu", "pallas_gpu") and backend != attn_impl.removeprefix("pallas_"):
        raise ValueError(
            f"attn_impl={attn_impl!r} cannot run on jax backend {backend!r}; use 'xla', 'auto' "
            f"or '{attn_impl}_interpret'"
        )
    why = flash_unsupported(cfg, dtype)
    if why is not None:
        raise ValueError(
            f"attn_impl={attn_impl!r} ({impl}): the FlashAttention kernel does not serve {why}; "
            "use attn_impl='xla'"
        )
    return impl


def _tile(seq_len: int) -> tuple[int, int]:
    """(padded length, block) for the kernel: one tile of a power of two >= 16 tokens up to
    ``_MAX_BLOCK`` (Triton tile shapes; the TPU kernel takes a block equal to the length), else
    ``_MAX_BLOCK``-token tiles (TPU lanes) over the length rounded up to a multiple of them."""
    if seq_len <= _MAX_BLOCK:
        block = max(16, 1 << (seq_len - 1).bit_length())
        return block, block
    return -(-seq_len // _MAX_BLOCK) * _MAX_BLOCK, _MAX_BLOCK


def flash_attn_fn(
    cfg: ModelConfig, batch: int, seq_len: int, segment_ids: jax.Array | None, attn_impl: str
) -> AttnFn:
    """An ``AttnFn`` (no KV cache) running the FlashAttention kernel over B rows of S tokens.

    The forward's flat token axis T = B * S is laid out as rows [B, N, S, H] and padded after the
    live tokens to the kernel's tile (causal masking keeps the padding invisible). Causal, sliding
    windows (a ``lax.switch`` over the model's distinct windows, as the layers' window is traced
    under ``lax.scan``), the attention soft-cap, ``cfg.attn_scale``, GQA/MQA and the layer's
    attention sinks (gpt-oss) go to the kernel.

    Args:
        cfg: the model.
        batch, seq_len: B rows of S tokens each.
        segment_ids: i32[B, S] sequence runs within each row (``dense_hidden``), or None.
        attn_impl: a resolved Pallas name (``resolve_dense_attn_impl``).
    """
    from jax.experimental.pallas import tpu as pltpu

    from kernels_pallas.flash_attention import BlockSizes, flash_attention

    backend = "tpu" if attn_impl.startswith("pallas_tpu") else "gpu"
    interpret = False
    if attn_impl.endswith("_interpret"):  # the TPU interpreter keeps Mosaic's semantics
        interpret = pltpu.InterpretParams() if backend == "tpu" else True
    s_pad, block = _tile(seq_len)
    ids = None
    if segment_ids is not None:
        ids = jnp.pad(segment_ids, ((0, 0), (0, s_pad - seq_len)), constant_values=-1)
    windows = sorted(set(cfg.layer_windows))

    def kernel(window, q, k, v, sinks):
        return flash_attention(
            q,
            k,
            v,
            segment_ids=ids,
            causal=True,
            sm_scale=cfg.attn_scale,
            logit_softcap=cfg.attn_logit_softcap,
            sliding_window=window or None,
            block_sizes=BlockSizes(block_q=block, block_k=block),
            backend=backend,
            interpret=interpret,
            sinks=sinks,
        )

    def rows(x):  # [B * S, heads, H] -> [B, heads, S_pad, H]
        x = x.reshape(batch, seq_len, *x.shape[1:]).transpose(0, 2, 1, 3)
        return jnp.pad(x, ((0, 0), (0, 0), (0, s_pad - seq_len), (0, 0)))

    def attn(q, k, v, cache, layer, window, sinks=None):
        del layer
        args = (rows(q), rows(k), rows(v), sinks)
        if len(windows) == 1:
            out = kernel(windows[0], *args)
        else:
            branch = jnp.searchsorted(jnp.asarray(windows, jnp.int32), window)
            out = lax.switch(branch, [functools.partial(kernel, w) for w in windows], *args)
        out = out[:, :, :seq_len].transpose(0, 2, 1, 3)  # [B, S, N, H]
        return out.reshape(batch * seq_len, *out.shape[2:]), cache

    return attn


def _runs(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(run ids i32[B, S] unique over the batch, positions i32[B, S] from 0 at each run's start)
    of i32[B, S] segment ids: a run is a maximal stretch of equal ids within a row."""
    b, s = segment_ids.shape
    idx = jnp.arange(s, dtype=jnp.int32)
    start = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    first = lax.cummax(jnp.where(start, idx, 0), axis=1)
    runs = jnp.cumsum(start.reshape(-1), dtype=jnp.int32).reshape(b, s)
    return runs, idx - first


def dense_hidden(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    attn_impl: str = "auto",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Final-normed hidden states [B, S, D] (params' dtype) of i32[B, S] token sequences.

    Args:
        params, cfg: the model.
        tokens: i32[B, S]; each row one sequence at positions 0..S-1 (no padding), or with
            ``segment_ids`` several packed sequences.
        attn_impl: one of ``DENSE_ATTN_IMPLS`` (``resolve_dense_attn_impl``).
        segment_ids: None, or i32[B, S]: each maximal run of equal ids within a row is one
            sequence, at positions 0.. from the run's start, attending only within its run (an id
            that reappears after another starts a new sequence). Padding: a run of its own.

    Raises:
        ValueError: as ``resolve_dense_attn_impl``; ``segment_ids`` not of ``tokens``' shape.
    """
    b, s = tokens.shape
    impl = resolve_dense_attn_impl(attn_impl, cfg, params.embed.dtype)
    if segment_ids is None:
        flat_ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), s)
        positions = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)
        runs = None
    else:
        if segment_ids.shape != tokens.shape:
            raise ValueError(
                f"segment_ids has shape {segment_ids.shape}; expected the tokens' {tokens.shape}"
            )
        runs, pos = _runs(segment_ids.astype(jnp.int32))
        flat_ids, positions = runs.reshape(-1), pos.reshape(-1)
    if impl == "xla":
        attn = dense_attn_fn(cfg, flat_ids, positions)
    else:
        attn = flash_attn_fn(cfg, b, s, runs, impl)
    hidden, _ = forward(params, cfg, tokens.reshape(-1), positions, None, attn)
    return hidden.reshape(b, s, -1)


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"))
def dense_logits(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    attn_impl: str = "auto",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Logits f32[B, S, V] of every position of i32[B, S] token sequences (no padding).

    ``attn_impl`` and ``segment_ids`` as in ``dense_hidden`` (packed sequences: each run's
    logits are those of the run alone). Raises ValueError as ``dense_hidden``.
    """
    hidden = dense_hidden(params, cfg, tokens, attn_impl, segment_ids)
    b, s, d = hidden.shape
    return compute_logits(params, cfg, hidden.reshape(b * s, d)).reshape(b, s, -1)


def dense_greedy(
    params: Params,
    cfg: ModelConfig,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    attn_impl: str = "auto",
) -> list[int]:
    """Greedy continuation of ``prompt`` by full recomputation each step (slow, simple, exact).

    The sequence is padded to a fixed length so it compiles once; padding sits after the live
    tokens, so causal masking keeps it invisible. ``attn_impl`` as in ``dense_logits``.
    """
    total = len(prompt) + max_new_tokens
    buf = np.zeros((1, total), np.int32)
    buf[0, : len(prompt)] = prompt
    out = []
    n = len(prompt)
    for _ in range(max_new_tokens):
        logits = dense_logits(params, cfg, jnp.asarray(buf), attn_impl)
        tok = int(jnp.argmax(logits[0, n - 1]))
        out.append(tok)
        if tok in stop_ids:
            break
        buf[0, n] = tok
        n += 1
    return out
