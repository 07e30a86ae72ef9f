"""The identifier detectors: generated valid identifiers are found in Chinese and English text, in full-width
digits, with spaces and dashes; wrong check characters and random digit runs are not."""

from __future__ import annotations

import random

import pytest

from security.pii_checks import id_check_char, luhn_ok, valid_id15, valid_id18, valid_uscc
from security.pii_detectors import BANK_CARD, detectors, passport
from security.pii_scan import Scanner
from tests import pii_samples as gen

SCANNER = Scanner(detectors())
TEMPLATES = [
    "客户的{kind}是{x}，请核实。",
    "请把{x}这个{kind}记下来",
    "My {kind} is {x}.",
    "({x}) was the {kind} on file",
    "{x}",
]


def found(text: str, scanner: Scanner = SCANNER) -> list[tuple[str, str]]:
    """(detector, matched text); of hits on one span the first detector's, as `redact` breaks equal actions."""
    hits, hold = scanner.scan(text)
    assert hold == len(text)
    first: dict[tuple[int, int], object] = {}
    for h in sorted(hits, key=lambda h: h.rank):
        first.setdefault((h.start, h.end), h)
    return sorted((h.policy, text[h.start : h.end]) for h in first.values())  # type: ignore[attr-defined]


def test_published_examples_check() -> None:
    assert valid_id18("11010519491231002X") and valid_id18("11010519491231002x")  # GB 11643's own example
    assert valid_uscc("91350100M000100Y43")
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert id_check_char("11010519491231002") == "X"


@pytest.mark.parametrize(
    "kind,make",
    [
        ("id_card", gen.id18),
        ("id_card", gen.id15),
        ("bank_card", lambda r: gen.card(r, 16)),
        ("bank_card", lambda r: gen.card(r, 19)),
        ("uscc", gen.uscc),
        ("mobile", gen.mobile),
    ],
)
def test_valid_identifiers_are_found_in_sentences(kind: str, make: object) -> None:
    rng = random.Random(kind)
    for _ in range(60):
        x = make(rng)  # type: ignore[operator]
        for t in TEMPLATES:
            text = t.format(kind=kind, x=x)
            assert found(text) == [(kind, x)], text
            wide = t.format(kind=kind, x=gen.fullwidth(x))  # ４１１１… : NFKC, offsets back in the original
            assert found(wide) == [(kind, gen.fullwidth(x))], wide


def test_cards_with_spaces_and_dashes() -> None:
    rng = random.Random(1)
    for length in (16, 17, 18, 19):
        for _ in range(30):
            x = gen.card(rng, length)
            for sep in (" ", "-"):
                g = gen.grouped(x, sep)
                assert found(f"卡号：{g}。") == [("bank_card", g)]
                assert found(f"card {gen.fullwidth(g)} ok") == [("bank_card", gen.fullwidth(g))]
    assert found("6222-0212 3456 7890") == []  # mixed separators are not a grouping


def test_ids_with_separators_and_phones() -> None:
    rng = random.Random(2)
    x = gen.id18(rng)
    assert found(f"证件 {x[:6]} {x[6:14]} {x[14:]} 有效") == [("id_card", f"{x[:6]} {x[6:14]} {x[14:]}")]
    assert found(f"证件 {x[:6]}-{x[6:14]}-{x[14:]}") == [("id_card", f"{x[:6]}-{x[6:14]}-{x[14:]}")]
    m = gen.mobile(rng)
    for shown in (m, f"{m[:3]} {m[3:7]} {m[7:]}", f"{m[:3]}-{m[3:7]}-{m[7:]}"):
        for prefix in ("", "+86 ", "+86", "86-", "0086 "):
            text = f"电话{prefix}{shown}转人工"
            assert found(text) == [("mobile", shown)], text  # the country code is matched, not part of the hit
    for tel in ("010-62345678", "(021)61234567", "0755 8888 1234", "0571-8765432"):
        assert found(f"座机：{tel}，工作日") == [("landline", tel)]


def test_email_ipv4_passport() -> None:
    assert found("请联系 zhang.san+bank@example.com.cn 或 10.20.30.40。") == [
        ("email", "zhang.san+bank@example.com.cn"),
        ("ipv4", "10.20.30.40"),
    ]
    assert found("ＥＭＡＩＬ：ａｂｃ＠ｘｙ．ｃｏｍ") == [("email", "ａｂｃ＠ｘｙ．ｃｏｍ")]
    assert found("version 1.2.3.4.5 and 256.1.1.1 and 1.2.3") == []
    assert found("护照号E12345678，旧护照G87654321，新版EA1234567") == [
        ("passport", "E12345678"),
        ("passport", "EA1234567"),
        ("passport", "G87654321"),
    ]
    custom = Scanner([passport(r"[A-Z]{2}[0-9]{7}")])
    assert found("passport AB1234567 / E12345678", custom) == [("passport", "AB1234567")]
    for bad in ("(", "", "x?"):
        with pytest.raises(ValueError):
            passport(bad)


