"""``EngineConfig``, the concrete sizes and switches an engine runs with, and ``resolve``, which
makes one from the user's options (``jaxinfer.args.EngineArgs``) for a backend and a model: every
default applied, every combination checked, so no None or "auto" reaches the engine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.batch import decode_bucket, next_pow2
from jaxinfer.memory_limits import fmt_bytes, shortfall
from jaxinfer.models.attn_dispatch import (
    XLA_IMPLS,
    check_attn_impl,
    engine_attn_impl,
    resolve_attn_impl,
)
from jaxinfer.models.checks import INT32_MAX
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.kv_cache import kv_bytes_per_token

KV_CACHE_DTYPES = ("auto", "int8")
# Host bytes of the page allocator per page: an int32 refcount, a free-list slot and its int.
ALLOCATOR_BYTES_PER_PAGE = 44


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's resolved sizes and switches (``resolve`` makes it from ``EngineArgs``, whose
    fields of the same names say what each option does). Built directly, the fields not given
    take the portable choices below (XLA attention, a head-major float32 pool, layers as a
    scan), not a backend's tuned ones.

    Attributes:
        max_model_len: longest sequence (prompt + output), tokens.
        page_size: Z, tokens per KV page.
        num_pages: P, pages in the pool (page 0 is reserved as the null page).
        max_num_seqs: most sequences running at once (rows of a step).
        max_num_batched_tokens: token budget of one step (>= ``max_num_seqs``).
        max_prefill_seqs: most prefill chunks in one step.
        attn_impl: the attention implementation every jitted step runs, a concrete one of
            ``attn_dispatch.ATTN_IMPLS`` ("xla", "cpu_kernel", "pallas_tpu", ...).
        attn_impl_reason: why ``attn_impl`` was chosen (``attn_dispatch.engine_attn_impl``);
            not part of equality.
        seed: seed of the host RNG that draws seeds for requests without one.
        kv_cache_dtype: dtype name of the KV pages ("float32", "bfloat16", "int8": per-token,
            per-head f32 scales, ``jaxinfer.quant.kv``).
        unroll_layers: layers as an unrolled loop over per-layer weight buffers
            (``params.unstack_layers``) instead of ``lax.scan`` over stacked ones.
        scan_layers_from_tokens: with unrolled layers, steps of at least this many tokens run
            their layers as a ``lax.scan`` over the same buffers (``Params.scan_from_tokens``);
            0 = never.
        out_in_weights: float layer projections stored output-first, q/k/v and gate/up fused
            (``params.out_in_projections``).
        kv_page_major: the KV pool laid out page-major, ``[L, P, K, Z, H]``
            (``KVCache.page_major``).
        keep_host_memory: keep freed host memory in the process
            (``host_memory.keep_freed_host_memory``).
        async_scheduling: schedule and dispatch step N+1 before reading step N's sampled tokens
            back (vLLM v1's async scheduling); steps whose rows need penalties run without
            overlap.
        enable_prefix_caching: share the KV pages of prompt prefixes between requests
            (``jaxinfer.engine.prefix_cache``).
        batch_invariant: every row's logits bitwise the same whatever else is in the batch
            (``jaxinfer.models.batch_invariant``).
        reuse_compiled_buckets: a step whose exact shape is not compiled yet runs padded to a
            compiled one at most one bucket larger, until the shape has been wanted
            ``bucket_reuse.REUSE_STEPS`` times (``jaxinfer.compile.buckets``).

    Raises:
        TypeError: a field left None or "auto" (those are ``EngineArgs`` values; ``resolve``).
    """

    max_model_len: int
    page_size: int = 16
    num_pages: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_seqs: int = 8
    attn_impl: str = "xla"
    attn_impl_reason: str = dataclasses.field(default="", compare=False)
    seed: int = 0
    kv_cache_dtype: str = "float32"
    unroll_layers: bool = False
    scan_layers_from_tokens: int = 0
    out_in_weights: bool = False
    kv_page_major: bool = False
    keep_host_memory: bool = False
    async_scheduling: bool = True
    batch_invariant: bool = False
    enable_prefix_caching: bool = True
    reuse_compiled_buckets: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or (isinstance(v, str) and v == "auto"):
                raise TypeError(
                    f"EngineConfig.{f.name}={v!r}: an EngineConfig holds resolved values; "
                    "make one with jaxinfer.engine.config.resolve(EngineArgs(...), ...)"
                )

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


DEFAULT_SCAN_LAYERS_FROM_TOKENS = 128
"""``scan_layers_from_tokens``'s default: the steps carrying prompt chunks (and decode steps of
128+ rows) compile as a scan, few-row decode stays unrolled (docs/performance_cold_start.md,
"Forward compile")."""


