"""A process's memory: its own peak, and the C library's heap (keep freed memory for the next step, or hand
it back to the system; glibc only)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def peak_resident_bytes() -> int | None:
    """This process's own peak resident memory: ``VmHWM`` of ``/proc/self/status`` (Linux), else psutil's
    peak working set (Windows); None where neither tells it.

    Not ``getrusage``'s peak: Linux carries that across ``exec``, so a child started by ``subprocess`` or a
    spawn pool reads at least its parent's peak (a parent at 2,318 MiB, its fresh child 2,318 MiB
    where its own ``VmHWM`` is 29 MiB).
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    try:
        import psutil
    except ImportError:
        return None
    peak = getattr(psutil.Process().memory_info(), "peak_wset", None)
    return None if peak is None else int(peak)


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks for reuse instead of handing them back to the system.

    torch's CPU allocator caches nothing, and glibc maps blocks larger than its mmap threshold
    (at most 32 MiB, adjusted as blocks are freed) afresh and unmaps them on free: a training step
    then faults in hundreds of MiB of new pages (about 100,000 page faults and 0.1-0.4 s of a
    2 s Swin-B step on a CPU, varying from step to step). With both thresholds raised, the heap
    keeps its peak size and steps reuse it; the peak itself does not change.

    Returns:
        Whether the thresholds were set (glibc only).
    """
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))


def release_freed_memory() -> bool:
    """Hand the free memory inside glibc's heap back to the system (``malloc_trim``).

    A long stream of windows (``geofm predict``) frees large arrays while GDAL's block cache keeps
    allocating between them; glibc cannot give back the holes this leaves, and resident memory grows
    with the scene though the arrays in use do not. Trimming after each written row of blocks keeps
    it flat.

    Returns:
        Whether memory was trimmed (glibc only).
    """
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


__all__ = ["keep_freed_memory", "peak_resident_bytes", "release_freed_memory"]
