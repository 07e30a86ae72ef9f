"""What every tool-call format provides: a scan of the model's text into plain text and calls (finished or
still being written), and the Lark grammar that makes a model write one (tool_choice required or named)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

# llguidance's JSON options inside a grammar: OpenAI's formatting, no free whitespace (a model could pad forever)
X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class CallPiece:
    """One tool call in the model's text. `arguments` only grows while the call is being written (a stream sends
    it in fragments), and is all of it once `complete`. An invalid call's `raw` text is returned as content."""

    raw: str
    name: str | None = None  # known once its string is complete
    arguments: str = ""  # the JSON text of the arguments so far
    complete: bool = False
    valid: bool = False  # complete, a name, and arguments that are a JSON object


@dataclass(slots=True, frozen=True)
class Markup:
    """The format's own text around calls ([TOOL_CALLS][, separators): content only where no call is found."""

    text: str


# text outside any call, markup, or a call: the pieces of a final scan join to the whole text, losslessly
Piece = str | Markup | CallPiece


@dataclass(slots=True, frozen=True)
class FunctionSpec:
    name: str
    parameters: dict[str, Any] | None


Literal = Callable[[str], str]  # a marker as a Lark terminal: a quoted string, or <[id]> for a special token


class ToolParser(ABC):
    name: ClassVar[str]
    # True where the format's markers are special tokens, which the detokenizer drops unless told otherwise
    show_special_tokens: ClassVar[bool] = False
    # the marker strings the format uses, for choosing it from a model's vocabulary
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, has_token: Callable[[str], bool] = lambda _: False) -> None:
        self.has_token = has_token  # whether the model's vocabulary has this string as one token

    @abstractmethod
    def scan(self, text: str, final: bool) -> list[Piece]:
        """`text` as pieces in order. Not final: a trailing piece may be unfinished, and text that could be the
        start of a marker is held back (it is in no piece yet)."""

    @abstractmethod
    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool, lit: Literal) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is a valid call of one of `functions`."""


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark `%json` body for `schema`, formatted as X_GUIDANCE says."""
    return "%json " + json.dumps({**schema, "x-guidance": X_GUIDANCE}, ensure_ascii=False)


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others, unless it says otherwise.

    A function's parameters are the ones it declares: JSON Schema's default (any other key allowed) would let a
    model invent keys until max_tokens, and OpenAI's strict mode requires additionalProperties false anyway."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def parameters(function: FunctionSpec) -> dict[str, Any]:
    return closed(function.parameters) if function.parameters else NO_PARAMETERS


def call_schema(function: FunctionSpec, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON object {"name": ..., "<arguments_key>": ...} of a call of `function`, name first."""
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: parameters(function)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def alternatives(functions: Sequence[FunctionSpec], rule: Callable[[FunctionSpec], str]) -> str:
    """`call: c0 | c1 ...` and one rule per function."""
    lines = ["call: " + " | ".join(f"c{i}" for i in range(len(functions)))]
    lines += [f"c{i}: {rule(f)}" for i, f in enumerate(functions)]
    return "\n".join(lines)


def hold_back(text: str, *markers: str) -> str:
    """`text` less a tail that could be the start of one of `markers` (the next tokens decide)."""
    cut = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), cut, -1):
            if text.endswith(marker[:n]):
                cut = n
                break
    return text[: len(text) - cut] if cut else text


def skip_ws(text: str, pos: int, end: int | None = None) -> int:
    end = len(text) if end is None else end
    while pos < end and text[pos] in " \t\r\n":
        pos += 1
    return pos
