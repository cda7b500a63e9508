"""The pieces every Kubernetes renderer builds from: the options, names, labels and the engine's pod.

`k8s.py` (the plain manifests), `keda.py` (ScaledObjects) and `extras.py` (KServe, the Gateway API Inference
Extension) all render the same engine container (`engine_container`: `inferd serve` with the pool's flags,
probes, a non-root security context, the model cache) and name and label pools the same way, so the objects
each file writes select the same pods. This module imports none of them: each imports it.
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
    return f"inferd-{decode_pool(model).name}-proxy"


def decode_pool(model: ModelSpec) -> PoolSpec:
    return next(p for p in model.pools if p.role == "decode")


def prefill_pool(model: ModelSpec) -> PoolSpec:
    return next(p for p in model.pools if p.role == "prefill")


def label_value(text: str) -> str:
    """A label value: 63 characters of [A-Za-z0-9_.-], starting and ending alphanumeric."""
    v = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return v or "x"


def pool_labels(model: ModelSpec, pool: PoolSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "inferd",
        "app.kubernetes.io/component": "engine",
        "inferd.dev/pool": pool.name,
        "inferd.dev/model": label_value(model.name),
        "inferd.dev/role": pool.role,
    }


def pool_selector(model: ModelSpec, pool: PoolSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inferd", "inferd.dev/pool": pool.name}


def meta(name: str, opts: K8sOptions, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": opts.namespace, "labels": labels}


def svc_dns(name: str, opts: K8sOptions) -> str:
    return f"{name}.{opts.namespace}.svc.cluster.local"


# -- pod pieces ------------------------------------------------------------------------------------
def security_context() -> tuple[dict, dict]:
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


def http_probe(path: str, port: str, period: int, failures: int, timeout: int = 3) -> dict:
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
        "startupProbe": http_probe("/health", "http", period, math.ceil(opts.startup_timeout_s / period)),
        "readinessProbe": http_probe("/health", "http", 5, 2),
        "livenessProbe": http_probe("/health", "http", 10, 6, timeout=5),
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
        args += ["--kv-peers", f"{svc_dns(pool_name(prefill_pool(model)), opts)}:{KV_PORT}"]
    if opts.vllm_metric_names:
        args += ["--metrics-names", "vllm"]
    return args


def engine_container(spec: FleetSpec, model: ModelSpec, pool: PoolSpec, opts: K8sOptions) -> dict:
    _, sc = security_context()
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


def pod_spec(containers: list[dict], opts: K8sOptions, gpu: bool, volumes: list[dict] | None = None) -> dict:
    pod_sc, _ = security_context()
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


def deployment_manifest(
    name: str, labels: dict, selector: dict, replicas: int, pod: dict, opts: K8sOptions
) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, opts, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # a new replica must be ready (model loaded) before an old one goes
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
