"""Validate rendered manifests offline: custom resources with `inferd.deploy.validate` against their CRD's
openAPIV3Schema (tests/data/crds: KServe, KEDA, the Gateway API and its inference extension), built-in kinds
with kubernetes-validate; unknown fields are errors in both."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate

from inferd.deploy.validate import crd_schemas, errors

CRDS = Path(__file__).parent.parent / "data" / "crds"
K8S_VERSION = "1.33.0"


def validate(obj: dict) -> None:
    """Raise with the object's kind and name and the path of the first error."""
    key = (obj["apiVersion"], obj["kind"])
    what = f"{obj['kind']} {obj.get('metadata', {}).get('name')}"
    if key in crd_schemas(CRDS):
        found = errors(obj, CRDS)
        if found:
            raise AssertionError(str(found[0]))
        return
    group = obj["apiVersion"].split("/")[0]
    if "." in group and not group.endswith(".k8s.io"):  # a custom group that is not in tests/data/crds (the
        # built-in groups with a dot, rbac.authorization.k8s.io and the like, are Kubernetes' own)
        raise AssertionError(f"{what}: no CRD for {key} in {CRDS}")
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{what}: {'.'.join(map(str, e.path))}: {e.message}") from None
