"""Free memory of the host and the devices, so sizes read from files and arguments are checked
before anything that large is allocated.

The host's free memory is ``MemAvailable`` of ``/proc/meminfo`` (Linux; the kernel's estimate of
memory a process can get without swapping), bounded by the cgroup's ``memory.max`` less its
``memory.current`` when the process runs under a cgroup v2 limit; elsewhere ``os.sysconf``'s
available physical pages. A device's is ``memory_stats()``'s ``bytes_limit - bytes_in_use``; on
the CPU backend the devices' memory is the host's.
"""

from __future__ import annotations

import os

import jax

GiB = 2**30


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def available_host_bytes() -> int | None:
    """Bytes of host memory this process can still allocate, or None where unknown."""
    avail = None
    meminfo = _read("/proc/meminfo")
    if meminfo:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024  # kB
                break
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    limit, used = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit and used and limit.strip().isdigit() and used.strip().isdigit():
        left = max(int(limit) - int(used), 0)
        avail = left if avail is None else min(avail, left)
    return avail


def available_device_bytes(device: jax.Device) -> int | None:
    """Free bytes of one device (``bytes_limit - bytes_in_use``); the host's on CPU; None where
    unknown."""
    if device.platform == "cpu":
        return available_host_bytes()
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def fmt_bytes(n: int) -> str:
    """``"123456789 bytes (0.11 GiB)"``."""
    return f"{n} bytes ({n / GiB:.3g} GiB)"


def shortfall(need: int, devices=None) -> str | None:
    """None when ``need`` bytes fit, else a phrase saying what is needed and what is free.

    Args:
        need: bytes wanted on each of ``devices``.
        devices: the devices that will hold them (default: jax's first device). CPU devices share
            the host's memory: ``need`` times their number is compared with it.
    """
    devices = list(devices) if devices is not None else jax.devices()[:1]
    if all(d.platform == "cpu" for d in devices):
        need *= len(devices)
        avail, where = available_host_bytes(), "host memory available"
    else:
        frees = [available_device_bytes(d) for d in devices]
        known = [f for f in frees if f is not None]
        avail = min(known) if known else None
        where = f"free on the device ({devices[0].device_kind})"
    if avail is None or need <= avail:
        return None
    return f"needs {fmt_bytes(need)}, {where}: {fmt_bytes(avail)}"
