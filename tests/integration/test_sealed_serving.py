"""Sealed models end to end: the CLI seals and verifies, the gateway serves them, tampering stops the start."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli import main as cli
from gateway.server import StartupError, build_app_and_config
from gateway.settings import load_settings
from security.keys import new_key_file
from security.tls import client_ssl_context
from tests.gateway_server import run_gateway
from tests.tiny_model import build_tiny_chat_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("sealed")
    clear = build_tiny_chat_model(root / "clear")
    key = root / "kek"
    new_key_file(key)
    assert cli(["seal", str(clear), str(root / "tiny-sealed"), "--key-provider", f"file:{key}"]) == 0
    return clear, root / "tiny-sealed", key


def answer(model: Path | None, home: Path, env: dict[str, str], max_tokens: int = 8) -> tuple[str, str]:
    with (
        run_gateway(home, model, env) as gw,
        openai.OpenAI(
            base_url=gw.url + "/v1",
            api_key=gw.token(),
            http_client=httpx.Client(verify=client_ssl_context(gw.pki.ca_cert)),
        ) as c,
    ):
        r = c.chat.completions.create(model=gw.model, messages=QUESTION, max_tokens=max_tokens, temperature=0)
        return gw.model, r.choices[0].message.content or ""


def test_sealed_directory_has_no_clear_weights(sealed: tuple[Path, Path, Path]) -> None:
    _, sealed_dir, _ = sealed
    names = {p.name for p in sealed_dir.iterdir()}
    assert "model.safetensors.sm4" in names and "model.safetensors" not in names and "tianmen-seal.json" in names


def test_gateway_serves_a_sealed_model_like_the_clear_one(sealed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    clear, sealed_dir, key = sealed
    _, want = answer(clear, tmp_path / "a", {})
    _, got = answer(sealed_dir, tmp_path / "b", {"TIANMEN_ENGINE_KEY_PROVIDER": f"file:{key}"})
    assert got == want and got
    f32 = {"TIANMEN_ENGINE_DTYPE": "float32"}  # two ranks add in another order: float32 keeps greedy tokens equal
    _, want = answer(clear, tmp_path / "c", f32)
    tp2 = {**f32, "TIANMEN_ENGINE_KEY_PROVIDER": f"file:{key}", "TIANMEN_ENGINE_TENSOR_PARALLEL_SIZE": "2"}
    _, got = answer(sealed_dir, tmp_path / "d", tp2)  # its worker process reopens the sealed model itself
    assert got == want and got


def test_verify_cli_and_tampering(
    sealed: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    _, sealed_dir, key = sealed
    assert cli(["unseal", "--verify", str(sealed_dir), "--key-provider", f"file:{key}"]) == 0
    bad = tmp_path / "bad"
    shutil.copytree(sealed_dir, bad)
    weights = bad / "model.safetensors.sm4"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli(["unseal", "--verify", str(bad), "--key-provider", f"file:{key}"]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "chunk" in err
    settings = load_settings(
        environ={
            "TIANMEN_HOME": str(tmp_path / "h"),
            "TIANMEN_ENGINE_MODEL": str(bad),
            "TIANMEN_ENGINE_KEY_PROVIDER": f"file:{key}",
        }
    )
    with pytest.raises(StartupError, match=r"model\.safetensors"):
        build_app_and_config(settings)
    new_key_file(tmp_path / "other-kek")
    settings.engine.model, settings.engine.key_provider = sealed_dir, f"file:{tmp_path / 'other-kek'}"
    with pytest.raises(StartupError, match="key"):
        build_app_and_config(settings)
    settings.engine.key_provider = None
    with pytest.raises(StartupError, match="key_provider"):
        build_app_and_config(settings)


def test_rewrap_moves_to_a_new_key(sealed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    import shutil

    _, sealed_dir, key = sealed
    moved = tmp_path / "moved"
    shutil.copytree(sealed_dir, moved)
    new_key_file(tmp_path / "new-kek")
    assert (
        cli(
            [
                "seal",
                "--rewrap",
                str(moved),
                "--key-provider",
                f"file:{key}",
                "--new-key-provider",
                f"file:{tmp_path / 'new-kek'}",
            ]
        )
        == 0
    )
    assert cli(["unseal", "--verify", str(moved), "--key-provider", f"file:{tmp_path / 'new-kek'}"]) == 0
    assert cli(["unseal", "--verify", str(moved), "--key-provider", f"file:{key}"]) == 1
    assert (moved / "model.safetensors.sm4").read_bytes() == (sealed_dir / "model.safetensors.sm4").read_bytes()


def test_demo_model_is_sealed_and_answers_paris(tmp_path: Path) -> None:
    name, text = answer(None, tmp_path / "home", {}, max_tokens=16)
    assert name == "SmolLM2-135M-Instruct" and "Paris" in text
    model_dir = tmp_path / "home" / "models" / name
    assert not list(model_dir.glob("*.safetensors")) and list(model_dir.glob("*.safetensors.sm4"))
