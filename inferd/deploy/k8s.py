"""Kubernetes manifests for a fleet spec: engine Deployments per pool, headless Services, the gateway, PDBs.

One fleet YAML (the same `inferd up` reads) renders to plain objects as dicts, grouped by file:

- `engine.yaml`: per pool a Deployment (readiness and liveness on `/health`, a startup probe long enough
  to load a model, CPU or `nvidia.com/gpu` requests, a non-root security context, a model cache volume)
  and a headless Service, which the gateway resolves (`replicas_dns`) to every ready pod; per
  disaggregated model, the disaggregation proxy in front of its prefill and decode pools.
- `gateway.yaml`: the gateway's ConfigMap (`FleetSpec.gateway_config` with DNS discovery), Deployment
  and Service.
- `policy.yaml`: PodDisruptionBudgets.
- `monitoring.yaml`: ServiceMonitors (Prometheus operator) for engines and the gateway, and the Grafana
  dashboard (`observability.py`) as a ConfigMap for Grafana's dashboard sidecar.
- `keda.yaml` (with autoscaling): KEDA ScaledObjects per pool, see `keda.py`.
- `kserve.yaml` and `inference-extension.yaml`: the same models for clusters running KServe or llm-d
  (Gateway API Inference Extension), see `extras.py`. They are alternatives to `engine.yaml` and
  `gateway.yaml`, so the kustomization leaves them out.

The options, names, labels and the engine's pod that all of these share are in `pods.py`.

Everything is checked before rendering: the spec when it is read (errors name the line), the options
here (`K8sOptions.check`); a rendered object is only ever built from valid input.
"""

from __future__ import annotations

import hashlib
import json

import yaml

from inferd.deploy import extras, keda
from inferd.deploy.observability import dashboard
from inferd.deploy.pods import (
    ENGINE_PORT,
    GATEWAY_PORT,
    KV_PORT,
    PROXY_PORT,
    K8sOptions,
    Manifest,
    decode_pool,
    deployment_manifest,
    engine_container,
    http_probe,
    meta,
    pod_spec,
    pool_labels,
    pool_name,
    pool_selector,
    prefill_pool,
    proxy_name,
    security_context,
    svc_dns,
)
from inferd.fleet.spec import FleetSpec, ModelSpec, PoolSpec


def engine_deployment(spec: FleetSpec, model: ModelSpec, pool: PoolSpec, opts: K8sOptions) -> Manifest:
    container = engine_container(spec, model, pool, opts)
    gpu = "nvidia.com/gpu" in container["resources"]["requests"]
    labels = pool_labels(model, pool)
    dep = deployment_manifest(
        pool_name(pool), labels, pool_selector(model, pool), pool.replicas, pod_spec([container], opts, gpu), opts
    )
    if opts.autoscale and pool.autoscaling is not None:
        # KEDA's HPA owns the replica count; a `replicas` here would reset it on every `kubectl apply`
        del dep["spec"]["replicas"]
    return dep


