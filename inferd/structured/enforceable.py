"""Which parts of a JSON schema the token mask can enforce, so a schema it cannot is refused at admission.

xgrammar turns a schema into a grammar, and a grammar is context-free: it can say which keys and values may
come next, not relate one part of the output to another. Where a keyword needs that (`uniqueItems`,
`dependentRequired`, `if`/`then`, `not`, an `allOf` of several branches, `multipleOf` over a range, a length
bound on a pattern), xgrammar drops the keyword silently and the "constrained" output may not validate. A
client that asked for a schema must get output that follows it, or be told at once which keyword is the
reason; vLLM refuses the same schemas for the same reason (`has_xgrammar_unsupported_json_features`).

Each rule below was checked against xgrammar 0.2.9 (`tests/structured/test_enforceable.py` shows, for every
rule, a string the schema forbids that xgrammar's grammar accepts; when xgrammar learns a keyword that test
fails and the rule can go). `oneOf` is accepted and read as `anyOf`: outputs follow it whenever its branches
do not overlap, which is how schemas nearly always use it.
"""

from __future__ import annotations

from typing import Any

# The string formats xgrammar writes a grammar for (json_schema_converter.cc); any other format is ignored.
ENFORCED_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# The formats JSON Schema defines that xgrammar ignores. A format JSON Schema does not define (`int32`, `byte`,
# `datetime`) is an annotation, which no validator checks, so it constrains nothing and is let through.
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})

# keys whose value is one subschema, a {name: subschema} map, or a list of subschemas
_ONE = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "additionalItems", "not", "if",
        "then", "else", "contains", "propertyNames", "items")  # fmt: skip
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords that constrain nothing. Of the others, beside an anyOf/oneOf of several branches, xgrammar merges
# some into each branch (`properties`, an object's `type`) and drops others (`required`, a string's bounds, a
# `type` the branches override); rather than track which, every constraining keyword there is refused.
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "$anchor", "default", "examples",
                          "$defs", "definitions", "deprecated", "readOnly", "writeOnly"})  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _node_problems(node: dict) -> list[str]:
    """What in this one schema object (not its subschemas) the mask cannot enforce."""
    found = []
    for key in ("not", "if", "dependencies", "dependentRequired", "dependentSchemas"):
        if key in node:
            found.append(f"`{key}` relates parts of the output to each other, which a grammar cannot check")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        found.append("`allOf` with more than one branch (merge the branches into one schema)")
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        beside = sorted(set(node) - _ANNOTATIONS - {key})
        if isinstance(branches, list) and len(branches) > 1 and beside:
            found.append(f"{', '.join(f'`{k}`' for k in beside)} beside a `{key}` of several branches (move into each)")
    types = _types(node)
    if "multipleOf" in node:
        bounded = any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
        if types != {"integer"} or bounded:
            found.append("`multipleOf` (enforced only on an unbounded integer)")
    if node.get("uniqueItems") is True:
        found.append("`uniqueItems`")
    for key in ("contains", "minContains", "maxContains"):
        if key in node:
            found.append(f"`{key}`")
    fmt = node.get("format")
    if fmt is not None and (not types or "string" in types):
        if fmt in UNENFORCED_FORMATS:
            found.append(f"string format {fmt!r} (enforced: {', '.join(sorted(ENFORCED_FORMATS))})")
        elif fmt in ENFORCED_FORMATS and "string" not in types:
            found.append(f'format {fmt!r} without `"type": "string"`')
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        found.append("`minLength`/`maxLength` together with `pattern` or `format`")
    if "propertyNames" in node and any(k in node for k in ("properties", "patternProperties")):
        found.append("`propertyNames` together with `properties` or `patternProperties`")
    return found


def unenforceable(schema: Any, path: str = "") -> list[str]:
    """Every keyword of `schema` the mask cannot enforce, as "<JSON pointer>: <why>"; empty when it can."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path or '/'}: {why}" for why in _node_problems(schema)]
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            found += unenforceable(schema[key], f"{path}/{key}")
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unenforceable(sub, f"{path}/{key}/{_escape(name)}")
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unenforceable(sub, f"{path}/{key}/{i}")
    return found


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
