"""engine.malloc: glibc keeps freed memory, so the next step's activations reuse pages already faulted in."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.malloc import keep_freed_memory, release_freed_memory

SIZE = 64 << 20  # 64 MiB: by default glibc mmaps this, and unmaps it when freed


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# Run in a fresh interpreter: in the whole suite a round now and then faulted its 64 MiB in again (one failure in
# ~5 suite runs on a 2-core AMX VM, never alone), so what earlier tests leave in the process (their threads, its
# heap) decided it, not glibc's settings.
_REUSE = """
import os, resource, torch
from engine.malloc import keep_freed_memory
SIZE = 64 << 20
statm = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
assert keep_freed_memory() and keep_freed_memory()  # idempotent
big = torch.ones(SIZE, dtype=torch.uint8)
before_free = statm()
del big
print(statm() > before_free - SIZE // 2)  # still mapped, ready for the next tensor
for _ in range(8):  # warm-up: the heap grows for the first few rounds (measured: 4), then is reused
    torch.ones(SIZE, dtype=torch.uint8)
start = faults()
for _ in range(5):
    torch.ones(SIZE, dtype=torch.uint8)
print(faults() - start)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_activations_stay_resident_and_are_reused_without_faults() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _REUSE], capture_output=True, text=True, env=env, check=True).stdout
    kept, faults = out.split()
    assert kept == "True"
    # by default each round faults in all 16,384 pages again (81,920 for five); kept memory faults in none
    assert int(faults) < SIZE // os.sysconf("SC_PAGE_SIZE") // 4


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_memory_freed_at_load_goes_back_to_the_kernel_once_asked() -> None:
    assert keep_freed_memory()
    big = torch.ones(6 * SIZE, dtype=torch.uint8)  # a checkpoint tensor, say: freed once packed
    del big
    kept = resident_bytes()
    assert not release_freed_memory(min_bytes=1 << 62)  # too little free to be worth it: left as it is
    assert resident_bytes() > kept - SIZE
    assert release_freed_memory()
    assert resident_bytes() < kept - 5 * SIZE
