"""Per-writer hash chain: seq numbers, `prev` links, SM3 hashes and SM2-signed checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from audit.digest import canonical_json, sm3_hex
from audit.events import CHECKPOINT_ACTION, format_timestamp
from audit.signer import Sm2Signer

GENESIS = "0" * 64


def event_hash(event: Mapping[str, Any]) -> str:
    """SM3 over the canonical JSON of the event without `tianmen.chain.hash`."""
    tianmen = dict(event.get("tianmen") or {})
    chain = dict(tianmen.get("chain") or {})
    chain.pop("hash", None)
    tianmen["chain"] = chain
    return sm3_hex(canonical_json({**event, "tianmen": tianmen}))


def chain_fields(event: Mapping[str, Any]) -> Mapping[str, Any] | None:
    chain = (event.get("tianmen") or {}).get("chain")
    return chain if isinstance(chain, Mapping) else None


def checkpoint_message(writer: str, seq: int, hash_: str) -> bytes:
    return canonical_json({"hash": hash_, "seq": seq, "writer": writer})


class Chain:
    """One writer's chain state; not thread-safe (the spool writer thread owns it)."""

    def __init__(self, writer: str, last_seq: int = -1, last_hash: str = GENESIS) -> None:
        self.writer, self.last_seq, self.last_hash = writer, last_seq, last_hash
        self.last_checkpoint_seq = last_seq

    @classmethod
    def resume(cls, writer: str, last_record: Mapping[str, Any] | None) -> Chain:
        """Continue after the spool's last record when it is this writer's; else start a new chain."""
        fields = chain_fields(last_record) if last_record else None
        if not fields or fields.get("writer") != writer:
            return cls(writer)
        chain = cls(writer, int(fields["seq"]), str(fields["hash"]))
        last_action = ((last_record or {}).get("event") or {}).get("action")
        if last_action != CHECKPOINT_ACTION:
            chain.last_checkpoint_seq = -1  # unknown: sign again soon
        return chain

    def link(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of `event` with `tianmen.chain` {writer, seq, prev, hash}; advances the chain."""
        record = self._next(event)
        record["tianmen"]["chain"]["hash"] = h = event_hash(record)
        self.last_seq, self.last_hash = record["tianmen"]["chain"]["seq"], h
        return record

    def _next(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of `event` with the next `tianmen.chain` {writer, seq, prev}, not yet hashed; the chain unmoved."""
        chain = {"writer": self.writer, "seq": self.last_seq + 1, "prev": self.last_hash}
        return {**event, "tianmen": {**(event.get("tianmen") or {}), "chain": chain}}

    def link_encoded(self, event: Mapping[str, Any]) -> bytes:
        """`canonical_json(self.link(event))`, encoding the record once instead of twice.

        The hashed encoding is the record's without `chain.hash`; with sorted keys "hash" is the chain object's
        first key, so the record's encoding is the hashed one with `"hash":"…",` put after `"chain":{`. The
        chain object's opening (its prev hash included) can occur only once: every other quote inside a string
        is escaped. Should it not be found exactly once, the record is encoded again."""
        record = self._next(event)
        hashed = canonical_json(record)
        h = sm3_hex(hashed)
        opening = b'"chain":{"prev":"' + self.last_hash.encode() + b'",'
        at = hashed.find(opening)
        self.last_seq, self.last_hash = record["tianmen"]["chain"]["seq"], h
        if at < 0 or hashed.find(opening, at + 1) >= 0:
            record["tianmen"]["chain"]["hash"] = h
            return canonical_json(record)
        cut = at + len(b'"chain":{')
        return b"".join((hashed[:cut], b'"hash":"', h.encode(), b'",', hashed[cut:]))

    def checkpoint(self, signer: Sm2Signer, now: datetime) -> dict[str, Any]:
        """A signed event covering the latest (seq, hash); it is itself linked into the chain."""
        covered_seq, covered_hash = self.last_seq, self.last_hash
        event = {
            "@timestamp": format_timestamp(now),
            "event": {
                "id": f"checkpoint-{self.writer}-{covered_seq + 1}",
                "kind": "state",
                "action": CHECKPOINT_ACTION,
                "outcome": "success",
            },
            "tianmen": {
                "checkpoint": {
                    "seq": covered_seq,
                    "hash": covered_hash,
                    "key_id": signer.key_id,
                    "signature": signer.sign(checkpoint_message(self.writer, covered_seq, covered_hash)),
                }
            },
        }
        record = self.link(event)
        self.last_checkpoint_seq = self.last_seq
        return record

    @property
    def unsigned(self) -> int:
        return self.last_seq - self.last_checkpoint_seq

    def snapshot(self) -> tuple[int, str, int]:
        return self.last_seq, self.last_hash, self.last_checkpoint_seq

    def restore(self, snap: tuple[int, str, int]) -> None:
        self.last_seq, self.last_hash, self.last_checkpoint_seq = snap
