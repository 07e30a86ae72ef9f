"""The torchrun path: two ranks started by torchrun (env:// rendezvous) serve TP=2 as the engine's own workers do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine import LLM, EngineConfig, SamplingParams
from tests.gateway_server import free_port
from tests.parity.conftest import build_llama

WAIT_S = 300  # a generous bound: the test fails rather than hangs


def test_torchrun_ranks_match_tp1(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "m")
    with LLM(EngineConfig(model=model, dtype="float32", device="cpu", max_num_seqs=4)) as llm:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        expected = [c.token_ids for c in llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)]
    out = tmp_path / "out.json"
    job = Path(__file__).with_name("torchrun_job.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(job), str(model), str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WAIT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result == {"tokens": expected, "ranks": 2}
