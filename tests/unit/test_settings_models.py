"""[[models]] tables, [aliases] and warm-up prompts: what they resolve to, and refusals that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.models import ModelRegistry, ServedModel
from gateway.settings import SettingsError, WarmupPrompt, load_settings
from security.principal import Principal

TWO = """
[engine]
max_num_seqs = 4
dtype = "float32"

[[models]]
name = "a"
path = "/m/a"
warmup_tenants = ["acme"]
warmup_prompts = ["Be brief.", { tenants = ["globex"], messages = [{ role = "system", content = "x" }] }]

[[models]]
name = "b"
max_num_seqs = 8
[models.ratelimit]
requests_per_minute = 5

[aliases]
chat = "a"
"""


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    f = tmp_path / "t.toml"
    f.write_text(text)
    return load_settings(f, environ=env or {})


def test_models_take_engine_defaults_and_their_own_knobs(tmp_path: Path) -> None:
    s = load(tmp_path, TWO, {"TIANMEN_ENGINE_MAX_MODEL_LEN": "256"})
    a, b = s.served_models()
    assert (a.name, a.engine.model, a.engine.served_model_name, a.engine.max_num_seqs) == ("a", Path("/m/a"), "a", 4)
    assert (b.name, b.engine.model, b.engine.max_num_seqs) == ("b", None, 8)  # no path: the demo model
    assert a.engine.max_model_len == b.engine.max_model_len == 256 and b.engine.dtype == "float32"
    assert a.warmup_prompts == [
        WarmupPrompt(["acme"], system="Be brief."),
        WarmupPrompt(["globex"], messages=[{"role": "system", "content": "x"}]),
    ]
    assert b.ratelimit == {"requests_per_minute": 5} and s.aliases == {"chat": "a"}


def test_without_models_the_engine_section_is_the_one_model(tmp_path: Path) -> None:
    s = load(tmp_path, "[engine]\nmodel = '/m/x'\nserved_model_name = 'x1'\n")
    (only,) = s.served_models()
    assert only.name == "x1" and only.engine.model == Path("/m/x") and only.warmup_prompts == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[models]]\npath = '/m'\n", r"models\[0\]\.name"),
        ("[[models]]\nname = 'a'\n[[models]]\nname = 'a'\n", "named 'a'"),
        ("[[models]]\nname = 'a'\nmodel = '/m'\n", r"unknown setting models\['a'\]\.model"),
        ("[[models]]\nname = 'a'\nmax_num_seqs = 'many'\n", r"models\['a'\]\.max_num_seqs: expected int"),
        ("[engine]\nmodel = '/m'\n[[models]]\nname = 'a'\n", "engine.model"),
        ("[[models]]\nname = 'a'\n[aliases]\nb = 'c'\n", "no served model is named 'c'"),
        ("[[models]]\nname = 'a'\n[aliases]\na = 'a'\n", "already a served model"),
        ("[[models]]\nname = 'a'\nwarmup_prompts = ['x']\n", "name the tenants"),
        ("[[models]]\nname = 'a'\nwarmup_prompts = [{ tenants = ['t'] }]\n", "exactly one of"),
        ("[[models]]\nname = 'a'\nwarmup_prompts = [{ tenants = ['t'], system = '' }]\n", "non-empty string"),
        ("[[models]]\nname = 'a'\nwarmup_prompts = [{ tenants = ['t'], messages = [{ role = 1 }] }]\n", "messages"),
        (
            "[[models]]\nname = 'a'\nenable_prefix_caching = false\n"
            "warmup_prompts = [{ tenants = ['t'], prompt = 'p' }]\n",
            "enable_prefix_caching",
        ),
        (
            "[server]\nprefix_cache_per_subject = true\n[[models]]\nname = 'a'\n"
            "warmup_prompts = [{ tenants = ['t'], prompt = 'p' }]\n",
            "prefix_cache_per_subject",
        ),
        ("[[models]]\nname = '" + "x" * 257 + "'\n", "at most 256"),
        ("models = 3\n", "array of tables"),
        ("[server]\nmax_model_memory_bytes = 0\n", "max_model_memory_bytes"),
    ],
)
def test_bad_model_settings_name_the_setting(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load(tmp_path, text)


def test_the_model_env_override_cannot_sneak_past_models(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="TIANMEN_ENGINE_MODEL"):
        load(tmp_path, "[[models]]\nname = 'a'\n", {"TIANMEN_ENGINE_MODEL": "/m"})


class Engine:
    def __init__(self, name: str) -> None:
        self.model_name, self.ready, self.healthy = name, True, True


def test_registry_resolves_aliases_and_checks_tokens_by_every_name() -> None:
    reg = ModelRegistry([ServedModel("a", Engine("a")), ServedModel("b", Engine("b"))], {"chat": "a"})
    assert reg.resolve("chat") is reg.resolve("a") and reg.resolve("c") is None and reg.first.name == "a"
    only_chat = Principal("u", "t", frozenset(), frozenset({"chat"}), None)
    assert reg.allowed(only_chat, reg.models["a"]) and not reg.allowed(only_chat, reg.models["b"])
    reg.models["b"].engine.ready = False
    assert not reg.ready and reg.healthy
    with pytest.raises(ValueError, match="not served"):
        ModelRegistry([ServedModel("a", Engine("a"))], {"x": "nope"})