def scan_from_tokens(ecfg: EngineConfig) -> int | None:
    """``Params.scan_from_tokens`` for ``ecfg``: its ``scan_layers_from_tokens``, 0 (never) as
    None."""
    return ecfg.scan_layers_from_tokens or None


def kv_cache_dtype(ecfg: EngineConfig) -> np.dtype:
    """The KV page dtype of ``ecfg``."""
    return jnp.dtype(ecfg.kv_cache_dtype)


def default_page_size(attn_impl: str = "auto", backend: str | None = None) -> int:
    """Tokens per KV page when the user gives none: 8 where ``attn_impl`` resolves to the XLA
    attention on CPU ("auto", "xla", "cpu_kernel": the kernel reads any page size), else 16
    (vLLM's default block size, a tile the Pallas kernels take).

    On CPU, 8-token pages leave half the last-page slack of 16-token ones (97 % vs 94 % of
    allocated slots live in ``scripts/bench_kv_memory.py``) at no cost in speed: the 64-prompt
    110M serving run took 69.2 / 65.9 s with 8 vs 71.2 / 70.2 s with 16, same tokens.
    Raises ValueError for an unknown ``attn_impl`` (``attn_dispatch.resolve_attn_impl``)."""
    backend = backend or jax.default_backend()
    return 8 if backend == "cpu" and resolve_attn_impl(attn_impl, backend) in XLA_IMPLS else 16


