"""Validate rendered manifests offline: built-in kinds with kubernetes-validate, custom resources with
jsonschema against their CRD's openAPIV3Schema (tests/data/crds), unknown fields rejected in both."""

from __future__ import annotations

import copy
import functools
import gzip
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

CRDS = Path(__file__).parent.parent / "data" / "crds"
K8S_VERSION = "1.33.0"


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the version's openAPIV3Schema, closed to unknown fields."""
    out = {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for path in sorted(CRDS.glob("*.yaml.gz")):
        crd = yaml.load(gzip.decompress(path.read_bytes()), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = _closed(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    return out


def _closed(schema: dict) -> dict:
    """A structural schema prunes unknown fields silently; a test wants them as errors (typos)."""
    if isinstance(schema, dict):
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for v in schema.values():
            if isinstance(v, dict):
                _closed(v)
            elif isinstance(v, list):
                for item in v:
                    _closed(item)
    return schema


@functools.cache
def _validator(key: tuple[str, str]) -> jsonschema.protocols.Validator:
    # built once per kind, without re-checking a megabyte of schema against the meta-schema each call
    return jsonschema.Draft202012Validator(_crd_schemas()[key])


def validate(obj: dict) -> None:
    """Raise with the object's kind and name and the path of the first error."""
    key = (obj["apiVersion"], obj["kind"])
    what = f"{obj['kind']} {obj.get('metadata', {}).get('name')}"
    schemas = _crd_schemas()
    if key in schemas:
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        error = jsonschema.exceptions.best_match(_validator(key).iter_errors(body))
        if error is not None:
            raise AssertionError(f"{what}: {'.'.join(map(str, error.absolute_path))}: {error.message}")
        return
    if "." in obj["apiVersion"].split("/")[0]:  # a custom group that is not in tests/data/crds
        raise AssertionError(f"{what}: no CRD for {key} in {CRDS}")
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{what}: {'.'.join(map(str, e.path))}: {e.message}") from None
