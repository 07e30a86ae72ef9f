"""engine.malloc: glibc keeps freed memory, so the next step's activations reuse pages already faulted in."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from engine.malloc import keep_freed_memory


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_activations_stay_resident_for_reuse() -> None:
    assert keep_freed_memory()
    assert keep_freed_memory()  # idempotent
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB: glibc would mmap and unmap this by default
    before_free = resident_bytes()
    del big
    assert resident_bytes() > before_free - (32 << 20)  # still mapped, ready for the next tensor
    again = torch.ones(64 << 20, dtype=torch.uint8)
    assert resident_bytes() < before_free + (32 << 20)  # served from the kept memory, not a fresh mapping
    del again
