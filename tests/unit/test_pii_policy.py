"""Policy tables from the TOML config, and what each action does to a text."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from gateway.errors import APIError
from gateway.privacy import build_privacy
from gateway.settings import SettingsError, load_settings
from gateway.state import RequestState
from security.pii_detectors import NAMES, detectors
from security.pii_policy import MaskRule, PolicyBook
from security.pii_redact import Vault, mask, redact
from security.pii_scan import Hit, Scanner
from tests import pii_samples as gen

KEEP = {d.name: d.keep for d in detectors()}


def test_default_is_audit_for_everything_and_tenants_lay_over_it() -> None:
    book = PolicyBook(NAMES, None, None, None, KEEP)
    assert set(book.default.prompt.actions.values()) == {"audit"} == set(book.default.completion.actions.values())
    book = PolicyBook(
        [*NAMES, "sensitive"],
        {"prompt": {"*": "mask", "email": "audit"}, "completion": {"bank_card": "block"}},
        {"bank": {"prompt": {"id_card": "tokenize"}}, "lab": {"prompt": {"*": "off"}}},
        {"bank_card": [4, 4]},
        KEEP,
    )
    d, bank, lab = book.default, book.for_tenant("bank"), book.for_tenant("lab")
    assert d.prompt.actions["id_card"] == "mask" and d.prompt.actions["email"] == "audit"
    assert bank.prompt.actions["id_card"] == "tokenize" and bank.prompt.actions["bank_card"] == "mask"
    assert bank.completion.actions["bank_card"] == "block" and lab.prompt.active() == frozenset()
    assert book.for_tenant("unknown") is d and book.for_tenant(None) is d
    assert d.prompt.mask["bank_card"] == MaskRule(4, 4) and d.prompt.mask["id_card"] == MaskRule(6, 4)


@pytest.mark.parametrize(
    "default,tenants,masks,message",
    [
        ({"prompt": {"bank_card": "hide"}}, None, None, "expected one of off, audit"),
        ({"prompt": {"cards": "mask"}}, None, None, "no such detector"),
        ({"answer": {}}, None, None, "expected prompt or completion"),
        ({"completion": {"id_card": "tokenize"}}, None, None, "tokenize applies to prompts"),
        (None, {"t": {"prompt": ["mask"]}}, None, "must be a table"),
        (None, {"t": "mask"}, None, "must be a table"),
        (None, None, {"bank_card": [6]}, "keep_first, keep_last"),
        (None, None, {"bank_card": [-1, 4]}, "keep_first, keep_last"),
        (None, None, {"bank_card": [True, 4]}, "keep_first, keep_last"),
        (None, None, {"nope": [1, 1]}, "no such detector"),
    ],
)
def test_bad_tables_are_refused_naming_the_entry(default: object, tenants: object, masks: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyBook(NAMES, default, tenants, masks, KEEP)  # type: ignore[arg-type]


def test_toml_config_builds_the_policy(tmp_path: Path) -> None:
    terms = tmp_path / "terms.txt"
    terms.write_text("内部代号\n", encoding="utf-8")
    config = tmp_path / "tianmen.toml"
    config.write_text(
        f"""
[privacy]
passport_pattern = "[A-Z]{{2}}[0-9]{{7}}"
term_lists = {{ sensitive = "{terms}" }}
mask = {{ bank_card = [6, 4] }}

[privacy.default]
prompt = {{ bank_card = "mask", sensitive = "block" }}

