"""The CPU engine's resident memory on 2 MiB pages (Linux transparent huge pages, MADV_COLLAPSE).

WHY: a decode step streams every weight from memory, and with 4 KiB pages the stream takes a TLB miss and a page
walk every 4 KiB. Measured on a 2-core Zen 4 (2026-12-06): bf16mm over Qwen2-0.5B's weights rotated past the L3,
the two page sizes in turn, one row of gate/up 340-378 → 305-315 µs, of the LM head 5.06-5.46 → 4.59-5.23 ms, 32
rows ~2%; the Qwen2-0.5B engine, in turn (`benchmarks.throughput --small-pages-row --alternate 4`), batch 1.06x
the throughput in two runs, batch-1 0.93x and 1.02x the time. Weights, the KV cache and the step's buffers are
allocated by torch from malloc's heaps, which a distribution's default (THP "madvise") leaves on 4 KiB pages;
glibc's own switch for it (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) must be set before the process starts, which
an engine inside a library cannot do. So once the engine's memory is in place, its fully resident 2 MiB runs are
collapsed in place.

Only runs whose every 4 KiB page is already resident are collapsed, so the resident size does not grow. Where
the kernel cannot (before Linux 6.1, THP compiled out, no free 2 MiB blocks) the memory stays as it was: the
call reports what it did and never fails.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20
PAGE = 4096
PER_HUGE = HUGE // PAGE
MADV_COLLAPSE = 25  # Linux 6.1+: synchronous, independent of the sysfs THP mode (mm/khugepaged.c)


@dataclass(slots=True)
class Collapsed:
    """What one pass did: bytes that are now on huge pages (collapsed or already so), bytes it could not
    collapse, and how long it took."""

    huge_bytes: int = 0
    failed_bytes: int = 0
    seconds: float = 0.0


def supported() -> bool:
    return sys.platform == "linux" and os.path.exists("/proc/self/pagemap")


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _anonymous_writable() -> list[tuple[int, int]]:
    """This process's private anonymous read-write mappings (malloc's heaps and arenas, torch's large buffers)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if parts[1] != "rw-p" or (len(parts) > 5 and parts[5] != "[heap]"):
                continue  # file-backed, the stack, vdso, guard pages
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            lo, hi = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
            if hi > lo:
                out.append((lo, hi))
    return out


def _resident_runs(pagemap: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The runs of whole 2 MiB pages in [lo, hi) whose every 4 KiB page is resident (pagemap bit 63)."""
    count = (hi - lo) // PAGE
    data = os.pread(pagemap, count * 8, lo // PAGE * 8)
    if len(data) != count * 8:
        return []
    entries = torch.frombuffer(bytearray(data), dtype=torch.int64).view(-1, PER_HUGE)
    full = (entries < 0).all(dim=1).tolist()  # bit 63, the sign bit: present in RAM
    runs, start = [], None
    for i, ok in enumerate([*full, False]):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            runs.append((lo + start * HUGE, lo + i * HUGE))
            start = None
    return runs


def collapse_resident(min_bytes: int = 8 * HUGE, within: tuple[int, int] | None = None) -> Collapsed:
    """Back every fully resident 2 MiB run of at least `min_bytes` of this process's anonymous memory (or of the
    address range `within`) with huge pages. Runs already on huge pages cost a page-table check."""
    done = Collapsed()
    if not supported():
        return done
    t = time.perf_counter()
    madvise = _madvise()
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError as e:
        log.debug("huge pages: no pagemap (%s)", e)
        return done
    try:
        spans = _anonymous_writable()
        if within is not None:
            first, last = -(-within[0] // HUGE) * HUGE, within[1] // HUGE * HUGE
            spans = [(max(lo, first), min(hi, last)) for lo, hi in spans]
            spans = [(lo, hi) for lo, hi in spans if hi > lo]
        for lo, hi in spans:
            for a, b in _resident_runs(pagemap, lo, hi):
                if b - a < min_bytes:
                    continue
                if madvise(a, b - a, MADV_COLLAPSE) == 0:
                    done.huge_bytes += b - a
                else:  # EINVAL: no MADV_COLLAPSE here; EAGAIN / ENOMEM: some 2 MiB blocks could not be had
                    done.failed_bytes += b - a
    finally:
        os.close(pagemap)
    done.seconds = time.perf_counter() - t
    return done
