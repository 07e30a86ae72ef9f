"""Streaming: an identifier split at any chunk boundary is masked exactly once, no fragment leaks, the stream
joined equals the whole answer filtered at once; held back is only what could still become a match."""

from __future__ import annotations

import random
from collections import Counter

from security.pii_detectors import NAMES, detectors
from security.pii_policy import PolicyBook
from security.pii_redact import Vault, redact
from security.pii_scan import Scanner
from security.pii_stream import MAX_HOLD_CHARS, Restorer, StreamFilter
from security.pii_terms import TermMatcher
from tests import pii_samples as gen

DETS = detectors()
TERMS = TermMatcher(["内部代号", "falcon", "falcon eye"])
SCANNER = Scanner(DETS, [("sensitive", TERMS)])
KEEP = {d.name: d.keep for d in DETS}


def policy(**actions: str):  # type: ignore[no-untyped-def]
    table = {"completion": {"*": "mask", **actions}}
    return PolicyBook([*NAMES, "sensitive"], table, None, None, KEEP).default.completion


MASK = policy()


def whole(text: str, pol=MASK) -> str:  # type: ignore[no-untyped-def]
    r = redact(text, SCANNER.scan(text)[0], pol, None)
    return r.text


def streamed(pieces: list[str], pol=MASK) -> tuple[list[str], StreamFilter]:  # type: ignore[no-untyped-def]
    f = StreamFilter(SCANNER, pol)
    out = [f.feed(p) for p in pieces]
    out.append(f.finish())
    return out, f


def test_an_identifier_split_at_every_boundary_is_masked_once() -> None:
    rng = random.Random(0)
    cases = [
        (f"您的卡号是{gen.card(rng, 16)}，请妥善保管。", "bank_card"),
        (f"card {gen.grouped(gen.card(rng, 19), ' ')} expires soon", "bank_card"),
        (f"身份证号：{gen.id18(rng)}。", "id_card"),
        (f"ID {gen.fullwidth(gen.id18(rng))} on file", "id_card"),
        (f"手机 +86 {gen.mobile(rng)} 联系", "mobile"),
        ("write to li.si@bank.example.cn now", "email"),
        ("这是内部代号：falcon eye。", "sensitive"),
    ]
    for text, kind in cases:
        expected = whole(text)
        assert expected != text
        for i in range(1, len(text)):
            out, f = streamed([text[:i], text[i:]])
            assert "".join(out) == expected, (text, i)
            assert f.take_fired()[(kind, "mask")] == 1 or kind == "sensitive", (text, i)
        out, f = streamed(list(text))  # one character per chunk
        assert "".join(out) == expected


def test_random_chunkings_of_text_with_many_identifiers() -> None:
    rng = random.Random(1)
    for _ in range(40):
        parts = []
        for _ in range(6):
            parts.append(rng.choice(["，然后", " and ", "。", "：", " ", "号码"]))
            parts.append(
                rng.choice(
                    [
                        gen.card(rng, rng.randint(16, 19)),
                        gen.grouped(gen.card(rng, 16), "-"),
                        gen.id18(rng),
                        gen.mobile(rng),
                        gen.uscc(rng),
                        gen.luhn_invalid(rng, 16),
                        "falcon",
                        "1.2.3.4",
                        "x@y.com",
                    ]
                )
            )
        text = "".join(parts)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out, f = streamed(pieces)
        assert "".join(out) == whole(text), text
        total: Counter[tuple[str, str]] = f.take_fired()
        assert total == redact(text, SCANNER.scan(text)[0], MASK, None).fired


def test_only_what_could_still_match_is_held_back() -> None:
    f = StreamFilter(SCANNER, MASK)
    assert f.feed("余额一千元，卡号") == "余额一千元，卡号"
    assert f.feed("6222 02") == "" and f.held == len("6222 02")
    assert f.feed("12，") == "6222 0212，"  # 8 digits and a comma: cannot become a card any more
    assert f.feed("内部") == "" and f.feed("代") == "" and f.feed("码") == "内部代码"  # began a term, then did not
    assert f.feed("hello") == "" and f.feed(" ") == "hello "  # a word could still become an e-mail address
    assert f.finish() == ""


def test_a_valid_card_at_the_end_waits_for_what_follows() -> None:
    x = gen.card(random.Random(2), 16)
    f = StreamFilter(SCANNER, MASK)
    assert f.feed(x) == ""  # a 17th digit would make it another number
    assert f.feed("。") == whole(x) + "。"
    g = StreamFilter(SCANNER, MASK)
    assert g.feed(x) == "" and g.finish() == whole(x)


def test_block_ends_the_stream_before_the_identifier() -> None:
    pol = policy(bank_card="block")
    rng = random.Random(3)
    text = f"手机{gen.mobile(rng)}，卡号{gen.card(rng, 16)}，后面的话不应出现"
    r = redact(text, SCANNER.scan(text)[0], pol, None)
    assert r.blocked == "bank_card" and r.text.endswith("卡号") and "后面" not in r.text
    for i in range(1, len(text)):
        out, f = streamed([text[:i], text[i:]], pol)
        assert "".join(out) == r.text and f.blocked == "bank_card"
    f = StreamFilter(SCANNER, pol)
    f.feed(text)
    assert f.feed("more") == "" and f.finish() == ""


def test_a_long_run_of_digits_is_released_not_hoarded() -> None:
    f = StreamFilter(SCANNER, MASK)
    out = "".join(f.feed("7" * 50) for _ in range(100))
    assert f.held < 64 and len(out) + f.held == 5000  # a run too long for any identifier goes out as it comes
    g = StreamFilter(SCANNER, MASK)
    out = "".join(g.feed("a" * 50) for _ in range(100))  # letters: an e-mail's local part is at most 64
    assert g.held <= 64
    h = StreamFilter(SCANNER, MASK)
    for _ in range(40):
        h.feed("a.b" * 20)
    assert h.held <= MAX_HOLD_CHARS


def test_placeholders_restored_across_every_boundary() -> None:
    vault = Vault()
    card = gen.card(random.Random(4), 16)
    ph = vault.placeholder("CARD", card, "")
    ph2 = vault.placeholder("ID", "11010519491231002X", "")
    assert (ph, ph2) == ("[CARD_1]", "[ID_1]") and vault.placeholder("CARD", card, "") == ph
    answer = f"好的，卡号{ph}已登记，证件{ph2}。[NOT_1] 保持原样 [CARD"
    expected = answer.replace(ph, card).replace(ph2, "11010519491231002X")
    for i in range(1, len(answer)):
        for j in range(i + 1, len(answer) + 1, 3):
            r = Restorer(vault)
            got = r.feed(answer[:i]) + r.feed(answer[i:j]) + r.feed(answer[j:]) + r.finish()
            assert got == expected, (i, j)
    r = Restorer(vault)
    assert r.feed("卡号[CA") == "卡号" and r.feed("RD_1]") == card
    assert vault.placeholder("CARD", "other", "text with [CARD_2] in it") == "[CARD_3]"  # never the client's own
