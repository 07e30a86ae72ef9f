from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from audit.auditor import Auditor
from audit.chain import Chain
from audit.config import AuditConfig
from audit.errors import AuditUnavailable
from audit.source import SpoolSource
from audit.spool import Position, Spool, SpoolFull
from audit.verify import verify
from audit.writer import SpoolWriter


def ev(i: int, pad: int = 0) -> dict[str, Any]:
    return {"@timestamp": "2026-11-29T12:00:00.000Z", "event": {"id": f"r{i}", "action": "chat"}, "pad": "x" * pad}


def open_spool(path: Path, **kw: Any) -> Spool:
    args: dict[str, Any] = {"max_bytes": 1 << 20, "segment_bytes": 4096, "shipping": True, "retention_s": 86400.0}
    return Spool(path, **(args | kw))


def write(spool: Spool, lines: list[bytes]) -> None:
    for line in lines:
        spool.reserve(len(line))
        spool.write(line, 1)
        spool.sync()


def test_segments_roll_over_and_read_back_in_order(tmp_path: Path) -> None:
    spool = open_spool(tmp_path)
    lines = [json.dumps(ev(i, 200)).encode() + b"\n" for i in range(60)]
    write(spool, lines)
    assert len(list(tmp_path.glob("seg-*.jsonl"))) > 3
    got, pos = [], Position(1, 0)
    while True:
        batch, pos = spool.read(pos, 7)
        if not batch:
            break
        got += batch
    assert [g + b"\n" for g in got] == lines
    assert spool.unshipped_records == 60
    spool.close()


def test_full_spool_refuses_and_only_shipped_segments_are_deleted(tmp_path: Path) -> None:
    spool = open_spool(tmp_path, max_bytes=16384)
    line = json.dumps(ev(0, 900)).encode() + b"\n"
    n = 0
    with pytest.raises(SpoolFull):
        while True:
            write(spool, [line])
            n += 1
    assert n == 16384 // len(line)
    with pytest.raises(AuditUnavailable):
        spool.check_writable()
    # ship the first half: its segments may go, the rest stays
    lines, pos = spool.read(Position(1, 0), n // 2)
    spool.commit(pos, len(lines))
    first = min(int(p.stem[4:]) for p in tmp_path.glob("seg-*.jsonl"))
    spool.check_writable()
    write(spool, [line])
    assert min(int(p.stem[4:]) for p in tmp_path.glob("seg-*.jsonl")) > first
    rest, _ = spool.read(spool.committed, 1000)
    assert len(rest) == n - len(lines) + 1  # nothing unshipped was dropped
    spool.close()


def test_torn_tail_is_cut_and_commit_survives_reopen(tmp_path: Path) -> None:
    spool = open_spool(tmp_path)
    write(spool, [json.dumps(ev(i)).encode() + b"\n" for i in range(5)])
    _, pos = spool.read(Position(1, 0), 2)
    spool.commit(pos, 2)
    spool.close()
    seg = tmp_path / "seg-000000000001.jsonl"
    with open(seg, "ab") as f:
        f.write(b'{"event":{"id":"torn"')  # crash mid-write
    again = open_spool(tmp_path)
    assert again.last_record is not None and again.last_record["event"]["id"] == "r4"
    assert not seg.read_bytes().endswith(b'"torn"')
    assert again.committed == pos
    assert again.unshipped_records == 3
    rest, _ = again.read(again.committed, 10)
    assert [json.loads(r)["event"]["id"] for r in rest] == ["r2", "r3", "r4"]
    again.close()


def test_one_process_per_spool_dir(tmp_path: Path) -> None:
    spool = open_spool(tmp_path)
    with pytest.raises(AuditUnavailable):
        open_spool(tmp_path)
    spool.close()
    open_spool(tmp_path).close()


def config(tmp_path: Path, **kw: Any) -> AuditConfig:
    return AuditConfig(spool_dir=tmp_path / "spool", writer_id=kw.pop("writer_id", "gw-1"), **kw)


async def test_chain_resumes_across_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path, writer_id=None)
    for round_ in range(2):
        auditor = Auditor(cfg)
        await auditor.start()
        await asyncio.gather(*(auditor.emit(ev(round_ * 10 + i)) for i in range(10)))
        writer = auditor.writer_id
        await auditor.stop()
    report = await verify(SpoolSource(cfg.spool_dir))
    assert report.ok, report.problems
    assert [(w.writer, w.first_seq, w.last_seq) for w in report.writers] == [(writer, 0, 19)]


async def test_refused_events_leave_no_gap_in_the_chain(tmp_path: Path) -> None:
    auditor = Auditor(config(tmp_path, max_spool_bytes=8192, segment_bytes=4096))
    await auditor.start()
    accepted = 0
    with pytest.raises(AuditUnavailable):
        for i in range(100):
            await auditor.emit(ev(i, 500))
            accepted += 1
    with pytest.raises(AuditUnavailable):
        auditor.check_writable()
    assert auditor.stats()["refused_events"] >= 1
    await auditor.stop()
    report = await verify(SpoolSource(tmp_path / "spool"))
    assert report.ok and report.records == accepted


