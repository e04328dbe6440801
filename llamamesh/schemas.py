"""Which JSON Schema keywords the engines' grammars enforce. Every engine compiles a JSON schema with xgrammar
(the CPU engine, and vLLM's default structured-output backend), which drops some keywords without a word: an
answer would end ``stop`` yet not validate. Like vLLM's own check before it picks a backend, a schema using one
(at a schema position: a property named "not" is no keyword) is refused, naming the keyword and where it is,
rather than answered unchecked. Pure Python over parsed JSON.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Dropped by the grammar compiler wherever they appear.
UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "patternProperties",
    "propertyNames",
)
# What may stand beside a "$ref" or a one-schema "allOf" (it annotates; it constrains nothing).
ANNOTATIONS = frozenset(
    {"$ref", "allOf", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default"}
    | {"examples", "deprecated", "readOnly", "writeOnly"}
)
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")
MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def unknown_type(schema: Any) -> str:
    """The first ``type`` of ``schema`` that JSON Schema does not have, with where it is; "" when none."""
    for path, node in _schemas(schema, ""):
        kinds = node.get("type", [])
        for kind in kinds if isinstance(kinds, list) else [kinds]:
            if not isinstance(kind, str) or kind not in TYPES:
                return f"type {str(kind)[:40]!r}{f' at {path}' if path else ''} is no JSON Schema type"
    return ""


def dropped(schema: Any) -> str:
    """Why a grammar compiled from ``schema`` would not hold an answer to it ("" when it would), for an error."""
    keyword = unenforced(schema)
    return f"uses {keyword}, which the engines' grammar does not enforce: an answer could break it" if keyword else ""


def unenforced(schema: Any) -> str:
    """The first keyword of ``schema`` (parsed JSON) the grammar would drop, with where it is (``allOf at
    properties.a``); "" when it has none."""
    for path, node in _schemas(schema, ""):
        where = f" at {path}" if path else ""
        for keyword in UNENFORCED:
            if keyword in node:
                return f"{keyword}{where}"
        constraints = set(node) - ANNOTATIONS
        if "allOf" in node and (not isinstance(node["allOf"], list) or len(node["allOf"]) != 1 or constraints):
            return f"allOf{where} (one schema in it alone, as for a $ref with a description, is enforced)"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"$ref{where} to {ref[:80]!r} (only references into the schema itself, '#/...')"
        if ref is not None and constraints:
            return f"{sorted(constraints)[0]} beside $ref{where}"
        if "multipleOf" in node and not _integers(node.get("type")):
            return f"multipleOf{where} (enforced for integers only)"
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            return f"minLength/maxLength beside a pattern or format{where}"
    return ""


def _integers(kind: Any) -> bool:
    """Whether a ``type`` admits integers and no other numbers ("integer", or a list with it and without "number")."""
    kinds = kind if isinstance(kind, list) else [kind]
    return "integer" in kinds and "number" not in kinds


def _schemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``node`` with its path (iterative: the depth is bounded before, not here)."""
    todo = [(node, path)]
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        at = f"{path}." if path else ""
        todo.extend((node[k], f"{at}{k}") for k in ONE if k in node)
        for k in MANY:
            if isinstance(node.get(k), list):
                todo.extend((sub, f"{at}{k}[{i}]") for i, sub in enumerate(node[k]))
        for k in MAPS:
            if isinstance(node.get(k), dict):
                todo.extend((sub, f"{at}{k}.{name}") for name, sub in node[k].items())
