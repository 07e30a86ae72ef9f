"""Eight different JSON schemas for structured-output tests: a random tiny model must still end each one, so
every string, array and number is bounded (the grammar forces validity, the bounds force an end)."""

from __future__ import annotations

from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"risk": {"enum": ["low", "medium", "high"]}, "flagged": {"type": "boolean"}},
        "required": ["risk", "flagged"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "account": {
                "type": "object",
                "properties": {"id": {"type": "string", "pattern": "^[0-9]{4}$"}},
                "required": ["id"],
                "additionalProperties": False,
            },
            "open": {"type": "boolean"},
        },
        "required": ["account", "open"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"kind": {"const": "ticket"}, "priority": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["kind", "priority"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "money": {
                "type": "object",
                "properties": {"cents": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["cents"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"amount": {"$ref": "#/$defs/money"}, "currency": {"enum": ["CNY", "USD"]}},
        "required": ["amount", "currency"],
        "additionalProperties": False,
    },
]
