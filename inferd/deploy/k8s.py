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

Everything is checked before rendering: the spec when it is read (errors name the line), the options
here (`K8sOptions.check`); a rendered object is only ever built from valid input.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from inferd.errors import ConfigError
from inferd.fleet.spec import FleetSpec, ModelSpec, PoolSpec

ENGINE_PORT = 8000
GATEWAY_PORT = 9000
PROXY_PORT = 8000
KV_PORT = 9100  # a prefill pod's KV transfer channel
KV_SECRET_NAME = "inferd-kv"  # Secret with key `secret`, the same for every prefill and decode pod
UID = 1000  # the image's `inferd` user (see Dockerfile)
CACHE_DIR = "/cache"  # the model cache volume: Hugging Face downloads, compiled kernels

Manifest = dict


@dataclass
class K8sOptions:
    namespace: str = "inferd"
    image: str = "ghcr.io/inferd/inferd:0.1.0"
    gpu: bool = False  # nvidia.com/gpu requests (a pool's resources.gpu, at least 1) and the CUDA image
    autoscale: bool = False  # KEDA ScaledObjects from each pool's autoscaling policy
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    startup_timeout_s: int = 1200  # how long a replica may take to load its model before it is restarted
    model_cache_pvc: str | None = None  # a PersistentVolumeClaim for the model cache (default: emptyDir)
    cache_size: str = "20Gi"  # emptyDir size limit when no PVC is given
    drain_timeout_s: int = 30  # inferd serve --drain-timeout; the pod's grace period adds a margin
    vllm_metric_names: bool = True  # replicas also export vllm:* names (llm-d's picker, vLLM dashboards)
    inference_gateway: str = "inference-gateway"  # the Gateway (API) the HTTPRoute attaches to
    gateway_replicas: int | None = None  # default: 2 when the gateway shares state through Redis, else 1

    def check(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace) or len(self.namespace) > 63:
            raise ConfigError(f"--namespace {self.namespace!r} is not a valid Kubernetes namespace name")
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image {self.image!r} is not an image reference")
        if not self.prometheus_url.startswith(("http://", "https://")):
            raise ConfigError(f"--prometheus-url must start with http:// or https://, got {self.prometheus_url!r}")
        if self.startup_timeout_s < 10:
            raise ConfigError("--startup-timeout must be at least 10 seconds")
        if self.gateway_replicas is not None and self.gateway_replicas < 1:
            raise ConfigError("--gateway-replicas must be at least 1")


# -- names and labels ------------------------------------------------------------------------------
def pool_name(pool: PoolSpec) -> str:
    return f"inferd-{pool.name}"


def proxy_name(model: ModelSpec) -> str:
    return f"inferd-{_decode(model).name}-proxy"


def _decode(model: ModelSpec) -> PoolSpec:
    return next(p for p in model.pools if p.role == "decode")


def _prefill(model: ModelSpec) -> PoolSpec:
    return next(p for p in model.pools if p.role == "prefill")


def _label_value(text: str) -> str:
    """A label value: 63 characters of [A-Za-z0-9_.-], starting and ending alphanumeric."""
    v = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return v or "x"


def pool_labels(model: ModelSpec, pool: PoolSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "inferd",
        "app.kubernetes.io/component": "engine",
        "inferd.dev/pool": pool.name,
        "inferd.dev/model": _label_value(model.name),
        "inferd.dev/role": pool.role,
    }


