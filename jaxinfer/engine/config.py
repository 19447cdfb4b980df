"""``EngineConfig``, the engine's sizes and switches, and the defaults derived from them."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.kv_cache import kv_bytes_per_token
from jaxinfer.models.paged_attention import XLA_IMPLS, resolve_attn_impl
from jaxinfer.models.params import Params

KV_CACHE_DTYPES = ("auto", "int8")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine.

    Attributes:
        max_model_len: longest sequence (prompt + output), tokens.
        page_size: Z, tokens per KV page (``LLM`` and the CLI default to ``default_page_size``:
            8 on CPU with the XLA attention, with or without the CPU decode kernel).
        num_pages: P, pages in the pool (page 0 is reserved as the null page).
        max_num_seqs: most sequences running at once (rows of a step).
        max_num_batched_tokens: token budget of one step.
        max_prefill_seqs: most prefill chunks in one step.
        attn_impl: attention implementation, one of ``paged_attention.ATTN_IMPLS``. "auto": on
            CPU the XLA attention with its decode rows in the native kernel ("cpu_kernel") for
            a page-major float32 pool on one device without ``batch_invariant`` when the
            kernel builds, else "xla" (a failed build logs a WARNING); the Pallas kernel on a
            backend where it is verified (``paged_attention.engine_attn_impl``). An engine's
            ``ecfg.attn_impl`` is the resolved name.
        seed: seed of the host RNG that draws seeds for requests without one.
        kv_cache_dtype: "auto" (the params' float dtype) or "int8" (int8 pages with per-token,
            per-head f32 scales; ``jaxinfer.quant.kv``).
        unroll_layers: run layers as an unrolled loop over per-layer weight buffers instead of
            ``lax.scan`` over stacked ones (``params.unstack_layers``): faster decode, longer
            compiles. None = on CPU only, where the scan's per-layer weight copies cost ~2x.
        scan_layers_from_tokens: with unrolled layers, the steps of at least this many tokens
            (decode plus prefill bucket) run their layers as a ``lax.scan`` over the same
            per-layer buffers all the same (``Params.scan_from_tokens``): ~2.5x less XLA compile
            for those steps, at the cost of one copy of each layer's weights a step, which
            many tokens share. 0 = never; None = ``DEFAULT_SCAN_LAYERS_FROM_TOKENS`` (never
            with ``batch_invariant``, where a value > 0 raises ValueError). No effect without
            unrolled layers (a scan anyway).
        out_in_weights: store float layer projections output-first, q/k/v and gate/up fused
            (``params.out_in_projections``): the layout XLA CPU's GEMM runs 2x faster for a few
            rows, with fewer dots per layer. None = on CPU without a mesh.
        kv_page_major: lay the KV pool out page-major, ``[L, P, K, Z, H]`` (``KVCache.page_major``):
            the XLA attention's page gathers read whole pages. None = on CPU with XLA attention
            and no mesh; True with a Pallas ``attn_impl`` or a mesh raises ValueError.
        keep_host_memory: keep freed host memory in the process instead of returning large
            buffers to the OS each step (``host_memory.keep_freed_host_memory``, process-wide).
            None = on the CPU backend only, where it spares each step's page faults.
        async_scheduling: schedule and dispatch step N+1 before reading step N's sampled tokens
            back, so the host's work (batch building, readback, detokenizing, stop checks)
            overlaps the device's; step N+1 takes its decode tokens from step N's device output.
            Outputs are the same as without it (up to float near-ties when the batches differ;
            bitwise with ``batch_invariant``); a sequence that stops on a token (EOS, stop
            string) costs one discarded row. Steps whose rows need penalties run without overlap.
            None = on. Source: vLLM v1's async scheduling.
        enable_prefix_caching: share the KV pages of prompt prefixes between requests
            (``jaxinfer.engine.prefix_cache``); outputs are unchanged.
        batch_invariant: every row's logits bitwise the same whatever else is in the batch
            (its size and composition, chunking, async scheduling, preemption), at a cost in
            speed (``jaxinfer.models.batch_invariant``). Needs ``attn_impl`` resolving to "xla" and
            no
            mesh (ValueError otherwise).
        reuse_compiled_buckets: a step whose exact shape is not compiled yet runs padded to a
            compiled one at most one bucket larger in each dimension, until the shape has been
            wanted ``bucket_reuse.REUSE_STEPS`` times (``jaxinfer.compile.buckets``): fewer
            compilations at a batch's tail and between a server's arrivals, each such step up to
            ~2x its exact cost.
    """

    max_model_len: int
    page_size: int = 16
    num_pages: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_seqs: int = 8
    attn_impl: str = "auto"
    seed: int = 0
    kv_cache_dtype: str = "auto"
    unroll_layers: bool | None = None
    scan_layers_from_tokens: int | None = None
    out_in_weights: bool | None = None
    kv_page_major: bool | None = None
    keep_host_memory: bool | None = None
    async_scheduling: bool | None = None
    batch_invariant: bool = False
    enable_prefix_caching: bool = True
    reuse_compiled_buckets: bool = True

    def __post_init__(self):
        for name, low in (
            ("max_model_len", 2),
            ("page_size", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_prefill_seqs", 1),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        v = self.scan_layers_from_tokens
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"scan_layers_from_tokens must be None or an integer >= 0, got {v!r}")
        if v and self.batch_invariant is True:
            raise ValueError(
                f"scan_layers_from_tokens={v} with batch_invariant=True: a step's "
                "loop form would follow its token count, and a row's bits with it; "
                "use 0 or None"
            )
        for name in (
            "unroll_layers",
            "out_in_weights",
            "kv_page_major",
            "keep_host_memory",
            "async_scheduling",
        ):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be True, False or None, got {v!r}")
        for name in ("batch_invariant", "enable_prefix_caching", "reuse_compiled_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


DEFAULT_SCAN_LAYERS_FROM_TOKENS = 128
"""``EngineConfig.scan_layers_from_tokens``'s default: the steps carrying prompt chunks (and
decode steps of 128+ rows) compile as a scan, few-row decode (+25-60 % CPU a step as a scan at
1-32 rows) stays unrolled. Measured on the 110M 64-prompt job (docs/performance_cold_start.md,
"Forward compile"): warm no slower than all unrolled (CPU 35.8 / 40.1 s against 41.8 / 43.6 s
in two rounds); cold not settled at this machine's load (wall 41.9 / 80.9 s against 73.9 / 58.7
s); every step a scan (1) was the fastest cold (34.4 s twice) and the slowest warm."""


def scan_from_tokens(ecfg: EngineConfig) -> int | None:
    """``Params.scan_from_tokens`` for ``ecfg``: its ``scan_layers_from_tokens`` (None: the
    default), with 0 (never) as None; None with ``batch_invariant`` (the loop form would follow
    the step's token count, and a row's bits with it)."""
    v = ecfg.scan_layers_from_tokens
    if ecfg.batch_invariant:
        return None
    v = DEFAULT_SCAN_LAYERS_FROM_TOKENS if v is None else v
    return v or None


def kv_cache_dtype(ecfg: EngineConfig, params: Params):
    """The KV page dtype: int8, or the params' float dtype for "auto". Raises ValueError."""
    if ecfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={ecfg.kv_cache_dtype!r}; supported: {KV_CACHE_DTYPES}")
    return np.dtype(np.int8) if ecfg.kv_cache_dtype == "int8" else params.embed.dtype


def default_page_size(attn_impl: str = "auto", backend: str | None = None) -> int:
    """Tokens per KV page when the user gives none: 8 where ``attn_impl`` resolves to the XLA
    attention on CPU ("auto", "xla", "cpu_kernel": the kernel reads any page size), else 16
    (vLLM's default block size, a tile the Pallas kernels take).

    On CPU, 8-token pages leave half the last-page slack of 16-token ones (97 % vs 94 % of
    allocated slots live in ``scripts/bench_kv_memory.py``) at no cost in speed: the 64-prompt
    110M serving run took 69.2 / 65.9 s with 8 vs 71.2 / 70.2 s with 16, same tokens.
    Raises ValueError for an unknown ``attn_impl`` (``paged_attention.resolve_attn_impl``)."""
    backend = backend or jax.default_backend()
    return 8 if backend == "cpu" and resolve_attn_impl(attn_impl, backend) in XLA_IMPLS else 16


def default_num_pages(cfg: ModelConfig, ecfg: EngineConfig, dtype, kv_cache_bytes: int) -> int:
    """Pages for every row at full length, capped by a memory budget in bytes."""
    page_bytes = kv_bytes_per_token(cfg, dtype) * ecfg.page_size
    wanted = ecfg.max_num_seqs * ecfg.max_pages_per_seq + 1
    return int(max(2, min(wanted, kv_cache_bytes // page_bytes)))
