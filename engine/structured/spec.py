"""StructuredOutputs: what a request's output must match, as plain data (the gateway fills it from the API)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

# Bounds on what a client may ask the grammar compiler to build (each compiled grammar is cached, and its
# size drives compile time and memory): the serialized schema, regex or grammar, and the choices.
MAX_SPEC_BYTES = 64 << 10
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    """Exactly one of the constraints. As vLLM's StructuredOutputsParams, less the backend options.

    json: a JSON schema (a dict, or its JSON text); regex: the whole output matches it; choice: the output is one
    of these strings; grammar: a Lark grammar in llguidance's dialect (GBNF is converted); json_object: any JSON
    object. `field` names the request field it came from, for error messages.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            got = ", ".join(set_) or "none"
            raise InvalidRequestError(f"{self.field} takes exactly one of {', '.join(KINDS)}; got {got}", self.field)
        if self.json is not None:
            if not isinstance(self.json, dict | str):
                raise InvalidRequestError(f"{self.field}: a JSON schema must be an object", self.field)
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError:
                    raise InvalidRequestError(f"{self.field}: the JSON schema is not valid JSON", self.field) from None
                if not isinstance(schema, dict):
                    raise InvalidRequestError(f"{self.field}: a JSON schema must be an object", self.field)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self.field}: {name} must be a non-empty string", self.field)
        if self.choice is not None:
            if not isinstance(self.choice, tuple | list) or not self.choice:
                raise InvalidRequestError(f"{self.field}: choice must be a non-empty list of strings", self.field)
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(
                    f"{self.field}: at most {MAX_CHOICES} choices, got {len(self.choice)}", self.field
                )
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise InvalidRequestError(
                        f"{self.field}: each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters", self.field
                    )
        key = self.key()
        size = len(key.encode("utf-8", "surrogatepass"))
        if size > MAX_SPEC_BYTES:
            raise InvalidRequestError(
                f"{self.field}: the constraint is {size} bytes; at most {MAX_SPEC_BYTES} are accepted", self.field
            )
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not Unicode text, and the compiler's UTF-8 refuses it
            what = f"{self.field}: the constraint holds a lone surrogate code point"
            raise InvalidRequestError(what, self.field) from None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The cache key: the kind and its value, canonical (a schema's keys sorted)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            value = json.loads(value)
        if kind == "choice":
            value = list(value)
        return json.dumps([kind, value], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