def _selector(model: ModelSpec, pool: PoolSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inferd", "inferd.dev/pool": pool.name}


def _meta(name: str, opts: K8sOptions, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": opts.namespace, "labels": labels}


def svc_dns(name: str, opts: K8sOptions) -> str:
    return f"{name}.{opts.namespace}.svc.cluster.local"


# -- pod pieces ------------------------------------------------------------------------------------
def _security_context() -> tuple[dict, dict]:
    pod = {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "fsGroup": UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    return pod, container


def _cache_volumes(opts: K8sOptions) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, mounts, env): the model cache and a writable /tmp under a read-only root filesystem."""
    if opts.model_cache_pvc:
        cache = {"name": "model-cache", "persistentVolumeClaim": {"claimName": opts.model_cache_pvc}}
    else:
        cache = {"name": "model-cache", "emptyDir": {"sizeLimit": opts.cache_size}}
    volumes = [cache, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "model-cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    env = [
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "TORCH_EXTENSIONS_DIR", "value": f"{CACHE_DIR}/torch_extensions"},
        {"name": "HOME", "value": "/tmp"},
    ]
    return volumes, mounts, env


def _quantity(x: float) -> str | int:
    """CPU as Kubernetes writes it: whole cores as an integer, else millicores."""
    return int(x) if float(x).is_integer() else f"{round(x * 1000)}m"


def _resources(pool: PoolSpec, opts: K8sOptions) -> dict:
    r = pool.resources
    requests: dict = {"cpu": _quantity(r.cpu), "memory": r.memory}
    limits: dict = {"memory": r.memory}  # no CPU limit: throttling a decode loop costs latency, not fairness
    gpus = max(1, r.gpu) if opts.gpu else r.gpu
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = gpus
    return {"requests": requests, "limits": limits}


def _http_probe(path: str, port: str, period: int, failures: int, timeout: int = 3) -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _probes(opts: K8sOptions) -> dict:
    """Startup covers model loading (the server opens its port once the model is ready), then readiness
    takes a replica out of its Service within ~10 s (draining turns /health to 503 at once) and liveness
    restarts a replica that stopped answering for a minute."""
    period = 10
    return {
        "startupProbe": _http_probe("/health", "http", period, math.ceil(opts.startup_timeout_s / period)),
        "readinessProbe": _http_probe("/health", "http", 5, 2),
        "livenessProbe": _http_probe("/health", "http", 10, 6, timeout=5),
    }


def image_for(opts: K8sOptions, gpu: bool | None = None) -> str:
    """The CUDA variant of the image (`-cuda` tag suffix, see Dockerfile) for a container using GPUs."""
    if not (opts.gpu if gpu is None else gpu) or opts.image.endswith("-cuda"):
        return opts.image
    name, _, tag = opts.image.rpartition(":")
    if name and "/" not in tag:
        return f"{name}:{tag}-cuda"
    return f"{opts.image}:latest-cuda"


def engine_args(spec: FleetSpec, model: ModelSpec, pool: PoolSpec, opts: K8sOptions) -> list[str]:
    args = ["serve", "--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--drain-timeout", str(opts.drain_timeout_s)]
    args += spec.serve_argv(model, pool)
    if pool.role == "prefill":  # each pod's KV channel, advertised at its own IP (Kubernetes expands $(POD_IP))
        args += ["--kv-host", "0.0.0.0", "--kv-port", str(KV_PORT), "--kv-advertise-host", "$(POD_IP)"]
    elif pool.role == "decode":  # pull only from the prefill pool's pods: the addresses its headless Service names
        args += ["--kv-peers", f"{svc_dns(pool_name(_prefill(model)), opts)}:{KV_PORT}"]
    if opts.vllm_metric_names:
        args += ["--metrics-names", "vllm"]
    return args


def engine_container(spec: FleetSpec, model: ModelSpec, pool: PoolSpec, opts: K8sOptions) -> dict:
    _, sc = _security_context()
    _, mounts, env = _cache_volumes(opts)
    resources = _resources(pool, opts)
    return {
        "name": "main",
        "image": image_for(opts, gpu="nvidia.com/gpu" in resources["requests"]),
        "imagePullPolicy": "IfNotPresent",
        "command": ["inferd"],
        "args": engine_args(spec, model, pool, opts),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
        + ([{"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"}] if pool.role == "prefill" else []),
        "env": env + _kv_env(pool),
        "resources": resources,
        "securityContext": sc,
        "volumeMounts": mounts,
        # the endpoints controller needs a moment to take the pod out of the Service after SIGTERM
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        **_probes(opts),
    }


def _kv_env(pool: PoolSpec) -> list[dict]:
    """The KV channel's shared secret (from a Secret the operator creates, docs/deploy.md) and the pod's IP."""
    if pool.role == "both":
        return []
    secret = {"secretKeyRef": {"name": KV_SECRET_NAME, "key": "secret"}}
    env = [{"name": "INFERD_KV_SECRET", "valueFrom": secret}]
    if pool.role == "prefill":
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def _pod_spec(containers: list[dict], opts: K8sOptions, gpu: bool, volumes: list[dict] | None = None) -> dict:
    pod_sc, _ = _security_context()
    spec = {
        "securityContext": pod_sc,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": opts.drain_timeout_s + 15,
        "containers": containers,
        "volumes": volumes if volumes is not None else _cache_volumes(opts)[0],
    }
    if gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def _deployment(name: str, labels: dict, selector: dict, replicas: int, pod: dict, opts: K8sOptions) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, opts, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # a new replica must be ready (model loaded) before an old one goes
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def engine_deployment(spec: FleetSpec, model: ModelSpec, pool: PoolSpec, opts: K8sOptions) -> Manifest:
    container = engine_container(spec, model, pool, opts)
    gpu = "nvidia.com/gpu" in container["resources"]["requests"]
    labels = pool_labels(model, pool)
    dep = _deployment(
        pool_name(pool), labels, _selector(model, pool), pool.replicas, _pod_spec([container], opts, gpu), opts
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
        "metadata": _meta(name, opts, labels),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": ports,
        },
    }


def proxy_deployment(model: ModelSpec, opts: K8sOptions) -> Manifest:
    """`inferd disagg proxy` in front of a disaggregated model: prefill on one pool, decode on the other."""
    decode, prefill = _decode(model), _prefill(model)
    _, sc = _security_context()
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
        "readinessProbe": _http_probe("/health", "http", 5, 2),
        "livenessProbe": _http_probe("/health", "http", 10, 6, timeout=5),
    }
    labels = pool_labels(model, decode) | {"app.kubernetes.io/component": "disagg-proxy"}
    selector = {"app.kubernetes.io/name": "inferd", "inferd.dev/proxy-for": decode.name}
    labels |= selector
    pod = _pod_spec([container], opts, gpu=False, volumes=[{"name": "tmp", "emptyDir": {}}])
    return _deployment(proxy_name(model), labels, selector, 2, pod, opts)


def _proxy_selector(model: ModelSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inferd", "inferd.dev/proxy-for": _decode(model).name}


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


def gateway_yaml(spec: FleetSpec, opts: K8sOptions) -> str:
    import yaml

    cfg = spec.gateway_config(gateway_endpoints(spec, opts))
    cfg.listen.host, cfg.listen.port = "0.0.0.0", GATEWAY_PORT
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
        "metadata": _meta("inferd-gateway", opts, labels),
        "data": {"gateway.yaml": gateway_yaml(spec, opts)},
    }
    _, sc = _security_context()
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
        "readinessProbe": _http_probe("/health", "http", 5, 2),
        "livenessProbe": _http_probe("/health", "http", 10, 6, timeout=5),
    }
    volumes = [{"name": "config", "configMap": {"name": "inferd-gateway"}}, {"name": "tmp", "emptyDir": {}}]
    pod = _pod_spec([container], opts, gpu=False, volumes=volumes)
    # a changed config rolls the gateway (kubectl apply after a re-render)
    import hashlib

    digest = hashlib.sha256(config_map["data"]["gateway.yaml"].encode()).hexdigest()[:16]
    deployment = _deployment("inferd-gateway", labels, labels, _gateway_replicas(spec, opts), pod, opts)
    deployment["spec"]["template"]["metadata"]["annotations"] = {"inferd.dev/config-sha256": digest}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta("inferd-gateway", opts, labels),
        "spec": {
            "type": "ClusterIP",
            "selector": labels,
            "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [config_map, deployment, service]


# -- policy and monitoring ---------------------------------------------------------------------------
def pdb(name: str, labels: dict, selector: dict, opts: K8sOptions) -> Manifest:
    """At most one pod of the set down for a voluntary disruption (a node drain), whatever the replica count."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, opts, labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def service_monitor(name: str, labels: dict, selector: dict, opts: K8sOptions, interval: str = "15s") -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(name, opts, labels),
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
        out.append(headless_service(pool_name(p), pool_labels(m, p), _selector(m, p), ENGINE_PORT, opts, kv_port))
    for m in spec.models:
        if m.disaggregated:
            proxy = proxy_deployment(m, opts)
            out.append(proxy)
            labels = proxy["metadata"]["labels"]
            out.append(headless_service(proxy_name(m), labels, _proxy_selector(m), PROXY_PORT, opts))
    return out


def policy_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    out = [pdb(pool_name(p), pool_labels(m, p), _selector(m, p), opts) for m, p in spec.pools()]
    for m in spec.models:
        if m.disaggregated:
            labels = pool_labels(m, _decode(m)) | {"app.kubernetes.io/component": "disagg-proxy"}
            out.append(pdb(proxy_name(m), labels, _proxy_selector(m), opts))
    if _gateway_replicas(spec, opts) > 1:
        gw = {"app.kubernetes.io/name": "inferd", "app.kubernetes.io/component": "gateway"}
        out.append(pdb("inferd-gateway", gw, gw, opts))
    return out


def monitoring_objects(opts: K8sOptions) -> list[Manifest]:
    import json

    from inferd.deploy.observability import dashboard

    base = {"app.kubernetes.io/name": "inferd"}
    # Grafana's dashboard sidecar (kube-prometheus-stack) loads ConfigMaps labelled grafana_dashboard=1
    grafana = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta("inferd-grafana-dashboard", opts, base | {"grafana_dashboard": "1"}),
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
    from inferd.deploy import extras, keda

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
