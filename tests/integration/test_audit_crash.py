"""A real gateway process SIGKILLed mid-stream: the answered request's opening record is in the spool, and
`tianmen audit verify --spool` reports it as interrupted (not as tampering) with exit status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from security.devpki import ensure_dev_pki, mint_token
from tests.audit_spool import spooled
from tests.gateway_server import free_port
from tests.tiny_model import build_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]


def test_sigkill_mid_stream_leaves_the_opening_record_and_verify_says_interrupted(tmp_path: Path) -> None:
    model = build_tiny_chat_model(tmp_path / "m")
    port, spool = free_port(), tmp_path / "spool"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TIANMEN_HOME": str(tmp_path / "home"),
        "TIANMEN_ENGINE_MODEL": str(model),
        "TIANMEN_ENGINE_DTYPE": "float32",
        "TIANMEN_AUDIT_SPOOL_DIR": str(spool),
        "TIANMEN_SERVER_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--insecure-http", "--port", str(port)]
    with open(tmp_path / "gateway.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the gateway did not come up"
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pki = ensure_dev_pki(tmp_path / "home")  # the one the server made at start
        token = mint_token(pki.jwt_key, pki.kid, sub="crash", tenant="acme")
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
        body["model"] = models["data"][0]["id"]
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the client has bytes of the answer
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    mine = [r for r in spooled(spool) if r["event"]["id"] == rid]
    assert [r["tianmen"]["phase"] for r in mine] == ["open"]  # durable before the first byte; no close: killed
    assert mine[0]["user"]["id"] == "crash" and mine[0]["http"]["response"]["status_code"] == 200

    verify = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "audit", "verify", "--spool"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith("OK") and "1 interrupted request(s)" in verify.stdout
    assert f"event {rid}" in verify.stdout and "opened, never closed" in verify.stdout
