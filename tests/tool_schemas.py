"""Seeded random tool-parameter schemas (and values valid against them) for the tool-call tests.

Every string is length-bounded and every array size-bounded, so a random-weight model constrained
by the schema's grammar finishes a call within a few hundred tokens; the mix covers what tools
declare: strings (bounded, enums), integers and numbers (ranges), booleans, nulls, arrays, nested
objects, optional properties.
"""

from __future__ import annotations

import random
import string
from typing import Any

_WORDS = ("city", "query", "limit", "unit", "tags", "flag", "note", "items", "depth", "mode", "lang", "page")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties, some required, no others allowed."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    props = {n: _value_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "enum", "integer", "number", "boolean", "array"] + (["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 10)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["celsius", "fahrenheit", "kelvin", "auto", "fast"], 3)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 6}])
        return {"type": "array", "items": item, "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def random_value(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value valid against a schema made by ``random_schema``."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        required = set(schema.get("required", ()))
        return {k: random_value(v, rng) for k, v in schema["properties"].items() if k in required or rng.random() < 0.5}
    if kind == "string":
        n = rng.randint(schema.get("minLength", 0), schema.get("maxLength", 8))
        text = "".join(rng.choice(string.ascii_letters + " é\"\\") for _ in range(n))
        # No space at either end: in Qwen3-Coder's XML the whitespace around a bounded string is
        # the format's, so such a value would not read back as written.
        return text if text.strip() == text else "x" + text[1:-1] + "x" if n > 1 else "x"
    if kind == "integer":
        return rng.randint(schema.get("minimum", -100), schema.get("maximum", 100))
    if kind == "number":
        return round(rng.uniform(schema["minimum"], schema["maximum"]), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    return [random_value(schema["items"], rng) for _ in range(rng.randint(0, schema.get("maxItems", 2)))]
