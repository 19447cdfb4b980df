"""A native decode-attention kernel for XLA CPU (``cpu_decode_kernel.cc``, an XLA FFI custom call).

The XLA decode attention (``paged_attention._decode_attention``) gathers each work item's pages into
a copy before two small batched dots; this kernel reads the live pages of a page-major pool in
place (one pass, online softmax per head), at a fraction of the CPU time
(``scripts/bench_decode_attention.py``; figures in docs/performance.md).

The CPU default: ``attn_impl="auto"`` (the default) runs the XLA attention with its decode rows in
this kernel wherever it can serve the engine (``attn_dispatch.engine_attn_impl``): the CPU
backend, a page-major float32 pool on one device (the CPU default for float32 weights), no
``batch_invariant``, and a kernel that builds and loads; elsewhere "auto" runs the plain XLA
attention (int8 or bfloat16 pools, head-major pools, meshes, ``batch_invariant``: the rule, not
an error), and a failed build under "auto" logs a warning and runs XLA. ``attn_impl="cpu_kernel"``
(``--attn-impl cpu_kernel``) asks for it explicitly: an engine it cannot serve refuses it
(ValueError), a missing compiler or a failed build raises ``KernelBuildError``, a RuntimeError
(no fallback for a kernel asked by name); ``attn_impl="xla"`` never uses it.

The first engine compiles the source with the system C++ compiler (``$CXX``, else ``c++``; a few
CPU seconds) into ``$JAXINFER_CACHE_DIR/cpu_kernels`` (default ``~/.cache/jaxinfer``), keyed by
the source, the flags, jaxlib's version and the CPU; concurrent processes (xdist workers) take a
file lock, so one builds and the others wait for its library (written to a temporary file and
renamed). A failed build is remembered for the rest of the process (not retried).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: concurrent builders each build, the rename keeps it safe
    fcntl = None

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import KernelBuildError

SOURCE = Path(__file__).with_name("cpu_decode_kernel.cc")
TARGET = "jaxinfer_cpu_decode_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]
_lock = threading.Lock()
_loaded: list[Path] = []
_failure: list[str] = []  # the build or load error, once it failed in this process


def unsupported(page_major: bool, kv_dtype, mesh) -> str | None:
    """Why the kernel cannot serve an engine with this KV pool (page-major or head-major,
    ``kv_dtype``) and ``mesh`` (None: one device), or None when it can."""
    if mesh is not None:
        return "a sharded engine"
    if not page_major:
        return "kv_page_major=False"
    if np.dtype(kv_dtype) != np.float32:
        return f"a KV pool of {np.dtype(kv_dtype)}"
    return None


def check_engine(impl: str, page_major: bool, kv_dtype, mesh) -> None:
    """At engine construction with ``attn_impl="cpu_kernel"``: the pool must be page-major float32
    on one device, and the kernel is built and loaded now (not at the first step). Raises
    ValueError naming what is unsupported and what runs instead, KernelBuildError (a
    RuntimeError) for a missing compiler or a failed build."""
    if impl != "cpu_kernel":
        return
    why = unsupported(page_major, kv_dtype, mesh)
    if why is not None:
        raise ValueError(
            "attn_impl='cpu_kernel' reads a page-major float32 KV pool on one "
            f"device, not {why}; use attn_impl='xla' (or 'auto')"
        )
    load()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """Compiles the kernel (once per source, flags, jaxlib and CPU) and returns the library path.
    Raises KernelBuildError (a RuntimeError) when no C++ compiler is found or the build fails."""
    import jaxlib

    base = (
        Path(
            cache_dir or os.environ.get("JAXINFER_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer"
        )
        / "cpu_kernels"
    )
    cxx = os.environ.get("CXX") or "c++"  # may carry arguments: "ccache g++"
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), cxx, *FLAGS, jaxlib.__version__, _cpu_name()]).encode()
    ).hexdigest()[:16]
    lib = base / f"cpu_decode_kernel-{key}.so"
    if lib.exists():
        return lib
    cxx_cmd = shlex.split(cxx) or ["c++"]
    if shutil.which(cxx_cmd[0]) is None:
        raise KernelBuildError(
            f"building the CPU decode kernel needs a C++ compiler: {cxx!r} not "
            "found (install one or set CXX; attn_impl='xla' needs none)"
        )
    base.mkdir(parents=True, exist_ok=True)
    # One builder at a time per cache dir (xdist workers, parallel jobs): the others wait, then
    # find the library. The temp file and rename keep a crashed build from leaving a partial one.
    with open(base / ".build.lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [*cxx_cmd, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise KernelBuildError(f"building {SOURCE.name} failed ({' '.join(cmd)}): {e}") from e
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelBuildError(
                f"building {SOURCE.name} failed ({' '.join(cmd)}: exit status {res.returncode})"
                f":\n{res.stderr[-2000:]}"
            )
        os.replace(tmp, lib)  # atomic: readers see no library or a complete one
    return lib


def load() -> None:
    """Builds (if needed) and registers the kernel with XLA CPU, once per process. Raises
    KernelBuildError (a RuntimeError) when the build or the library's load fails; a failure is
    remembered, and later calls raise it again without rebuilding."""
    with _lock:
        if _loaded:
            return
        if _failure:
            raise KernelBuildError(_failure[0])
        import ctypes

        try:
            lib = build()
            handle = ctypes.cdll.LoadLibrary(str(lib))
            fn = handle.JaxinferCpuDecodeAttention
        except (RuntimeError, OSError, AttributeError) as e:
            msg = str(e) if isinstance(e, RuntimeError) else f"loading the kernel library: {e}"
            _failure.append(msg)
            raise KernelBuildError(msg) from e
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(fn), platform="cpu")
        _loaded.append(lib)


def decode_attention(
    qd,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    q_pos,
    window,
    *,
    scale: float,
    softcap: float | None,
    layer,
    threads: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention over a page-major f32 pool: qd [Td, K, G, H] (cast to f32), pages
    f32[L, P, K, Z, H] (or [P, K, Z, H] with ``layer`` None), i32 block_tables [Td, M], kv_lens
    [Td], q_pos [Td], window i32[] -> f32[Td, K, G, H]; rows with no visible key give 0.
    ``sinks``: [K, G] attention-sink logits joined to each head's softmax denominator (gpt-oss),
    or None.
    ``threads``: worker threads (default: the CPUs this process may use, at most 8).

    Raises ValueError for a pool that is not f32 or not 4/5-D; at run time the call fails
    (XlaRuntimeError) on a layer or page id outside the pool."""
    load()
    if k_pages.dtype != jnp.float32 or v_pages.dtype != jnp.float32:
        raise ValueError(f"cpu decode kernel: k/v pages must be float32, got {k_pages.dtype}")
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if k_pages.ndim != 5:
        raise ValueError(f"cpu decode kernel: pages must be [L, P, K, Z, H], got {k_pages.shape}")
    if threads is None:
        threads = min(
            8,
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1,
        )
    lw = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(qd.shape, jnp.float32))
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    return call(
        jnp.asarray(qd).astype(jnp.float32),
        k_pages,
        v_pages,
        i32(block_tables),
        i32(kv_lens),
        i32(q_pos),
        lw,
        jnp.zeros((0,), jnp.float32)
        if sinks is None
        else jnp.asarray(sinks).astype(jnp.float32).reshape(-1),
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0),
        threads=np.int64(threads),
    )
