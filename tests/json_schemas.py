"""Random JSON schemas of varied shape for the structured-output tests: nested objects,
arrays, enums, numbers with bounds, optional fields, anyOf. Seeded, so a failure names its
schema. With ``bounded`` every string, array, integer and object is bounded (maxLength, maxItems,
minimum/maximum, multipleOf, additionalProperties false): a random-weight model never closes an
unbounded one. The real-model test draws unbounded ones too."""
from __future__ import annotations

import random
from typing import Any

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "x", "y",
         "name", "id", "count", "items", "value", "flag", "kind", "score", "tags", "note"]


def random_schema(rng: random.Random, bounded: bool = True, depth: int = 0) -> dict[str, Any]:
    kinds = ["object", "array", "string", "integer", "number", "boolean", "enum", "null",
             "anyOf", "const"]
    weights = [5 if depth < 2 else 0, 3 if depth < 2 else 0, 4, 3, 2, 2, 2, 1,
               1 if depth < 2 else 0, 1]
    kind = rng.choices(kinds, weights)[0]
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(1, 4))
        props = {n: random_schema(rng, bounded, depth + 1) for n in names}
        schema: dict[str, Any] = {"type": "object", "properties": props,
                                  "required": [n for n in names if rng.random() < 0.6]}
        if bounded or rng.random() < 0.7:
            schema["additionalProperties"] = False
        return schema
    if kind == "array":
        lo = rng.randint(0, 2)
        schema = {"type": "array", "items": random_schema(rng, bounded, depth + 1), "minItems": lo}
        if bounded or rng.random() < 0.5:
            schema["maxItems"] = lo + rng.randint(0, 3)
        return schema
    if kind == "string":
        roll = rng.random()
        if roll < 0.2:
            return {"type": "string", "pattern": f"^[a-z]{{{rng.randint(1, 3)},{rng.randint(4, 6)}}}$"}
        schema = {"type": "string"}
        if bounded or roll < 0.5:
            schema["minLength"] = rng.randint(0, 2)
            schema["maxLength"] = schema["minLength"] + rng.randint(1, 10)
        return schema
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        schema = {"type": "integer"}
        if bounded or rng.random() < 0.8:
            schema["minimum"] = lo
        if bounded or rng.random() < 0.8:
            schema["maximum"] = lo + rng.randint(0, 5000)
        return schema
    if kind == "number":
        lo = round(rng.uniform(-100, 100), 2)
        schema = {"type": "number", "minimum": lo, "maximum": lo + round(rng.uniform(0.5, 500), 2)}
        if bounded:  # a decimal expansion is unbounded too
            schema["multipleOf"] = rng.choice([0.5, 0.25, 0.125])  # exact in binary: validators agree
        return schema
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        pool = rng.sample(WORDS, 3) + [rng.randint(0, 9), None, True]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    return {"anyOf": [random_schema(rng, bounded, depth + 1) for _ in range(rng.randint(2, 3))]}


def random_schemas(count: int, seed: int = 0, bounded: bool = True) -> list[dict[str, Any]]:
    """``count`` top-level object schemas (what response_format asks for)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        schema = random_schema(rng, bounded)
        if schema.get("type") == "object":
            out.append(schema)
    return out
