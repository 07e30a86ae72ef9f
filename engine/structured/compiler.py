"""GrammarCompiler: StructuredOutputs → a compiled llguidance grammar, cached by its canonical key.

Compiling runs in whatever thread calls it (AsyncEngine: a worker thread, never the step thread); llguidance
drops the GIL while it builds. A grammar that cannot be built is an InvalidRequestError naming the problem.
Each request gets its own matcher, a copy of the cached grammar's (copying is microseconds; building is
milliseconds). Why llguidance over xgrammar: see docs/ARCHITECTURE.md ("Structured outputs").
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
MAX_ERROR_CHARS = 500
# JSON the way OpenAI's structured outputs print it, and no freedom beyond: flexible whitespace would let a
# model pad with newlines until max_tokens
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own defaults, written out because they bound what one request's grammar may cost per step
# (step fuel ~14k/ms, step items ~20k/ms on a desktop core): a grammar past them ends its request, no one else's
LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}


class Grammar:
    """A compiled grammar; `matcher()` is a fresh matcher for one request."""

    __slots__ = ("_proto", "kind")

    def __init__(self, proto: llguidance.LLMatcher, kind: str) -> None:
        self._proto, self.kind = proto, kind

    def matcher(self) -> llguidance.LLMatcher:
        return self._proto.deep_copy()


class GrammarCompiler:
    """One model's grammars: its tokenizer (the token trie llguidance walks, built on first use) and the cache."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.5 s for a 50k vocabulary); concurrent first callers wait for it
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> Grammar:
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._build(spec)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: StructuredOutputs) -> Grammar:
        tokenizer = self.tokenizer()
        source = _grammar_text(spec)
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer, limits=self._limits)
        if error:
            raise _refused(spec, messages[0] if messages else "invalid")
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise _refused(spec, matcher.get_error())
        return Grammar(matcher, spec.kind)


def _grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) for `spec`."""
    kind = spec.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise _refused(spec, str(e)) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        # each choice a Lark string literal: JSON string syntax, so quotes and backslashes stay literal
        options = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or ())
        return llguidance.LLMatcher.grammar_from_lark(f"start: {options}")
    try:
        lark = any_to_lark(spec.grammar or "")  # GBNF (vLLM's and llama.cpp's EBNF) becomes Lark; Lark stays
    except Exception as e:  # WHY: the converter raises bare Exception too (no root rule, an unknown rule)
        raise _refused(spec, f"not a valid GBNF grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _refused(spec: StructuredOutputs, why: str) -> InvalidRequestError:
    why = " ".join(why.split())[:MAX_ERROR_CHARS]
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}.get(spec.kind, "schema")
    return InvalidRequestError(f"{spec.field}: this {what} cannot be used for structured output: {why}", spec.field)
