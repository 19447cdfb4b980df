"""Host allocator setting for the CPU backend: keep freed memory in the process.

XLA:CPU allocates each step's output and temporary buffers afresh. glibc's malloc serves a large
request (over its mmap threshold, at most 32 MiB) with a new ``mmap`` and returns it with
``munmap`` on free, so every step pays first-touch page faults on every large buffer (the
figures: docs/performance.md, "Design measurements"). ``keep_freed_host_memory`` turns off mmap
allocation and heap trimming (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 2**31-1)``,
the settings of glibc's ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables),
so freed buffers are reused without page faults. The cost: the process keeps its peak heap
(RSS does not shrink after a large step).

This is process-wide; an engine applies it when its ``EngineConfig.keep_host_memory`` is set: by
default on the CPU backend (``LLM(keep_host_memory=False)`` / ``--no-keep-host-memory`` leave the
allocator as it is).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_MAX = -4


@functools.cache
def keep_freed_host_memory() -> bool:
    """Applies the setting once per process. Returns True when applied, False where the C library
    has no glibc ``mallopt`` (e.g. macOS, musl): nothing changes there, and a debug log says so."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version  # glibc only; musl has a mallopt that ignores these
    except (OSError, AttributeError, TypeError):
        log.debug("host_memory: no glibc mallopt; allocator left as it is")
        return False
    del gnu
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    log.debug("host_memory: mallopt %s", "applied" if ok else "refused")
    return ok
