"""What a request asks its output to follow, read once from whichever request field says it.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`, `structural_tag`) and vLLM's older `guided_*` fields all say the same
thing in different words; `constraint_from_request` turns each into one `Constraint`, the engine's only
form. The constraint's `value` is text (a canonical JSON schema, a regex, an EBNF grammar, the choices as
a JSON list), so it is hashable and is the grammar cache's key. `param` names the field it came from, so
a schema the compiler refuses is reported against the field the client filled in. A schema with keywords the
mask cannot enforce (`structured/enforceable.py`) is refused here, at admission.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from inferd.errors import InvalidRequestError
from inferd.structured.enforceable import unenforceable

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint. `any_whitespace` lets JSON take any whitespace between tokens; off by
    default (compact JSON), because a model free to emit whitespace can emit it until `max_tokens`."""

    kind: Kind
    value: str = ""
    any_whitespace: bool = False
    param: str = field(default="structured_outputs", compare=False)

    @classmethod
    def json(cls, schema: dict | bool | str, param: str = "structured_outputs", **kw) -> Constraint:
        return cls("json", _schema_text(schema, param), param=param, **kw)

    @classmethod
    def choice(cls, options: list[str], param: str = "structured_outputs") -> Constraint:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise InvalidRequestError("choice must be a non-empty list of strings", param=param)
        return cls("choice", json.dumps(options), param=param)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError("a JSON schema must be an object (or true/false)", param=param)
    problems = unenforceable(schema)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InvalidRequestError(
            "this JSON schema uses what a token mask cannot enforce, so outputs could break it: "
            + "; ".join(problems[:3])
            + more,
            param=param,
        )
    return json.dumps(schema, sort_keys=False, separators=(",", ":"))


def _from_response_format(rf: dict) -> Constraint | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", param="response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                "response_format json_schema needs a json_schema object", param="response_format.json_schema"
            )
        # OpenAI's field is `schema`; vLLM also accepts the older `json_schema.json_schema`
        schema = spec.get("schema", spec.get("json_schema", {}))
        return Constraint.json(schema, param="response_format.json_schema.schema")
    if kind == "structural_tag":
        return Constraint("structural_tag", json.dumps(rf), param="response_format")
    raise InvalidRequestError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag",
        param="response_format.type",
    )


def _from_structured_outputs(so: dict) -> Constraint | None:
    set_keys = [k for k in KINDS if so.get(k) not in (None, False)]
    if len(set_keys) > 1:
        raise InvalidRequestError(
            f"structured_outputs sets {', '.join(set_keys)}; set exactly one", param="structured_outputs"
        )
    if not set_keys:
        return None
    (kind,) = set_keys
    param = f"structured_outputs.{kind}"
    value = so[kind]
    any_ws = so.get("disable_any_whitespace") is False
    if kind == "json":
        return Constraint.json(value, param=param, any_whitespace=any_ws)
    if kind == "json_object":
        return Constraint("json_object", param=param, any_whitespace=any_ws)
    if kind == "choice":
        return Constraint.choice(value, param=param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return Constraint(kind, value, param=param)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_from_request(
    response_format: dict | None = None, structured_outputs: dict | None = None, **guided: Any
) -> Constraint | None:
    """The one constraint a request asks for, or None; more than one source is a 400 naming them."""
    found: list[tuple[str, Constraint]] = []
    if response_format:
        if not isinstance(response_format, dict):
            raise InvalidRequestError("response_format must be an object", param="response_format")
        c = _from_response_format(response_format)
        if c:
            found.append(("response_format", c))
    if structured_outputs:
        c = _from_structured_outputs(structured_outputs)
        if c:
            found.append(("structured_outputs", c))
    so = {_GUIDED[k]: v for k, v in guided.items() if k in _GUIDED and v is not None}
    if guided.get("guided_json_object"):
        so["json_object"] = True
    if so:
        c = _from_structured_outputs(so)
        if c:
            name = next(k for k, v in _GUIDED.items() if v == c.kind) if c.kind in _GUIDED.values() else c.kind
            found.append((name, Constraint(c.kind, c.value, c.any_whitespace, param=name)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"{names} each constrain the output; send only one", param=found[1][0])
    return found[0][1] if found else None
