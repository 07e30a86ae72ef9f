"""glibc malloc tuning for a process that runs the engine on CPU.

By default glibc hands allocations above ~128 KiB-32 MiB straight to mmap and returns them to the kernel when
freed, so every step's fresh activations (a prefill's [4096, 4864] MLP tensors are 40 MB) are faulted in page
by page again. On a VM a page fault is dear: measured here, a 32 x 128-token prefill of a Qwen2-0.5B shape took
8.7 s as it comes and 7.8 s with freed memory kept for reuse. vLLM's CPU docs get the same effect by preloading
tcmalloc; this needs nothing at launch.
"""

from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_applied = False


def keep_freed_memory() -> bool:
    """Serve every allocation from malloc's heaps and never shrink them. True when glibc took the settings.

    Process-wide and one-way: the resident size stays at its high-water mark, which for an engine is its
    weights, KV cache and the largest step's activations, all of which come back at the next busy step.
    """
    global _applied
    if _applied:
        return True
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc only: musl has no mallopt
    if mallopt is None:
        log.debug("no mallopt in this C library: malloc left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    log.debug("malloc keeps freed memory: %s", _applied)
    return _applied


MIN_RELEASE = 256 << 20  # below this much free heap, release_freed_memory leaves it (see there)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def free_heap_bytes() -> int | None:
    """Bytes free in malloc's heaps (glibc 2.33+'s mallinfo2), None where it cannot be had."""
    info = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if info is None:
        return None
    info.restype = _MallInfo2
    return int(info().fordblks)


def release_freed_memory(min_bytes: int = MIN_RELEASE) -> bool:
    """Give the kernel back the whole free pages in malloc's heaps (glibc's malloc_trim) where at least `min_bytes`
    are free; True when it did.

    For once after a model is loaded: its checkpoint tensors and the GEMM selection's trial copies of every
    weight were freed into heaps that keep_freed_memory never shrinks, and they stayed resident for nothing
    (measured on a Zen 4, 2026-12-04: a W8A8 Qwen2-0.5B shape 2,627 MiB resident after load, 1,786 after this;
    the first batch then grew it by ~110 MiB of activations, which stay). Below `min_bytes` it is not worth it:
    what is released is faulted in again by the next allocations (a tiny model's load frees ~100 MiB, the
    selection's cache-flush buffer, and trimming it doubled the load's time: 106 → 211 ms).
    """
    libc = ctypes.CDLL(None)
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    if trim is None:
        return False
    free = free_heap_bytes()
    if free is not None and free < min_bytes:
        return False
    gc.collect()  # tensors a reference cycle still holds (measured: in 2 of 5 loads ~250 MiB more came free later)
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
