"""llguidance (what the engine uses) against xgrammar on this CPU: grammar compile time and per-step mask time.

    python -m benchmarks.grammar_engines [--model DIR]

xgrammar is not a dependency (it requires transformers and triton at run time): install it on the side, e.g.
`pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi` and run with PYTHONPATH=/tmp/xgr. Each engine
walks 32 matchers through the same JSON document token by token, filling a batch-32 mask at every token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.structured import SCHEMAS, demo_model

DOC = {"name": "Alice Smith", "age": 42, "email": "alice@example.com", "notes": "long-standing customer, no issues"}
BATCH = 32


def report(name: str, compile_ms: list[float], one: list[float], batch: list[float]) -> None:
    print(
        f"{name:10s} compile {statistics.median(compile_ms):6.2f} ms (median of {len(compile_ms)} schemas); "
        f"mask, one sequence: median {statistics.median(one) * 1e6:.1f} us; batch {BATCH}: median "
        f"{statistics.median(batch) * 1e3:.3f} ms, max {max(batch) * 1e3:.3f} ms"
    )


def llguidance_row(tokenizer_json: str, vocab: int, eos: int, ids: list[int]) -> None:
    import llguidance as llg
    import llguidance.torch as lt

    tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    opts: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compile_ms = []
    for s in SCHEMAS:
        t = time.perf_counter()
        llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(s, overrides=opts))
        compile_ms.append((time.perf_counter() - t) * 1e3)
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMAS[0], overrides=opts)
    matchers = [llg.LLMatcher(tok, grammar) for _ in range(BATCH + 1)]
    mask = lt.allocate_token_bitmask(BATCH + 1, vocab)
    executor = llg.LLExecutor(num_threads=1)
    one, batch = [], []
    for token in ids:
        t = time.perf_counter()
        lt.fill_next_token_bitmask(matchers[BATCH], mask, BATCH)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers[:BATCH])], mask)
        batch.append(time.perf_counter() - t)
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    report("llguidance", compile_ms, one, batch)


def xgrammar_row(model: Path, vocab: int, ids: list[int]) -> None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("xgrammar   not installed (see the module docstring)")
        return
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast.from_pretrained(model), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compile_ms = []
    for s in SCHEMAS:
        t = time.perf_counter()
        compiler.compile_json_schema(json.dumps(s), any_whitespace=False)
        compile_ms.append((time.perf_counter() - t) * 1e3)
    grammar = compiler.compile_json_schema(json.dumps(SCHEMAS[0]), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(BATCH + 1)]
    mask = xgr.allocate_token_bitmask(BATCH + 1, vocab)
    one, batch = [], []
    for token in ids:
        t = time.perf_counter()
        matchers[BATCH].fill_next_token_bitmask(mask, BATCH)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i, m in enumerate(matchers[:BATCH]):
            m.fill_next_token_bitmask(mask, i)
        batch.append(time.perf_counter() - t)
        for m in matchers:
            assert m.accept_token(token)
    report("xgrammar", compile_ms, one, batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    from engine.tokenizer import Tokenizer

    model = args.model or demo_model()
    tok = Tokenizer.from_dir(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    llguidance_row(tok.backend_json(), vocab, tok.eos_token_id or 0, ids)
    xgrammar_row(model, vocab, ids)


if __name__ == "__main__":
    main()
