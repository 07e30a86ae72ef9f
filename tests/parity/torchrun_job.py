"""Run under torchrun by test_torchrun.py: every rank builds the same LLM; rank 0 writes the tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine import LLM, EngineConfig, SamplingParams


def main(model: str, out: str) -> None:
    config = EngineConfig(model=model, dtype="float32", device="cpu", tensor_parallel_size=2, max_num_seqs=4)
    with LLM(config) as llm:  # a rank other than 0 serves as a worker inside, and exits when rank 0 closes
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        done = llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)
        Path(out).write_text(
            json.dumps({"tokens": [c.token_ids for c in done], "ranks": len(llm.core.stats()["ranks"])})
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
