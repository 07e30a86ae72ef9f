"""External identity providers: issuer and audience are required unless a setting says the IdP has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import SettingsError, load_settings

JWKS = {"TIANMEN_AUTH_JWKS_URL": "https://idp.example.com/jwks.json"}


@pytest.mark.parametrize(
    "source",
    [JWKS, {"TIANMEN_AUTH_JWKS_FILE": "/etc/jwks.json"}, {"TIANMEN_AUTH_HS256_SECRET_FILE": "/run/secrets/hs"}],
    ids=["jwks_url", "jwks_file", "hs256"],
)
@pytest.mark.parametrize("missing", ["issuer", "audience"])
def test_external_mode_refuses_to_start_without_issuer_or_audience(source: dict[str, str], missing: str) -> None:
    env = {**source, "TIANMEN_AUTH_ISSUER": "https://idp", "TIANMEN_AUTH_AUDIENCE": "tianmen"}
    del env[f"TIANMEN_AUTH_{missing.upper()}"]
    with pytest.raises(SettingsError, match=rf"auth\.{missing} is required.*auth\.allow_missing_{missing} = true"):
        load_settings(environ=env)


def test_explicit_settings_allow_an_idp_without_issuer_or_audience(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(
        '[auth]\njwks_url = "https://idp.example.com/jwks.json"\nallow_missing_issuer = true\n'
        "allow_missing_audience = true\n"
    )
    s = load_settings(f, environ={})
    assert s.auth.issuer is None and s.auth.audience is None and s.auth.external
    with pytest.raises(SettingsError, match=r"auth\.audience is required"):
        load_settings(f, environ={"TIANMEN_AUTH_ALLOW_MISSING_AUDIENCE": "false"})
    assert load_settings(environ={**JWKS, "TIANMEN_AUTH_ISSUER": "i", "TIANMEN_AUTH_AUDIENCE": "a"}).auth.external


def test_dev_mode_needs_neither() -> None:
    s = load_settings(environ={})
    assert not s.auth.external and s.auth.issuer is None
