"""Sensitive-term lists: matched through spacing, punctuation, case and full-width forms; reloaded on change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from security.pii_terms import MAX_TERM_CHARS, TermList, TermListError, TermMatcher
from security.pii_text import normalize


def terms_in(matcher: TermMatcher, text: str) -> list[str]:
    hits, hold = matcher.find(normalize(text))
    assert hold == len(text)
    norm = normalize(text)
    return [text[slice(*norm.span(h.start, h.end))] for h in hits]


def test_terms_survive_spacing_punctuation_case_and_width() -> None:
    m = TermMatcher(["内部代号", "Project Falcon", "绝密"])
    assert terms_in(m, "这是内部代号，不要外传") == ["内部代号"]
    assert terms_in(m, "这是内 部-代.号，不要外传") == ["内 部-代.号"]
    assert terms_in(m, "这是内\u200b部\u3000代号") == ["内\u200b部\u3000代号"]  # zero-width and ideographic space
    assert terms_in(m, "about project-falcon today") == ["project-falcon"]
    assert terms_in(m, "ＰＲＯＪＥＣＴ　ＦＡＬＣＯＮ!") == ["ＰＲＯＪＥＣＴ　ＦＡＬＣＯＮ"]
    assert terms_in(m, "绝 密！绝密") == ["绝 密", "绝密"]
    assert terms_in(m, "内部 代码") == []


def test_a_term_that_is_only_punctuation_or_too_long_is_skipped() -> None:
    m = TermMatcher(["...", "  ", "x" * (MAX_TERM_CHARS + 1), "ok"])
    assert m.count == 1


def test_tail_that_begins_a_term_is_held() -> None:
    m = TermMatcher(["内部代号"])
    text = "这是内 部"
    hits, hold = m.find(normalize(text), 0, final=False)
    assert hits == [] and text[hold:] == "内 部"
    hits, hold = m.find(normalize("这是内容"), 0, final=False)
    assert hold == 4


def test_thousands_of_terms_build_and_match() -> None:
    terms = [f"敏感词{i:05d}" for i in range(10_000)]
    m = TermMatcher(terms)
    assert m.count == 10_000
    assert terms_in(m, "前文敏感词 04242 后文") == ["敏感词 04242"]


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def test_file_reload_on_change_and_bad_versions_keep_the_old(tmp_path: Path) -> None:
    f = tmp_path / "terms.txt"
    _write(f, "\ufeff# comment\n甲乙\n\n丙丁\n")
    tl = TermList("sensitive", f)
    assert tl.matcher.count == 2 and tl.refresh() is False
    old = tl.matcher
    _write(f, "甲乙\n戊己\n庚辛\n")
    assert tl.refresh() is True and tl.matcher.count == 3 and tl.matcher is not old
    assert terms_in(old, "戊己") == [] and terms_in(tl.matcher, "戊己") == ["戊己"]  # a request keeps its version
    current = tl.matcher
    f.write_bytes(b"\xff\xfe bad")
    assert tl.refresh() is False and tl.matcher is current
    f.unlink()
    assert tl.refresh() is False and tl.matcher is current
    _write(f, "新词\n")
    assert tl.refresh() is True and terms_in(tl.matcher, "新 词") == ["新 词"]


def test_unreadable_file_at_start_is_refused_without_its_content(tmp_path: Path) -> None:
    with pytest.raises(TermListError, match="cannot read"):
        TermList("x", tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes("秘密".encode("gbk"))
    with pytest.raises(TermListError, match="not UTF-8") as e:
        TermList("x", bad)
    assert "秘密" not in str(e.value)


def test_overlapping_occurrences_become_one_span_each_region() -> None:
    m = TermMatcher(["aaaa", "内部", "部代号"])
    assert terms_in(m, "a" * 5000) == ["a" * 5000]  # every position holds the term: one span, not 4,997 hits
    assert terms_in(m, "x内部代号y内部z") == ["内部代号", "内部"]
    assert terms_in(m, "aaa-a b aaaa") == ["aaa-a", "aaaa"]  # ignored characters join what they separate