def default_num_pages(
    cfg: ModelConfig, kv_dtype, page_size: int, max_num_seqs: int, max_model_len: int, budget: int
) -> int:
    """Pages for every row at full length, capped by a memory budget in bytes (fewer than one
    sequence needs when the budget is too small: ``resolve`` refuses that)."""
    page_bytes = kv_bytes_per_token(cfg, kv_dtype) * page_size
    wanted = max_num_seqs * -(-max_model_len // page_size) + 1
    return int(min(wanted, budget // page_bytes))


def resolve(
    args,
    cfg: ModelConfig,
    param_dtype,
    *,
    mesh=None,
    tp: int = 1,
    backend: str | None = None,
) -> EngineConfig:
    """The ``EngineConfig`` an engine runs for options ``args``, every default applied.

    Args:
        args: the user's options, a ``jaxinfer.args.EngineArgs`` (already checked one by one).
        cfg: the model config the engines run (after sharding's changes: replicated KV heads).
        param_dtype: the weights' float dtype (the KV pool's, unless ``kv_cache_dtype`` is
            "int8").
        mesh: the ``jax.sharding.Mesh`` the weights are split over, None for one device.
        tp: devices of one model copy (the default pool's memory budget is per device).
        backend: jax's backend (default: ``jax.default_backend()``).

    Raises:
        ValueError: options that cannot run together here, named as the user wrote them
            (``args.spell``): ``max_model_len`` beyond the model's context; ``batch_invariant``
            with a mixture-of-experts model off CPU; quantization,
            ``batch_invariant``, ``kv_page_major`` or int8 KV pages with a mesh; an
            ``attn_impl`` this backend cannot run or whose kernel cannot tile this model and
            pool; ``kv_page_major`` or ``batch_invariant`` with a Pallas ``attn_impl``; a KV
            pool too small for one sequence; ``max_num_batched_tokens`` < ``max_num_seqs``; the
            pool and the buffers of ``max_num_seqs`` rows beyond free memory on the devices
            holding them (``check_kv_pool``).
        RuntimeError: ``attn_impl="cpu_kernel"`` whose build fails (``KernelBuildError``).
    """
    name, spell = args.name, args.spell
    backend = backend or jax.default_backend()
    context = cfg.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > context:
        raise ValueError(
            f"{spell('max_model_len')} must be in [2, {context}] (the model's context length, "
            "max_position_embeddings)"
        )
    if args.max_model_len is None and args.page_size is not None and args.page_size > context:
        raise ValueError(
            f"{spell('page_size')} is larger than {name('max_model_len')} ({context} tokens when "
            f"not given: the model's context length): a KV page holds tokens of one sequence; "
            f"give a {name('page_size')} of at most {context} (8 or 16 usually)"
        )
    if cfg.is_moe:  # mixture of experts: batch invariance checked on CPU only
        moe = f"mixture-of-experts models ({cfg.model_type!r}, num_experts={cfg.num_experts})"
        if args.batch_invariant and backend != "cpu":
            raise ValueError(
                f"{spell('batch_invariant')} for {moe} runs on CPU only: there the grouped "
                "matmul (XLA's tiled loop) was checked bitwise independent of the other tokens "
                f"of a tile; on {backend} its grouped-matmul kernel has not been"
            )
    if mesh is not None:
        if args.quantization not in (None, "none"):
            raise ValueError(
                f"{name('quantization')} with tensor/data parallel is not supported yet"
            )
        if args.batch_invariant:
            raise ValueError(
                f"{spell('batch_invariant')} runs its own XLA attention on one device: "
                "tensor/data parallel engines are not supported with it yet"
            )
        if args.kv_cache_dtype == "int8":
            raise ValueError(
                f"{spell('kv_cache_dtype')} with a sharded engine is not supported yet"
            )
        if args.kv_page_major:
            raise ValueError(
                f"{spell('kv_page_major')} is not supported with a mesh: sharded KV pools are "
                "head-major"
            )
    impl = resolve_attn_impl(args.attn_impl, backend, what=spell("attn_impl"))
    kv_dtype = jnp.dtype(np.int8 if args.kv_cache_dtype == "int8" else param_dtype)
    cpu = backend == "cpu"
    max_model_len = args.max_model_len or context
    page_size = args.page_size or (8 if cpu and impl in XLA_IMPLS else 16)
    max_pages = -(-max_model_len // page_size)
    max_num_seqs = args.max_num_seqs
    max_num_batched_tokens = args.max_num_batched_tokens or max(512, max_num_seqs)
    num_pages = args.kv_pages
    if num_pages is None:  # the budget is per device; each holds K' / tp heads of the pool
        budget = int(args.kv_cache_memory_gb * 2**30) * tp
        num_pages = default_num_pages(cfg, kv_dtype, page_size, max_num_seqs, max_model_len, budget)
        if num_pages < max_pages + 1:  # the budget cannot hold one sequence
            page_bytes = kv_bytes_per_token(cfg, kv_dtype) * page_size
            raise ValueError(
                f"KV pool too small: {spell('kv_cache_memory_gb')} GiB per device holds "
                f"{num_pages} pages of {page_size} tokens x {page_bytes // page_size} bytes a "
                f"token; one sequence of {spell('max_model_len', max_model_len)} needs "
                f"{max_pages + 1} pages ({max_pages} + 1 reserved), "
                f"{fmt_bytes((max_pages + 1) * page_bytes)}. Raise "
                f"{name('kv_cache_memory_gb')} or lower {name('max_model_len')} or "
                f"{name('page_size')}."
            )
    try:  # a Pallas kernel must tile this model and pool
        check_attn_impl(cfg, impl, page_size, num_pages, max_pages)
    except ValueError as e:
        raise ValueError(f"{spell('attn_impl')}: {e}") from None
    page_major = args.kv_page_major
    if page_major is None:
        page_major = cpu and impl in XLA_IMPLS and mesh is None
    elif page_major and impl not in XLA_IMPLS:
        raise ValueError(
            f"{spell('kv_page_major')} needs {name('attn_impl')} resolving to 'xla' (got "
            f"{impl!r}): the Pallas kernels read the head-major pool"
        )
    if args.batch_invariant and impl != "xla":
        raise ValueError(
            f"{spell('batch_invariant')} runs its own XLA attention on one device: "
            f"{spell('attn_impl')} (resolved {impl!r}) is not supported with it; use 'xla' or "
            "'auto'"
        )
    if impl == "cpu_kernel":  # the kernel reads a page-major float32 pool on one device
        problem = (
            "a sharded engine"
            if mesh is not None
            else spell("kv_page_major")
            if not page_major
            else f"a KV pool of int8 ({spell('kv_cache_dtype')})"
            if kv_dtype == np.int8
            else f"a KV pool of {kv_dtype} ({spell('dtype')})"
            if kv_dtype != np.float32
            else None
        )
        if problem is not None:
            raise ValueError(
                f"{spell('attn_impl')} reads a page-major float32 KV pool on one device, not "
                f"{problem}; use {spell('attn_impl', 'xla')} (or 'auto')"
            )
    impl, reason = engine_attn_impl(
        args.attn_impl,
        page_major=page_major,
        kv_dtype=kv_dtype,
        mesh=mesh,
        batch_invariant=args.batch_invariant,
        backend=backend,
    )
    need = max_pages + 1
    if num_pages < need:
        raise ValueError(
            f"KV pool too small: {num_pages} pages of {page_size} tokens cannot hold one sequence "
            f"of {spell('max_model_len', max_model_len)}; need at least {need} pages "
            f"({max_pages} + 1 reserved). Raise {name('kv_pages')} or lower "
            f"{name('max_model_len')}."
        )
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"{spell('max_num_batched_tokens', max_num_batched_tokens)} must be >= "
            f"{spell('max_num_seqs')} (every running sequence decodes each step)"
        )
    scan = args.scan_layers_from_tokens
    resolved = dict(
        max_model_len=max_model_len,
        page_size=page_size,
        num_pages=num_pages,
        max_num_batched_tokens=max_num_batched_tokens,
        attn_impl=impl,
        attn_impl_reason=reason,
        kv_cache_dtype=kv_dtype.name,
        unroll_layers=cpu if args.unroll_layers is None else args.unroll_layers,
        scan_layers_from_tokens=(
            0 if args.batch_invariant else DEFAULT_SCAN_LAYERS_FROM_TOKENS if scan is None else scan
        ),
        out_in_weights=(cpu and mesh is None)
        if args.out_in_weights is None
        else args.out_in_weights,
        kv_page_major=page_major,
        keep_host_memory=cpu if args.keep_host_memory is None else args.keep_host_memory,
        async_scheduling=(
            args.speculative is None if args.async_scheduling is None else args.async_scheduling
        ),
    )
    # Every other EngineConfig field is the option of the same name as given (max_num_seqs,
    # max_prefill_seqs, seed, batch_invariant, enable_prefix_caching, ...).
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in resolved
    }
    ecfg = EngineConfig(**{**given, **resolved})
    devices = None if mesh is None else list(mesh.devices.flat)
    check_kv_pool(cfg, ecfg, kv_dtype, tp, devices, args)
    return ecfg


def check_kv_pool(
    cfg: ModelConfig, ecfg: EngineConfig, kv_dtype, tp: int = 1, devices=None, args=None
) -> None:
    """Checks the engine's sized buffers fit before they are allocated: the KV pool
    (``num_pages`` pages of ``page_size`` tokens), its page allocator, and the per-row sampling
    buffers of ``max_num_seqs`` rows (``ModelRunner``'s ``num_slots``, mirrored here).

    Args:
        cfg: the config the engine runs (with any KV heads replicated for tensor parallelism).
        ecfg: the engine's sizes.
        kv_dtype: dtype of the pages.
        tp: devices each pool is split over (its heads).
        devices: the devices holding the pools, every replica's (default: jax's first device).
        args: the ``EngineArgs`` the sizes came from: messages name the options as the user
            wrote them (default: Python's names).

    Raises:
        ValueError: they need more bytes than are free (the message gives both, and the sizes
            that set them), or the pool has more token slots, or the rows more sampling slots,
            than int32 ids address.
    """
    name = args.name if args is not None else str
    spell = args.spell if args is not None else (lambda field, v: f"{field}={v!r}")
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    slots = ecfg.num_pages * ecfg.page_size
    pool = slots * per_token
    num_slots = next_pow2(decode_bucket(ecfg.max_num_seqs) + next_pow2(ecfg.max_prefill_seqs))
    rows = 2 * 4 * num_slots  # int32 tokens: the idle prev-token buffer and a step's padded ones
    need = -(-pool // tp) + ALLOCATOR_BYTES_PER_PAGE * ecfg.num_pages + rows
    short = shortfall(need, devices)
    seqs = spell("max_num_seqs", ecfg.max_num_seqs)
    if short is not None:
        raise ValueError(
            f"the KV pool does not fit in memory: {ecfg.num_pages} pages x {ecfg.page_size} "
            f"tokens x {per_token} bytes a token ({cfg.num_layers} layers, {cfg.num_kv_heads} KV "
            f"heads of {cfg.head_dim}, K and V) = {fmt_bytes(pool)}"
            + (f" over {tp} devices" if tp > 1 else "")
            + f"; with the page allocator and the buffers of {seqs} rows ({fmt_bytes(rows)}) it "
            f"{short}. Lower {name('kv_pages')} or {name('max_num_seqs')} (or "
            f"{name('kv_cache_memory_gb')} or {name('max_model_len')} when {name('kv_pages')} is "
            "not given)"
        )
    if slots > INT32_MAX:
        raise ValueError(
            f"the KV pool has {ecfg.num_pages} pages x {ecfg.page_size} tokens = {slots} slots, "
            f"more than int32 slot ids address ({INT32_MAX}); lower {name('kv_pages')} or "
            f"{name('page_size')}"
        )
    if num_slots > INT32_MAX:
        raise ValueError(
            f"{seqs} gives {num_slots} sampling rows, more than int32 row ids address "
            f"({INT32_MAX}); lower {name('max_num_seqs')}"
        )
