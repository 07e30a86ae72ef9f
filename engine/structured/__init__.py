"""Structured outputs: a request's grammar (JSON schema, regex, choice, Lark) compiled once by llguidance, a
matcher per request, and each step's token bitmask that the sampler applies before it picks a token."""

from engine.structured.bitmask import GrammarMask, fill_masks
from engine.structured.compiler import Grammar, GrammarCompiler
from engine.structured.spec import StructuredOutputs

__all__ = ["Grammar", "GrammarCompiler", "GrammarMask", "StructuredOutputs", "fill_masks"]
