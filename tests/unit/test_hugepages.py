"""engine.hugepages: resident memory moved to 2 MiB pages in place, nothing made resident that was not, values kept;
and an engine on huge pages answers as one on small pages."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from engine import hugepages
from engine.hugepages import HUGE, PAGE, Collapsed, collapse_resident
from tests.tiny_model import build_tiny_chat_model

pytestmark = pytest.mark.skipif(not hugepages.supported(), reason="Linux only (pagemap, MADV_COLLAPSE)")


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping of `nbytes` and its first 2 MiB-aligned address (the mapping has a spare 2 MiB)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    return m, -(-start // HUGE) * HUGE


def _huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping holding `addr`, from /proc/self/smaps."""
    inside, huge = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head[0] == "AnonHugePages:":
                huge = int(head[1])
    return huge


def _resident_pages(lo: int, hi: int) -> int:
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        data = os.pread(fd, (hi - lo) // PAGE * 8, lo // PAGE * 8)
    finally:
        os.close(fd)
    return int((torch.frombuffer(bytearray(data), dtype=torch.int64) < 0).sum())


def test_resident_memory_moves_to_huge_pages_in_place_with_its_values() -> None:
    m, start = _region(16 * HUGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    before = t.clone()
    done = collapse_resident(within=(start, start + 16 * HUGE))
    assert done.huge_bytes == 16 * HUGE and done.failed_bytes == 0
    assert _huge_kib(start) >= 16 * HUGE // 1024
    assert torch.equal(t, before)
    del t
    m.close()


def test_memory_not_wholly_resident_is_left_alone() -> None:
    """A 2 MiB run with a page never touched is not collapsed: collapsing it would make that page resident."""
    m, start = _region(16 * HUGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    offset = start - t.data_ptr()
    for run in range(16):  # every run but its last page
        t[offset + run * HUGE : offset + (run + 1) * HUGE - PAGE] = 1
    resident = _resident_pages(start, start + 16 * HUGE)
    if resident == 16 * HUGE // PAGE:
        pytest.skip('THP "always": a first touch faulted in a whole 2 MiB page')
    done = collapse_resident(within=(start, start + 16 * HUGE))
    assert done.huge_bytes == 0
    assert _resident_pages(start, start + 16 * HUGE) == resident == 16 * (HUGE // PAGE - 1)
    del t
    m.close()


def test_only_the_range_asked_for_and_runs_of_at_least_min_bytes() -> None:
    m, start = _region(32 * HUGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(3)
    assert collapse_resident(within=(start, start + 4 * HUGE), min_bytes=8 * HUGE).huge_bytes == 0
    assert collapse_resident(within=(start + 1, start + 12 * HUGE + 5)).huge_bytes == 11 * HUGE  # whole pages inside
    del t
    m.close()


def test_an_engine_on_huge_pages_answers_as_one_on_small_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import LLM, EngineConfig, SamplingParams, model_runner

    model = build_tiny_chat_model(tmp_path / "tiny", tied=False)
    monkeypatch.setattr(model_runner, "streams_from_memory", lambda nbytes: True)  # the tiny model stays in cache
    calls: list[Collapsed] = []
    monkeypatch.setattr(model_runner, "collapse_resident", lambda: calls.append(collapse_resident()) or calls[-1])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for huge in (False, True):
        llm = LLM(EngineConfig(model=str(model), max_num_seqs=4, max_model_len=128, huge_pages=huge))
        assert llm.core.runner.huge_pages is huge
        assert bool(calls) is huge  # once loaded (and before each shape's timings where they are not cached)
        outs.append([o.token_ids for o in llm.generate(["Hello world", "The quick brown fox"], params)])
    assert outs[0] == outs[1]
    # the process's memory, the engine's included; in a long test process some runs may not move (pages a forked
    # child still shares, pages in use elsewhere): the controlled regions above check that part exactly
    assert calls[-1].huge_bytes > 0
