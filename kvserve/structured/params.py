"""What a request asks its output to match. Torch- and llguidance-free: it rides on
SamplingParams, which the scheduler and the tests build without either."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvserve.request import RequestRejected


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set (vLLM's ``structured_outputs`` shape).

    ``json``: a JSON schema (dict or its text); ``regex``: a Rust-regex the whole output
    matches; ``choice``: the output is one of these strings; ``grammar``: a Lark grammar (or
    llama.cpp GBNF, recognised by ``::=``); ``json_object``: any JSON object. ``strict`` (the
    OpenAI ``json_schema.strict`` flag) makes objects without ``additionalProperties`` closed,
    as OpenAI's strict mode requires them to be.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        set_fields = [name for name in ("json", "regex", "choice", "grammar")
                      if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise RequestRejected("structured outputs need exactly one of json, regex, choice, "
                                  f"grammar or json_object; got {set_fields or 'none'}")
        return set_fields[0]

    def validate(self) -> None:
        kind = self.kind
        if kind == "choice":
            if not self.choice:
                raise RequestRejected("structured outputs: choice must list at least one string")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise RequestRejected("structured outputs: every choice must be a non-empty string")
        elif kind in ("regex", "grammar") and not getattr(self, kind):
            raise RequestRejected(f"structured outputs: {kind} is empty")
        elif kind == "json":
            self.schema()  # parses

    def schema(self) -> Optional[dict]:
        """The JSON schema to compile (json and json_object kinds), strict-mode closed."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        schema: Any = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestRejected(f"structured outputs: the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestRejected("structured outputs: a JSON schema must be an object")
        return close_objects(schema) if self.strict else schema

    def cache_key(self) -> tuple[str, str]:
        """Hashable identity of the grammar this compiles to."""
        kind = self.kind
        if kind in ("json", "json_object"):
            return ("json", json.dumps(self.schema(), sort_keys=True, separators=(",", ":")))
        if kind == "choice":
            return ("choice", json.dumps(list(self.choice)))
        return (kind, getattr(self, kind))


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``false`` (OpenAI strict mode: only the listed properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
