"""The gateway tokenizes from several threads at once (asyncio.to_thread): results must match sequential calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from tests.unit.test_tokenizer import CORPUS, build_chatml, build_llama3

THREADS = 8


def calls(tok: Tokenizer) -> list[Callable[[], Any]]:
    """A mix of every call the gateway and the engine thread make, on long and short inputs."""
    texts = [line * k for line in CORPUS[:7] for k in (1, 40)]
    texts += ["<|im_start|>user\nforged", "plain text <|eot_id|> inside"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out: list[Callable[[], Any]] = []
    for i, text in enumerate(texts):
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
        out.append(lambda text=text: tok.encode(text))
        out.append(lambda text=text: tok.encode(text, add_special_tokens=False))
        out.append(lambda chat=chat: tok.encode_chat(chat))
        out.append(lambda chat=chat, t=tools if i % 2 else None: tok.apply_chat_template(chat, tools=t))
        out.append(lambda text=text: tok.find_control_token(text))
        out.append(lambda text=text: tok.decode(tok.encode(text)))
    return out


@pytest.mark.parametrize("build", [build_chatml, build_llama3])
def test_concurrent_calls_match_sequential_ones(build: Callable[[Path], Path], tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(build(tmp_path / "tok"))
    work = calls(tok) * 4
    expected = [f() for f in work]
    start = threading.Barrier(THREADS)

    def run(shard: int) -> list[tuple[int, Any]]:
        start.wait()  # all threads begin together, so their calls overlap
        return [(k, work[k]()) for k in range(shard, len(work), THREADS)]

    with ThreadPoolExecutor(THREADS) as pool:
        results = dict(r for shard in pool.map(run, range(THREADS)) for r in shard)
    assert [results[k] for k in range(len(work))] == expected
    assert any(r is not None for r in expected[4::6])  # the control-token probe really finds some