def headless_service(
    name: str, labels: dict, selector: dict, port: int, opts: K8sOptions, kv_port: int | None = None
) -> Manifest:
    """Headless: its DNS name resolves to every ready pod, which is how the gateway finds replicas (and a
    decode pod the prefill pods it may pull KV from)."""
    ports = [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    if kv_port is not None:
        ports.append({"name": "kv", "port": kv_port, "targetPort": "kv", "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, opts, labels),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": ports,
        },
    }


def proxy_deployment(model: ModelSpec, opts: K8sOptions) -> Manifest:
    """`inferd disagg proxy` in front of a disaggregated model: prefill on one pool, decode on the other."""
    decode, prefill = decode_pool(model), prefill_pool(model)
    _, sc = security_context()
    args = [
        "disagg",
        "proxy",
        "--host",
        "0.0.0.0",
        "--port",
        str(PROXY_PORT),
        "--prefill",
        f"http://{svc_dns(pool_name(prefill), opts)}:{ENGINE_PORT}",
        "--decode",
        f"http://{svc_dns(pool_name(decode), opts)}:{ENGINE_PORT}",
    ]
    container = {
        "name": "proxy",
        "image": opts.image,  # the proxy uses no GPU: the CPU image
        "imagePullPolicy": "IfNotPresent",
        "command": ["inferd"],
        "args": args,
        "ports": [{"name": "http", "containerPort": PROXY_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": sc,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "readinessProbe": http_probe("/health", "http", 5, 2),
        "livenessProbe": http_probe("/health", "http", 10, 6, timeout=5),
    }
    labels = pool_labels(model, decode) | {"app.kubernetes.io/component": "disagg-proxy"}
    selector = {"app.kubernetes.io/name": "inferd", "inferd.dev/proxy-for": decode.name}
    labels |= selector
    pod = pod_spec([container], opts, gpu=False, volumes=[{"name": "tmp", "emptyDir": {}}])
    return deployment_manifest(proxy_name(model), labels, selector, 2, pod, opts)


def _proxy_selector(model: ModelSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inferd", "inferd.dev/proxy-for": decode_pool(model).name}


# -- the gateway -----------------------------------------------------------------------------------
def gateway_endpoints(spec: FleetSpec, opts: K8sOptions) -> dict[str, dict]:
    """Each front pool's discovery: its headless Service, or the disaggregation proxy's."""
    out = {}
    for m in spec.models:
        for p in m.pools:
            if p.role == "both":
                out[p.name] = {"replicas_dns": {"name": svc_dns(pool_name(p), opts), "port": ENGINE_PORT}}
            elif p.role == "decode":
                out[p.name] = {"replicas_dns": {"name": svc_dns(proxy_name(m), opts), "port": PROXY_PORT}}
    return out


def _scales_down(spec: FleetSpec, opts: K8sOptions) -> bool:
    """Whether an autoscaler removes engine pods: then the gateway keeps their deletion costs."""
    return opts.autoscale and any(p.autoscaling is not None and p.role == "both" for m in spec.models for p in m.pools)


def gateway_yaml(spec: FleetSpec, opts: K8sOptions) -> str:
    cfg = spec.gateway_config(gateway_endpoints(spec, opts))
    cfg.listen.host, cfg.listen.port = "0.0.0.0", GATEWAY_PORT
    if _scales_down(spec, opts):  # cache-aware scale-down: the replica whose cache serves least goes first
        cfg.pod_deletion_cost.enabled = True
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    return yaml.safe_dump(data, sort_keys=False)


def _gateway_replicas(spec: FleetSpec, opts: K8sOptions) -> int:
    if opts.gateway_replicas is not None:
        return opts.gateway_replicas
    cfg = spec.gateway_config(gateway_endpoints(spec, opts))
    shared = cfg.budget_store == "redis" and cfg.prefix_index.store == "redis"
    return 2 if shared or (not cfg.tenants and cfg.prefix_index.store == "redis") else 1


def gateway_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    labels = {"app.kubernetes.io/name": "inferd", "app.kubernetes.io/component": "gateway"}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("inferd-gateway", opts, labels),
        "data": {"gateway.yaml": gateway_yaml(spec, opts)},
    }
    _, sc = security_context()
    container = {
        "name": "gateway",
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["inferd"],
        "args": ["gateway", "--config", "/etc/inferd/gateway.yaml"],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": sc,
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/inferd", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "readinessProbe": http_probe("/health", "http", 5, 2),
        "livenessProbe": http_probe("/health", "http", 10, 6, timeout=5),
    }
    volumes = [{"name": "config", "configMap": {"name": "inferd-gateway"}}, {"name": "tmp", "emptyDir": {}}]
    pod = pod_spec([container], opts, gpu=False, volumes=volumes)
    rbac = _deletion_cost_rbac(labels, opts) if _scales_down(spec, opts) else []
    if rbac:  # the gateway patches the engine pods' deletion cost with its service account's token
        pod["serviceAccountName"], pod["automountServiceAccountToken"] = "inferd-gateway", True
    # a changed config rolls the gateway (kubectl apply after a re-render)
    digest = hashlib.sha256(config_map["data"]["gateway.yaml"].encode()).hexdigest()[:16]
    deployment = deployment_manifest("inferd-gateway", labels, labels, _gateway_replicas(spec, opts), pod, opts)
    deployment["spec"]["template"]["metadata"]["annotations"] = {"inferd.dev/config-sha256": digest}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta("inferd-gateway", opts, labels),
        "spec": {
            "type": "ClusterIP",
            "selector": labels,
            "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [config_map, deployment, service, *rbac]


def _deletion_cost_rbac(labels: dict, opts: K8sOptions) -> list[Manifest]:
    """A service account for the gateway that may read the namespace's pods and patch their annotations."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("inferd-gateway", opts, labels)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta("inferd-gateway-pod-deletion-cost", opts, labels),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta("inferd-gateway-pod-deletion-cost", opts, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": "inferd-gateway", "namespace": opts.namespace}],
    }
    return [account, role, binding]


# -- policy and monitoring ---------------------------------------------------------------------------
def pdb(name: str, labels: dict, selector: dict, opts: K8sOptions) -> Manifest:
    """At most one pod of the set down for a voluntary disruption (a node drain), whatever the replica count."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(name, opts, labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def service_monitor(name: str, labels: dict, selector: dict, opts: K8sOptions, interval: str = "15s") -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta(name, opts, labels),
        "spec": {
            "selector": {"matchLabels": selector},
            "namespaceSelector": {"matchNames": [opts.namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": interval, "scrapeTimeout": "10s"}],
        },
    }


# -- the whole set ---------------------------------------------------------------------------------
def engine_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    out = []
    for m, p in spec.pools():
        out.append(engine_deployment(spec, m, p, opts))
        kv_port = KV_PORT if p.role == "prefill" else None
        out.append(headless_service(pool_name(p), pool_labels(m, p), pool_selector(m, p), ENGINE_PORT, opts, kv_port))
    for m in spec.models:
        if m.disaggregated:
            proxy = proxy_deployment(m, opts)
            out.append(proxy)
            labels = proxy["metadata"]["labels"]
            out.append(headless_service(proxy_name(m), labels, _proxy_selector(m), PROXY_PORT, opts))
    return out


def policy_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    out = [pdb(pool_name(p), pool_labels(m, p), pool_selector(m, p), opts) for m, p in spec.pools()]
    for m in spec.models:
        if m.disaggregated:
            labels = pool_labels(m, decode_pool(m)) | {"app.kubernetes.io/component": "disagg-proxy"}
            out.append(pdb(proxy_name(m), labels, _proxy_selector(m), opts))
    if _gateway_replicas(spec, opts) > 1:
        gw = {"app.kubernetes.io/name": "inferd", "app.kubernetes.io/component": "gateway"}
        out.append(pdb("inferd-gateway", gw, gw, opts))
    return out


def monitoring_objects(opts: K8sOptions) -> list[Manifest]:
    base = {"app.kubernetes.io/name": "inferd"}
    # Grafana's dashboard sidecar (kube-prometheus-stack) loads ConfigMaps labelled grafana_dashboard=1
    grafana = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("inferd-grafana-dashboard", opts, base | {"grafana_dashboard": "1"}),
        "data": {"inferd.json": json.dumps(dashboard(), indent=1)},
    }
    return [
        service_monitor("inferd-engines", base, base | {"app.kubernetes.io/component": "engine"}, opts),
        service_monitor("inferd-gateway", base, base | {"app.kubernetes.io/component": "gateway"}, opts),
        grafana,
    ]


def namespace(opts: K8sOptions) -> Manifest:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": opts.namespace}}


def render(spec: FleetSpec, opts: K8sOptions) -> dict[str, list[Manifest]]:
    """File name -> the objects in it. The base (everything but kserve/inference-extension) is what
    `kustomization.yaml` lists."""
    opts.check()
    files = {
        "namespace.yaml": [namespace(opts)],
        "engine.yaml": engine_objects(spec, opts),
        "gateway.yaml": gateway_objects(spec, opts),
        "policy.yaml": policy_objects(spec, opts),
        "monitoring.yaml": monitoring_objects(opts),
    }
    if opts.autoscale:
        files["keda.yaml"] = keda.scaled_objects(spec, opts)
    files["kserve.yaml"] = extras.kserve_objects(spec, opts)
    files["inference-extension.yaml"] = extras.inference_extension_objects(spec, opts)
    return files


BASE_EXCLUDED = ("kserve.yaml", "inference-extension.yaml")


def kustomization(files: dict[str, list[Manifest]], opts: K8sOptions) -> Manifest:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": opts.namespace,
        "resources": [name for name in files if name not in BASE_EXCLUDED],
    }
