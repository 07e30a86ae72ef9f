"""One request's detokenizing failure ends that request alone; stop strings and core failures pass through."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from engine.output_processor import OutputProcessor
from engine.outputs import EngineOutput, Usage
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.unit.test_tokenizer import build_chatml


class BrokenOn(Tokenizer):
    """A real tokenizer whose decode raises for windows holding one token id."""

    def __init__(self, inner: Tokenizer, bad_id: int) -> None:
        self.__dict__.update(inner.__dict__)
        self.bad_id = bad_id

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.bad_id in ids:
            raise UnicodeDecodeError("utf-8", b"secret", 0, 1, "injected")
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_chatml(tmp_path_factory.mktemp("tok") / "chatml"))


def test_a_detokenizer_fault_ends_only_its_request(tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    hello, world = tok.encode("Hello"), tok.encode(" world")
    bad = world[0]
    proc = OutputProcessor(BrokenOn(tok, bad))
    usage = Usage(1, 1)
    proc.add("ok", hello, SamplingParams())
    proc.add("bad", hello, SamplingParams())
    caplog.set_level(logging.ERROR)
    deltas, endings = proc.process(
        [EngineOutput("ok", hello[:1], None, None, usage), EngineOutput("bad", [bad], None, None, usage)]
    )
    assert [(d.req_id, d.finish_reason) for d in deltas] == [("ok", None), ("bad", "error")]
    assert deltas[0].new_text == tok.decode(hello[:1])
    assert endings == [("bad", "error", None)]  # the caller finishes it in the core
    assert "request bad failed while detokenizing (UnicodeDecodeError)" in caplog.text and "secret" not in caplog.text
    assert "bad" not in proc.detok and "ok" in proc.detok


def test_core_failures_and_stop_strings_come_through(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    proc = OutputProcessor(tok)
    proc.add("failed", ids, SamplingParams())
    proc.add("stopped", ids[:1], SamplingParams(stop=[tok.decode(ids[1:2]).strip()]))
    deltas, endings = proc.process(
        [
            EngineOutput("failed", [], None, "error", Usage(2, 0)),
            EngineOutput("stopped", ids[1:2], None, None, Usage(1, 1)),
        ]
    )
    assert [(d.req_id, d.finish_reason) for d in deltas] == [("failed", "error"), ("stopped", "stop")]
    assert endings == [("stopped", "stop", tok.decode(ids[1:2]).strip())]
    assert proc.detok == {}
