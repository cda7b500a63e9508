"""Validate rendered custom resources offline, against their CRD's openAPIV3Schema, as a cluster's API server
would before storing them, but stricter: unknown fields are errors here (a structural schema would prune them
silently, and a misspelt field is a bug to catch, not to drop).

The CRDs ship as package data in `inferd/deploy/crds/` (KServe's; see the README there), so `inferd lab
kserve` checks what `inferd deploy k8s` renders without a cluster. Needs `jsonschema` (the test extra, or
`pip install jsonschema`).
"""

from __future__ import annotations

import copy
import functools
import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.errors import InferdError

CRDS = Path(__file__).parent / "crds"


@dataclass(frozen=True)
class FieldError:
    """One schema violation: the object, the path of the field in it, and what is wrong."""

    object: str  # "LLMInferenceService inferd-gemma"
    path: str  # "spec.replicas"
    message: str

    def __str__(self) -> str:
        return f"{self.object}: {self.path or '(top)'}: {self.message}"


def _jsonschema():
    try:
        import jsonschema
    except ImportError:
        raise InferdError("validating custom resources needs jsonschema: pip install jsonschema") from None
    return jsonschema


@functools.cache
def crd_schemas(folder: Path = CRDS) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> that version's openAPIV3Schema, closed to unknown fields, for every CRD in `folder`."""
    import yaml

    out = {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for path in sorted(folder.glob("*.yaml.gz")):
        crd = yaml.load(gzip.decompress(path.read_bytes()), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = closed(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    return out


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties and does not
    preserve unknown fields."""
    if isinstance(schema, dict):
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for v in schema.values():
            closed(v)
    elif isinstance(schema, list):
        for item in schema:
            closed(item)
    return schema


@functools.cache
def _validator(key: tuple[str, str], folder: Path):
    # built once per kind, without checking a megabyte of schema against the meta-schema on every call
    return _jsonschema().Draft202012Validator(crd_schemas(folder)[key])


def body(obj: dict) -> dict:
    """What the CRD's schema covers: everything but apiVersion, kind and metadata (the API server's ObjectMeta)."""
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}


def errors(obj: dict, folder: Path = CRDS) -> list[FieldError]:
    """Every schema violation in `obj` (empty: valid). An object of a kind with no CRD in `folder` is one error."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    what = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    if key not in crd_schemas(folder):
        return [FieldError(what, "apiVersion", f"no CRD for {key[0]} {key[1]} in {folder}")]
    found = _validator(key, folder).iter_errors(body(obj))
    return [FieldError(what, ".".join(map(str, e.absolute_path)), e.message) for e in found]


def leaf_fields(value: Any, prefix: str = "") -> list[str]:
    """The paths of every scalar in `value` (list items by index): the fields a schema check covers."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in leaf_fields(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in leaf_fields(v, f"{prefix}[{i}]")]
    return [prefix]


def report(objs: list[dict], folder: Path = CRDS) -> list[dict]:
    """Per object: its kind and name, how many fields the check covered and its errors as text (JSON data, as
    `inferd lab kserve` reports them)."""
    return [
        {
            "kind": o["kind"],
            "name": o["metadata"]["name"],
            "fields": len(leaf_fields(body(o))),
            "errors": [str(e) for e in errors(o, folder)],
        }
        for o in objs
    ]
