"""`tianmen audit verify`: walk each writer's chain, check hashes, seq gaps and SM2 checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from audit.chain import GENESIS, chain_fields, checkpoint_message, event_hash
from audit.events import CHECKPOINT_ACTION, QUARANTINE_ACTION
from audit.signer import Sm2Verifier

if TYPE_CHECKING:
    from audit.source import AuditSource

MAX_PROBLEMS = 1000
Bad = Callable[[str], None]


@dataclass(slots=True)
class Problem:
    writer: str | None
    seq: int | None
    event_id: str | None
    reason: str

    def __str__(self) -> str:
        return f"writer {self.writer} seq {self.seq} event {self.event_id}: {self.reason}"


@dataclass(slots=True)
class Noted:
    """A record that is no tampering but needs a look: an interrupted request, a quarantined event."""

    writer: str
    seq: int
    event_id: str | None
    reason: str

    def __str__(self) -> str:
        return f"event {self.event_id} (writer {self.writer} seq {self.seq}): {self.reason}"


@dataclass(slots=True)
class WriterSummary:
    writer: str
    first_seq: int
    last_seq: int
    events: int = 0
    checkpoints: int = 0
    last_signed_seq: int = -1  # the newest valid checkpoint

    @property
    def unsigned_tail(self) -> int:
        return self.last_seq - max(self.last_signed_seq, self.first_seq - 1)


@dataclass(slots=True)
class VerifyReport:
    writers: list[WriterSummary]
    problems: list[Problem]
    num_problems: int
    records: int
    signatures_checked: bool
    interrupted: list[Noted] = field(default_factory=list)  # opened, never closed: the gateway died mid-response
    num_interrupted: int = 0
    quarantined: list[Noted] = field(default_factory=list)  # refused by Elasticsearch: a stub in its place
    num_quarantined: int = 0

    @property
    def ok(self) -> bool:
        return self.num_problems == 0

    @property
    def first_bad(self) -> Problem | None:
        return self.problems[0] if self.problems else None


@dataclass(slots=True)
class _Link:
    summary: WriterSummary
    last_hash: str


@dataclass(slots=True)
class ChainVerifier:
    """Feed records in chain order (per writer); `report()` at the end. Pure, for tests and tools."""

    public_keys: Iterable[str] = ()
    _keys: dict[str, Sm2Verifier] = field(default_factory=dict)
    _links: dict[str, _Link] = field(default_factory=dict)
    _problems: list[Problem] = field(default_factory=list)
    _num_problems: int = 0
    _records: int = 0
    _open: dict[str, tuple[str, int]] = field(default_factory=dict)  # event id -> its open record
    _closed_first: dict[str, str] = field(default_factory=dict)  # a close seen before its open (another writer)
    _interrupted: list[Noted] = field(default_factory=list)
    _num_interrupted: int = 0
    _quarantined: list[Noted] = field(default_factory=list)
    _num_quarantined: int = 0

    def __post_init__(self) -> None:
        for key in self.public_keys:
            v = Sm2Verifier(key)
            self._keys[v.key_id] = v

    def feed(self, doc_id: str | None, record: Mapping[str, Any]) -> None:
        self._records += 1
        event_id = (record.get("event") or {}).get("id")
        fields = chain_fields(record)
        if not fields or not {"writer", "seq", "prev", "hash"} <= fields.keys() or not isinstance(fields["seq"], int):
            where = record.get("_unparseable")
            self._problem(None, None, event_id, f"unparseable record at {where}" if where else "no chain fields")
            return
        writer, seq, prev, stored = str(fields["writer"]), fields["seq"], fields["prev"], fields["hash"]

        def bad(reason: str) -> None:
            self._problem(writer, seq, event_id, reason)

        link = self._links.get(writer)
        action = (record.get("event") or {}).get("action")
        phase = (record.get("tianmen") or {}).get("phase")
        if action == QUARANTINE_ACTION:  # the original is not here to hash; the links around it still check
            q = (record.get("tianmen") or {}).get("quarantine") or {}
            self._num_quarantined += 1
            if len(self._quarantined) < MAX_PROBLEMS:
                why = f"refused by Elasticsearch (HTTP {q.get('status')}: {q.get('error')}), kept in quarantine"
                self._quarantined.append(Noted(writer, seq, event_id, why))
        elif event_hash(record) != stored:
            bad("hash mismatch: the event was changed after it was written")
        if link is None:
            link = self._links[writer] = _Link(WriterSummary(writer, first_seq=seq, last_seq=seq - 1), GENESIS)
            if seq == 0 and prev != GENESIS:
                bad("the first event of the chain does not start from the genesis hash")
        last = link.summary.last_seq
        if seq <= last:
            bad(f"seq {seq} after seq {last}: duplicate or out of order")
            return
        if seq > last + 1:
            bad(f"events with seq {last + 1}..{seq - 1} are missing before this one")
        elif seq > link.summary.first_seq and prev != link.last_hash:
            bad(f"prev does not match the hash of seq {last}: that event or this link was altered")
        base = f"{event_id}~open" if phase == "open" else event_id
        if doc_id is not None and doc_id not in (base, f"{base}~{writer}~{seq}"):
            bad(f"document _id {doc_id!r} does not match event.id: documents were swapped or replaced")
        link.summary.last_seq, link.last_hash = seq, stored
        link.summary.events += 1
        if isinstance(event_id, str) and phase in ("open", "close", "interrupted"):
            self._track(event_id, phase, writer, seq)
        if action == CHECKPOINT_ACTION:
            link.summary.checkpoints += 1
            self._check_checkpoint(record, link.summary, seq, prev, bad)

    def _check_checkpoint(
        self, record: Mapping[str, Any], summary: WriterSummary, seq: int, prev: str, bad: Bad
    ) -> None:
        cp = (record.get("tianmen") or {}).get("checkpoint") or {}
        if cp.get("seq") != seq - 1 or cp.get("hash") != prev:
            bad("the checkpoint does not cover the event before it")
            return
        if not self._keys:
            return
        verifier = self._keys.get(str(cp.get("key_id")))
        if verifier is None:
            bad(f"checkpoint signed with unknown key id {cp.get('key_id')!r}")
        elif not verifier.verify(checkpoint_message(summary.writer, seq - 1, prev), str(cp.get("signature", ""))):
            bad("checkpoint SM2 signature is invalid (forged or altered)")
        else:
            summary.last_signed_seq = seq

    def _track(self, event_id: str, phase: str, writer: str, seq: int) -> None:
        """Pair each stream's open record with its close; an open left alone (or closed as interrupted
        by the next run) is an interrupted request, not tampering."""
        if phase == "open":
            closing = self._closed_first.pop(event_id, None)
            if closing is None:
                self._open[event_id] = (writer, seq)
            elif closing == "interrupted":
                self._note_interrupted(writer, seq, event_id, "closed as interrupted when the gateway restarted")
            return
        opened = self._open.pop(event_id, None)
        if opened is None:
            self._closed_first[event_id] = phase
        elif phase == "interrupted":
            self._note_interrupted(*opened, event_id, "closed as interrupted when the gateway restarted")

    def _note_interrupted(self, writer: str, seq: int, event_id: str, reason: str) -> None:
        self._num_interrupted += 1
        if len(self._interrupted) < MAX_PROBLEMS:
            self._interrupted.append(Noted(writer, seq, event_id, reason))

    def _problem(self, writer: str | None, seq: int | None, event_id: str | None, reason: str) -> None:
        self._num_problems += 1
        if len(self._problems) < MAX_PROBLEMS:
            self._problems.append(Problem(writer, seq, event_id, reason))

    def report(self) -> VerifyReport:
        writers = sorted((link.summary for link in self._links.values()), key=lambda s: s.writer)
        for event_id, (writer, seq) in self._open.items():
            self._note_interrupted(writer, seq, event_id, "opened, never closed: the gateway stopped mid-response")
        self._open.clear()
        return VerifyReport(
            writers,
            self._problems,
            self._num_problems,
            self._records,
            bool(self._keys),
            self._interrupted,
            self._num_interrupted,
            self._quarantined,
            self._num_quarantined,
        )


async def verify(source: AuditSource, *, public_keys: Iterable[str] = ()) -> VerifyReport:
    """Walk the whole trail in `source`; `public_keys` (hex) check the SM2 checkpoint signatures."""
    verifier = ChainVerifier(public_keys=list(public_keys))
    async for doc_id, record in source.chain_records():
        verifier.feed(doc_id, record)
    return verifier.report()


def format_report(report: VerifyReport) -> str:
    """Human summary: verdict, the first bad event, problems, and one line per writer."""
    lines: list[str] = []
    if report.ok:
        lines.append(f"OK: {report.records} records in {len(report.writers)} chain(s) verified")
    else:
        lines.append(f"FAILED: {report.num_problems} problem(s) in {report.records} records")
        lines.append(f"first bad event: {report.first_bad}")
        lines += [f"  {p}" for p in report.problems[1:20]]
        if report.num_problems > 20:
            lines.append(f"  ... and {report.num_problems - 20} more")
    for what, notes, n, why in (
        ("interrupted request(s)", report.interrupted, report.num_interrupted, "the response was cut off"),
        ("quarantined event(s)", report.quarantined, report.num_quarantined, "see quarantine.jsonl in the spool"),
    ):
        if n:
            lines.append(f"{n} {what} (not tampering: {why}):")
            lines += [f"  {note}" for note in notes[:20]]
            if n > 20:
                lines.append(f"  ... and {n - 20} more")
    if not report.signatures_checked:
        lines.append("warning: no SM2 public key given, checkpoint signatures were not checked")
    for s in report.writers:
        note = f", starts at seq {s.first_seq} (earlier events expired or deleted)" if s.first_seq > 0 else ""
        lines.append(
            f"writer {s.writer}: seq {s.first_seq}..{s.last_seq}, {s.events} records, {s.checkpoints} checkpoints, "
            f"{s.unsigned_tail} after the last valid signature{note}"
        )
    return "\n".join(lines)
