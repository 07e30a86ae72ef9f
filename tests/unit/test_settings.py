from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main as cli_main
from gateway.settings import SettingsError, load_settings


def test_defaults_need_no_config() -> None:
    s = load_settings(environ={})
    assert (s.server.host, s.server.port, s.home) == ("127.0.0.1", 8443, Path(".tianmen"))
    assert not s.auth.external and s.engine.model is None


def test_toml_then_environment_overrides(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text('home = "/srv/t"\n[server]\nport = 9000\n[engine]\nmax_num_seqs = 8\nenable_prefix_caching = false\n')
    s = load_settings(f, environ={"TIANMEN_SERVER_PORT": "9100", "TIANMEN_ENGINE_KV_CACHE_BYTES": "1048576"})
    assert s.home == Path("/srv/t") and s.server.port == 9100
    assert s.engine.max_num_seqs == 8 and s.engine.enable_prefix_caching is False
    assert s.engine.kv_cache_bytes == 1 << 20
    assert load_settings(f, environ={"TIANMEN_HOME": "/x"}).home == Path("/x")


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("[server]\nport = 'abc'\n", {}, "server.port: expected int"),
        ("[server]\nprot = 1\n", {}, "unknown setting server.prot"),
        ("[nope]\n", {}, "unknown setting 'nope'"),
        ("", {"TIANMEN_SERVER_PORT": "x"}, "TIANMEN_SERVER_PORT: expected int"),
        ("", {"TIANMEN_ENGINE_FOO": "1"}, "unknown setting TIANMEN_ENGINE_FOO"),
        ("[server]\nport = 70000\n", {}, "server.port must be in 1..65535"),
        ("[server]\ntls_cert = '/a'\n", {}, "tls_cert and server.tls_key go together"),
        ("[auth]\njwks_file = '/a'\njwks_url = 'https://x'\n", {}, "exclusive"),
        ("[server\n", {}, "config file"),
    ],
)
def test_bad_settings_name_the_setting(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    f = tmp_path / "t.toml"
    f.write_text(toml)
    with pytest.raises(SettingsError, match=message):
        load_settings(f, environ=env)


def test_token_cli_refuses_with_external_jwks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.toml"
    f.write_text(
        f'home = "{tmp_path}"\n[auth]\njwks_url = "https://idp.example.com/jwks.json"\nissuer = "i"\naudience = "a"\n'
    )
    assert cli_main(["token", "--config", str(f), "--sub", "a", "--tenant", "t"]) == 2
    assert "external key set" in capsys.readouterr().err


def test_token_cli_mints_a_verifiable_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from security.devpki import ensure_dev_pki
    from security.jwt import JWTConfig, JWTVerifier

    f = tmp_path / "t.toml"
    f.write_text(f'home = "{tmp_path}"\n')
    assert (
        cli_main(["token", "--config", str(f), "--sub", "bob", "--tenant", "t1", "--scope", "a b", "--ttl", "5m"]) == 0
    )
    token = capsys.readouterr().out.strip()
    pki = ensure_dev_pki(tmp_path)
    p = JWTVerifier(JWTConfig(jwks_file=pki.jwks, issuer="tianmen-dev", audience="tianmen")).verify_sync(token)
    assert (p.subject, p.tenant, p.scopes) == ("bob", "t1", frozenset({"a", "b"}))