[privacy.tenants.bank.prompt]
id_card = "tokenize"
""",
        encoding="utf-8",
    )
    privacy = build_privacy(load_settings(config, environ={}).privacy)
    assert privacy.book.for_tenant("bank").prompt.actions["id_card"] == "tokenize"
    assert privacy.book.default.prompt.actions["sensitive"] == "block"
    assert privacy.lists["sensitive"].matcher.count == 1
    for bad, message in [
        ('term_lists = { bank_card = "x" }', "a name other than the detectors'"),
        ('term_lists = { t = "/nonexistent/terms.txt" }', "cannot read"),
        ('passport_pattern = "("', "not a valid regular expression"),
        ("terms_check_interval_s = 0", "must be > 0"),
        ("unknown = 1", "unknown setting privacy.unknown"),
    ]:
        config.write_text(f"[privacy]\n{bad}\n")
        with pytest.raises(SettingsError, match=message):
            build_privacy(load_settings(config, environ={}).privacy)


def test_mask_keeps_the_ends_and_separators() -> None:
    assert mask("6222021234567890", MaskRule(6, 4)) == "622202******7890"
    assert mask("6222 0212 3456 7890", MaskRule(6, 4)) == "6222 02** **** 7890"
    assert mask("１３８１２３４５６７８", MaskRule(3, 4)) == "１３８****５６７８"
    assert mask("abc", MaskRule(2, 2)) == "***"  # the ends would be everything: all of it is hidden
    assert mask("alice@x.cn", MaskRule(1, 0)) == "a****@*.**"


def test_overlaps_hide_every_character_and_the_strongest_action_wins() -> None:
    pol = PolicyBook(
        [*NAMES, "t"], {"prompt": {"bank_card": "mask", "id_card": "audit", "t": "tokenize"}}, None, None, KEEP
    ).default.prompt
    x = gen.id18(random.Random(0))
    same = [Hit(0, 18, "id_card", 0, "ID"), Hit(0, 18, "bank_card", 2, "CARD")]  # an ID that also passes Luhn
    r = redact(x, same, pol, None)
    assert r.text == mask(x, MaskRule(6, 4)) and dict(r.fired) == {("bank_card", "mask"): 1}
    text = "abcdefghij"
    r = redact(text, [Hit(0, 6, "bank_card", 2, "CARD"), Hit(4, 10, "t", 9, "TERM")], pol, Vault())
    assert r.text == "[TERM_1]" and dict(r.fired) == {("bank_card", "tokenize"): 1, ("t", "tokenize"): 1}


def test_tokenize_gives_each_value_one_placeholder() -> None:
    pol = PolicyBook(NAMES, {"prompt": {"*": "tokenize"}}, None, None, KEEP).default.prompt
    scanner = Scanner(detectors())
    rng = random.Random(1)
    a, b = gen.card(rng), gen.card(rng)
    text = f"卡{a}和卡{b}，再说一遍{a}"
    vault = Vault()
    r = redact(text, scanner.scan(text)[0], pol, vault)
    assert r.text == "卡[CARD_1]和卡[CARD_2]，再说一遍[CARD_1]"
    assert vault.restore(r.text) == text and dict(r.fired) == {("bank_card", "tokenize"): 3}


def test_the_documented_examples_are_valid_configs(tmp_path: Path) -> None:
    """Every ```toml block of README.md and docs/PRIVACY.md with a [privacy] table builds (term files stubbed)."""
    import re

    root = Path(__file__).resolve().parents[2]
    terms = tmp_path / "terms.txt"
    terms.write_text("内部代号\n", encoding="utf-8")
    blocks = []
    for doc in ("README.md", "docs/PRIVACY.md"):
        text = (root / doc).read_text(encoding="utf-8")
        blocks += [b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if "[privacy" in b]
    assert len(blocks) >= 3
    for block in blocks:
        table = block[block.index("[privacy") :]  # the [privacy] tables are last in each block
        config = tmp_path / "c.toml"
        config.write_text(re.sub(r'"/etc/tianmen/terms.txt"', f'"{terms}"', table), encoding="utf-8")
        privacy = build_privacy(load_settings(config, environ={}).privacy)
        assert privacy.book.default.prompt.actions


def test_sessions_share_scanners_until_a_term_list_changes(tmp_path: Path) -> None:
    terms = tmp_path / "terms.txt"
    terms.write_text("内部代号\n", encoding="utf-8")
    config = tmp_path / "tianmen.toml"
    config.write_text(
        f'[privacy]\nterm_lists = {{ sensitive = "{terms}" }}\n[privacy.default]\nprompt = {{ sensitive = "block" }}\n',
        encoding="utf-8",
    )
    privacy = build_privacy(load_settings(config, environ={}).privacy)
    first, again = (privacy.session("acme", RequestState("r")) for _ in range(2))
    assert first.prompt_scanner is again.prompt_scanner  # built once per policy and term-list version
    assert privacy.session("bank", RequestState("r")).prompt_scanner is first.prompt_scanner  # same default policy
    time.sleep(0.01)
    terms.write_text("新词\n", encoding="utf-8")
    os.utime(terms, (time.time() + 5, time.time() + 5))  # a new mtime whatever the filesystem's resolution
    assert privacy.lists["sensitive"].refresh()
    after = privacy.session("acme", RequestState("r"))
    assert after.prompt_scanner is not first.prompt_scanner
    assert after.screen_text("内部代号", "messages") == "内部代号"  # the new version is what scans
    with pytest.raises(APIError, match="sensitive"):
        after.screen_text("新词", "messages")
