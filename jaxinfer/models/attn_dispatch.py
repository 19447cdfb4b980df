"""Attention dispatch: which attention implementation an engine's steps run (``attn_impl``).

``resolve_attn_impl`` turns a user's ``attn_impl`` into a concrete one for a backend;
``engine_attn_impl`` refines it for an engine's KV pool and mesh ("auto" on CPU: the native decode
kernel where it serves the pool) and says why; ``check_attn_impl`` checks a Pallas kernel can
tile the model and pool. ``jaxinfer.engine.config.resolve`` calls them once, when the engine's
config is made; ``paged_attention.paged_attn_fn`` runs the chosen implementation.
"""

from __future__ import annotations

import logging

import jax

import jaxinfer.models.cpu_decode_kernel as cpu_decode_kernel

log = logging.getLogger(__name__)

ATTN_IMPLS = (
    "auto",
    "xla",
    "pallas",
    "pallas_tpu",
    "pallas_gpu",
    "pallas_tpu_interpret",
    "pallas_gpu_interpret",
    "cpu_kernel",
)
# Implementations that run ``ragged_paged_attention_xla`` (page-major pools allowed); "cpu_kernel"
# sends its decode rows to the native XLA CPU kernel (``cpu_decode_kernel``).
XLA_IMPLS = ("xla", "cpu_kernel")
# Backends whose Pallas kernel has passed scripts/device_check_kernels.py un-interpreted; "auto"
# picks the kernel only there (XLA elsewhere). Add a backend after its device check passes.
KERNEL_VERIFIED_BACKENDS: tuple[str, ...] = ()


def resolve_attn_impl(attn_impl: str, backend: str | None = None, what: str | None = None) -> str:
    """The concrete implementation of ``attn_impl`` on ``backend`` (default: jax's), from the
    backend alone. Errors start with ``what``, the setting as the user wrote it (default
    ``attn_impl=<value>``).

    "auto": the backend's kernel where verified (``KERNEL_VERIFIED_BACKENDS``), else "xla" (an
    engine on CPU then refines "xla" to "cpu_kernel" where its pool allows: ``engine_attn_impl``);
    "pallas": the kernel of the current backend ("pallas_tpu" / "pallas_gpu");
    "cpu_kernel": the XLA attention with its decode rows in the native CPU kernel (CPU only).

    Raises:
        ValueError: unknown ``attn_impl``, "pallas" on CPU, "cpu_kernel" off CPU, or a kernel
            for another backend.
    """
    what = what or f"attn_impl={attn_impl!r}"
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"{what} is not available; supported: {ATTN_IMPLS}")
    backend = backend or jax.default_backend()
    if attn_impl == "auto":
        return f"pallas_{backend}" if backend in KERNEL_VERIFIED_BACKENDS else "xla"
    if attn_impl == "cpu_kernel" and backend != "cpu":
        raise ValueError(
            f"{what} is a native kernel for XLA's CPU backend (jax "
            f"backend is {backend!r}); use 'auto', 'xla' or 'pallas'"
        )
    if attn_impl == "pallas":
        if backend not in ("tpu", "gpu"):
            raise ValueError(
                f"{what} needs a TPU or GPU (jax backend is {backend!r}); on CPU use "
                "'xla', or 'pallas_tpu_interpret' / 'pallas_gpu_interpret' to test the kernels"
            )
        return f"pallas_{backend}"
    if attn_impl in ("pallas_tpu", "pallas_gpu") and backend != attn_impl.removeprefix("pallas_"):
        other = "'pallas' (the current backend's kernel)" if backend in ("tpu", "gpu") else "'xla'"
        raise ValueError(
            f"{what} cannot run on jax backend {backend!r}; use {other} or '{attn_impl}_interpret'"
        )
    return attn_impl


def engine_attn_impl(
    attn_impl: str,
    *,
    page_major: bool,
    kv_dtype,
    mesh=None,
    batch_invariant: bool = False,
    backend: str | None = None,
) -> tuple[str, str]:
    """(implementation, why) an engine runs for ``attn_impl``, given its KV pool (``page_major``,
    ``kv_dtype``), ``mesh`` (None: one device) and ``batch_invariant``; the engine passes the
    implementation as every jitted step's static ``attn_impl``.

    "auto" on the CPU backend is "cpu_kernel" (``cpu_decode_kernel``: the XLA attention with its
    decode rows in a native kernel) for a page-major float32 pool on one device without
    ``batch_invariant`` once the kernel builds and loads, else "xla": for another pool, a mesh or
    ``batch_invariant`` by rule (logged at INFO); for a failed build or load with a WARNING on
    the ``jaxinfer.models.attn_dispatch`` logger (once per process: the failure is remembered),
    naming the reason; ``attn_impl="xla"`` chooses XLA without it. Other backends and other
    ``attn_impl`` values: ``resolve_attn_impl``.

    Raises:
        ValueError: as ``resolve_attn_impl``; an explicit "cpu_kernel" for a pool or mesh the
            kernel cannot serve.
        RuntimeError: an explicit "cpu_kernel" whose build or load fails (no fallback).
    """
    impl = resolve_attn_impl(attn_impl, backend)
    backend = backend or jax.default_backend()
    if impl == "cpu_kernel":
        cpu_decode_kernel.check_engine(impl, page_major, kv_dtype, mesh)
        return impl, "attn_impl='cpu_kernel' asked"
    if attn_impl != "auto":
        return impl, f"attn_impl={attn_impl!r} asked"
    if impl != "xla" or backend != "cpu":
        return impl, f"attn_impl='auto' on the {backend} backend"
    why = (
        "batch_invariant=True (its own XLA attention)"
        if batch_invariant
        else cpu_decode_kernel.unsupported(page_major, kv_dtype, mesh)
    )
    if why is not None:
        why = (
            "attn_impl='auto': the XLA attention, as the native CPU decode kernel does not "
            f"serve {why}"
        )
        log.info("%s", why)
        return "xla", why
    failed_before = bool(cpu_decode_kernel._failure)
    try:
        cpu_decode_kernel.load()
    except RuntimeError as e:
        why = (
            f"attn_impl='auto': the native CPU decode-attention kernel is unavailable ({e}); "
            "the XLA attention runs instead (attn_impl='xla' / --attn-impl xla chooses it "
            "and silences this warning)"
        )
        (log.info if failed_before else log.warning)("%s", why)
        return "xla", why
    why = "attn_impl='auto': the native CPU decode kernel, for a page-major float32 KV pool"
    log.info("%s", why)
    return "cpu_kernel", why


def check_attn_impl(cfg, attn_impl: str, page_size: int, num_pages: int, max_pages: int) -> str:
    """Resolves ``attn_impl`` and checks the kernel can tile this model and pool (at engine
    construction, not mid-step). Returns the resolved name. Raises ValueError naming the
    unsupported combination and what is supported."""
    impl = resolve_attn_impl(attn_impl)
    if impl not in XLA_IMPLS:
        from kernels_pallas.ragged_paged_attention import check_supported

        backend = "tpu" if impl.startswith("pallas_tpu") else "gpu"
        elems = cfg.num_layers * cfg.num_kv_heads * num_pages * page_size * cfg.head_dim
        check_supported(
            backend,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=page_size,
            pool_elems=elems,
            max_pages=max_pages,
        )
    return impl