def test_wrong_check_characters_are_not_identifiers() -> None:
    rng = random.Random(3)
    for _ in range(200):
        x = gen.id18(rng)
        bad = gen.wrong_last(x)
        assert not valid_id18(bad)
        assert ("id_card", bad) not in found(f"身份证{bad}号")
        c = gen.wrong_last(gen.card(rng, 16))
        assert found(f"卡号{c}") == []
        u = gen.wrong_last(gen.uscc(rng), "0123456789ABCDEFGHJKLMNPQRTUWXY")
        assert ("uscc", u) not in found(f"代码{u}")


def test_impossible_birth_dates_are_not_ids() -> None:
    for first17 in ("11010519990230123", "11010520991231123", "11010518791231123"):  # Feb 30, future, 1879
        assert not valid_id18(first17 + id_check_char(first17))
    assert not valid_id15("110105990230123") and valid_id15("110105990228123")


def test_boundaries_a_card_inside_a_longer_number_is_not_one() -> None:
    x = gen.card(random.Random(4), 16)
    longer = next(x + d for d in "0123456789" if not luhn_ok(x + d))  # 17 digits that are not a card
    assert found(f"订单号{longer}") == []
    assert found(f"ref A{x}") == [] and found(f"{x}B") == []
    assert found(f"{x}号") == [("bank_card", x)]


def test_random_luhn_invalid_digit_runs_are_never_cards() -> None:
    """The false-positive rate of the card detector on 12,000 random 16-19 digit runs that fail Luhn: 0."""
    rng = random.Random(5)
    card_only = Scanner([BANK_CARD])
    runs = [gen.luhn_invalid(rng, rng.randint(16, 19)) for _ in range(12_000)]
    false_positives = sum(bool(card_only.scan(f"编号{r}，")[0]) for r in runs)
    false_positives += sum(bool(card_only.scan(gen.grouped(r, " "))[0]) for r in runs[:3000])
    assert false_positives == 0
    # and with every detector on, none of them is called a card (an 18-digit run may be a valid ID or code)
    assert not any(h.policy == "bank_card" for r in runs for h in SCANNER.scan(r)[0])


def test_random_short_digit_runs_are_nothing() -> None:
    rng = random.Random(6)
    for _ in range(3000):
        n = rng.choice([3, 4, 5, 6, 8, 9, 10])
        run = rng.choice("23456789") + "".join(rng.choice("0123456789") for _ in range(n - 1))
        assert found(f"金额{run}元") == [], run


@pytest.mark.parametrize("short_text", [0, 4096])  # anchors found by numpy (long texts) or by a regex (short)
def test_searching_only_the_zones_finds_what_searching_everything_finds(short_text: int, monkeypatch) -> None:
    """The scanner searches around digit runs and "@"s only; on mixed text it must agree with a full search."""
    from security import pii_scan
    from security.pii_text import normalize

    monkeypatch.setattr(pii_scan, "SHORT_TEXT", short_text)

    rng = random.Random(7)
    pieces = [
        lambda: gen.card(rng, rng.randint(16, 19)),
        lambda: gen.grouped(gen.card(rng), rng.choice(" -")),
        lambda: gen.id18(rng),
        lambda: gen.id15(rng),
        lambda: gen.uscc(rng),
        lambda: "+86 " + gen.mobile(rng),
        lambda: "(010)62345678",
        lambda: "a.b-c@ex-ample.com.cn",
        lambda: "E12345678",
        lambda: "192.168.1.1.5",
        lambda: "10.0.0.1",
        lambda: gen.luhn_invalid(rng, 17),
        lambda: str(rng.randrange(10**6)),
        lambda: rng.choice(["，", "。", " ", "abc", "客户", "-", "@", ".", "x" * 30, "1" * 40]),
        lambda: rng.choice(["What is the capital of France?", "no digits here", "中文的句子"]),
    ]
    for _ in range(300):
        text = "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 12)))
        text = gen.fullwidth(text) if rng.random() < 0.2 else text
        norm = normalize(text)
        expected = set()
        for rank, det in enumerate(SCANNER.detectors):
            core = "id" if "id" in det.pattern.groupindex else 0
            for m in det.pattern.finditer(norm.text):
                if det.validate(m.group(core)):
                    expected.add((*norm.span(*m.span(core)), det.name, rank))
        got = {(h.start, h.end, h.policy, h.rank) for h in SCANNER.scan(text)[0]}
        assert got == expected, text
