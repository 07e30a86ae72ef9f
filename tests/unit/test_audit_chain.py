from __future__ import annotations

import copy
from datetime import datetime, timezone

import pytest

from audit.chain import GENESIS, Chain, checkpoint_message, event_hash
from audit.digest import canonical_json, sm3_hex, sm3_text
from audit.events import CHECKPOINT_ACTION
from audit.signer import Sm2Signer, Sm2Verifier, public_key_of

# d = 11: its public key's x starts with "04", which gmssl's own prefix handling would mangle
KEY_04 = f"{11:064x}"
KEY = "3945208f7b2144b13f36e38ac6d39f95889393692860b51a42fb81ef4df7c5b8"
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def ev(i: int, **extra: object) -> dict[str, object]:
    return {"@timestamp": "2026-11-29T12:00:00.000Z", "event": {"id": f"r{i}", "action": "chat"}, **extra}


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical_json({"b": 1, "a": {"z": [1, 2], "y": "天门"}}) == '{"a":{"y":"天门","z":[1,2]},"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_sm3_matches_the_standard_vector() -> None:
    assert sm3_hex(b"abc") == "66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0"
    assert sm3_text("abc") == sm3_text(b"abc")


def test_link_numbers_and_chains_events_without_touching_the_input() -> None:
    chain = Chain("w1")
    src = ev(0, tianmen={"model": "m"})
    before = copy.deepcopy(src)
    a, b = chain.link(src), chain.link(ev(1))
    assert src == before
    assert a["tianmen"]["model"] == "m"
    assert [a["tianmen"]["chain"]["seq"], b["tianmen"]["chain"]["seq"]] == [0, 1]
    assert a["tianmen"]["chain"]["prev"] == GENESIS
    assert b["tianmen"]["chain"]["prev"] == a["tianmen"]["chain"]["hash"]
    assert chain.last_hash == b["tianmen"]["chain"]["hash"] == event_hash(b)


def test_link_encoded_is_the_linked_record_encoded() -> None:
    """The spool's line, spliced from the hashed encoding, is byte for byte the record's canonical JSON, even
    when client-controlled strings hold the chain object's opening, quotes, escapes and non-ASCII text."""
    events = [
        ev(0),
        ev(1, tianmen={"model": "m", "content_policy": "full", "prompt": {"text": '"chain":{"prev":"' + GENESIS}}),
        ev(2, user_agent={"original": 'a"chain":{"prev":"x",\\"'}, tianmen={"tool_calls": ["天门", "\u2028"]}),
        ev(3, tianmen={"chain": {"writer": "forged", "seq": 99, "prev": "0", "hash": "1"}, "ttft_ms": 1e-05}),
        {"@timestamp": "t", "event": {"id": "r4"}, "tianmen": None},
    ]
    a, b = Chain("w1"), Chain("w1")
    for event in events:
        before = copy.deepcopy(event)
        assert b.link_encoded(event) == canonical_json(a.link(event))
        assert event == before
        assert (a.last_seq, a.last_hash) == (b.last_seq, b.last_hash)
    # an object of the event's own that opens like the chain object: found twice, so encoded again
    twin = ev(5, a={"chain": {"prev": GENESIS, "seq": 0}})
    assert Chain("w1").link_encoded(twin) == canonical_json(Chain("w1").link(twin))


def test_hash_covers_every_field_but_itself() -> None:
    rec = Chain("w1").link(ev(0, user={"id": "alice"}))
    h = rec["tianmen"]["chain"]["hash"]
    assert event_hash({**rec, "tianmen": {"chain": {**rec["tianmen"]["chain"], "hash": "x"}}}) == h
    assert event_hash({**rec, "user": {"id": "mallory"}}) != h
    chain = dict(rec["tianmen"]["chain"], seq=5)
    assert event_hash({**rec, "tianmen": {"chain": chain}}) != h


def test_resume_continues_the_same_writer_only() -> None:
    chain = Chain("w1")
    last = [chain.link(ev(i)) for i in range(3)][-1]
    resumed = Chain.resume("w1", last)
    nxt = resumed.link(ev(3))
    assert nxt["tianmen"]["chain"]["seq"] == 3
    assert nxt["tianmen"]["chain"]["prev"] == last["tianmen"]["chain"]["hash"]
    fresh = Chain.resume("w2", last)
    assert (fresh.last_seq, fresh.last_hash) == (-1, GENESIS)


def test_checkpoint_signs_the_latest_hash_and_is_itself_linked() -> None:
    signer = Sm2Signer(KEY)
    chain = Chain("w1")
    last = chain.link(ev(0))
    cp = chain.checkpoint(signer, NOW)
    assert cp["event"]["action"] == CHECKPOINT_ACTION
    assert cp["tianmen"]["chain"]["seq"] == 1 and cp["tianmen"]["chain"]["prev"] == last["tianmen"]["chain"]["hash"]
    body = cp["tianmen"]["checkpoint"]
    assert (body["seq"], body["hash"]) == (0, last["tianmen"]["chain"]["hash"])
    verifier = Sm2Verifier(public_key_of(KEY))
    assert body["key_id"] == verifier.key_id
    assert verifier.verify(checkpoint_message("w1", 0, body["hash"]), body["signature"])
    assert not verifier.verify(checkpoint_message("w1", 0, GENESIS), body["signature"])
    assert chain.unsigned == 0


@pytest.mark.parametrize("key", [KEY, KEY_04])
def test_sm2_round_trip_including_keys_gmssl_would_mangle(key: str) -> None:
    pub = public_key_of(key)
    sig = Sm2Signer(key).sign(b"message")
    assert Sm2Verifier(pub).verify(b"message", sig)
    assert Sm2Verifier("04" + pub).verify(b"message", sig)
    assert not Sm2Verifier(pub).verify(b"massage", sig)


@pytest.mark.parametrize("sig", ["", "zz" * 64, "00" * 64, "ab" * 63])
def test_malformed_signatures_do_not_verify(sig: str) -> None:
    assert not Sm2Verifier(public_key_of(KEY)).verify(b"message", sig)