class SlowFsync:
    """Counts fsyncs of segment files, noting how many bytes each made durable."""

    def __init__(self, spool_dir: Path, gate: threading.Event | None = None) -> None:
        self.spool_dir, self.gate = spool_dir, gate
        self.synced = 0
        self.calls = 0

    def __call__(self, fd: int) -> None:
        if self.gate is not None:
            self.gate.wait()
        os.fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".jsonl"):
            self.calls += 1
            self.synced = max(self.synced, os.fstat(fd).st_size)


async def test_group_commit_shares_fsyncs_and_emit_waits_for_one(tmp_path: Path) -> None:
    fsync = SlowFsync(tmp_path / "spool")
    auditor = Auditor(config(tmp_path), fsync=fsync)
    await auditor.start()
    durable_at_return: dict[str, int] = {}

    async def one(i: int) -> None:
        await auditor.emit(ev(i))
        durable_at_return[f"r{i}"] = fsync.synced

    await asyncio.gather(*(one(i) for i in range(400)))
    await auditor.stop()
    assert fsync.calls < 100  # 400 events shared far fewer fsyncs
    data = (tmp_path / "spool" / "seg-000000000001.jsonl").read_bytes()
    end = 0
    for line in data.splitlines(keepends=True):
        end += len(line)
        event_id = json.loads(line)["event"]["id"]
        assert durable_at_return[event_id] >= end, f"{event_id} returned before it was fsynced"


async def test_emit_does_not_block_the_event_loop(tmp_path: Path) -> None:
    gate = threading.Event()
    auditor = Auditor(config(tmp_path), fsync=SlowFsync(tmp_path / "spool", gate))
    gate.set()
    await auditor.start()
    gate.clear()
    emit = asyncio.ensure_future(auditor.emit(ev(0)))
    ticks = 0
    for _ in range(5):
        await asyncio.sleep(0.01)  # the loop keeps running while the fsync is stuck
        ticks += 1
    assert ticks == 5 and not emit.done()
    gate.set()
    await emit
    await auditor.stop()


async def test_failed_fsync_refuses_the_batch_and_recovers_without_a_gap(tmp_path: Path) -> None:
    failures = [OSError(5, "Input/output error")]

    def flaky(fd: int) -> None:
        if failures and os.readlink(f"/proc/self/fd/{fd}").endswith(".jsonl"):
            raise failures.pop()
        os.fsync(fd)

    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, shipping=False, retention_s=1e9, fsync=flaky)
    writer = SpoolWriter(
        spool,
        Chain("gw-1"),
        signer=None,
        fsync_interval_s=0.05,
        checkpoint_every=1000,
        checkpoint_interval_s=60,
        max_pending=100,
    )
    writer.start(asyncio.get_running_loop())
    with pytest.raises(AuditUnavailable, match="Input/output error"):
        await writer.submit(ev(0))
    assert (tmp_path / "seg-000000000001.jsonl").read_bytes() == b""  # rolled back
    await writer.submit(ev(1))
    await asyncio.to_thread(writer.stop)
    spool.close()
    report = await verify(SpoolSource(tmp_path))
    assert report.ok and report.records == 1
    assert report.writers[0].first_seq == 0


def test_config_rejects_unknown_content_policy(tmp_path: Path) -> None:
    with pytest.raises(AssertionError):
        AuditConfig(spool_dir=tmp_path, content_policy="some")  # type: ignore[arg-type]


def test_without_shipping_only_segments_past_retention_make_room(tmp_path: Path) -> None:
    line = json.dumps(ev(0, 900)).encode() + b"\n"
    keep = open_spool(tmp_path / "keep", max_bytes=16384, shipping=False, retention_s=86400.0)
    with pytest.raises(SpoolFull):
        for _ in range(100):
            write(keep, [line])
    keep.close()
    expire = open_spool(tmp_path / "expire", max_bytes=16384, shipping=False, retention_s=0.0)
    for _ in range(100):
        write(expire, [line])
    assert sum(p.stat().st_size for p in (tmp_path / "expire").glob("seg-*.jsonl")) <= 16384
    expire.close()


async def test_an_idle_writer_signs_its_tail_after_the_interval(tmp_path: Path) -> None:
    key = tmp_path / "sm2.key"
    key.write_text(f"{11:064x}")
    auditor = Auditor(config(tmp_path, sm2_private_key_path=key, checkpoint_interval_s=0.05))
    await auditor.start()
    await auditor.emit(ev(0))
    seg = tmp_path / "spool" / "seg-000000000001.jsonl"
    for _ in range(500):
        if b"audit-checkpoint" in seg.read_bytes():
            break
        await asyncio.sleep(0.01)
    records = [json.loads(line) for line in seg.read_bytes().splitlines()]
    assert [r["event"]["action"] for r in records] == ["chat", "audit-checkpoint"]
    await auditor.stop()
    assert len(seg.read_bytes().splitlines()) == 2  # nothing new to sign at stop
