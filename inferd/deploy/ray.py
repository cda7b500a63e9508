"""The fleet rendered for Ray Serve: the `serve deploy` / `serve run` config file of the app in
`inferd.runtime.ray`.

A pool is an `engine-<pool>` deployment whose options (`deployment_options`: actor resources,
`max_ongoing_requests`, the request router, the autoscaling config with its custom policy) are plain JSON,
the same in the config file and in the app `inferd.runtime.ray.build` puts together in code. The config names
the app's builder, router and policy by import path only, so rendering needs neither Ray nor the engine:
this module reads the fleet spec and the engine's configured defaults, nothing else.
"""

from dataclasses import dataclass
from typing import Any

from inferd.config import parse_memory
from inferd.errors import ConfigError
from inferd.fleet.spec import FleetSpec, ModelSpec, PoolSpec

APP_NAME = "inferd"
INGRESS_NAME = "OpenAIIngress"
ROUTING_STATS_PERIOD_S = 1.0
# what the config names in the runtime's app (`inferd.runtime.ray`), as Serve imports them
BUILD_APP = "inferd.runtime.ray:build_app"
REQUEST_ROUTER = "inferd.runtime.ray:InferdRequestRouter"
AUTOSCALING_POLICY = "inferd.runtime.ray:PoolAutoscalingPolicy"


@dataclass
class RayOptions:
    metrics_names: str = "vllm"
    max_ongoing_requests: int | None = None  # per engine replica (default: twice the engine's max_num_seqs)
    host: str = "0.0.0.0"
    port: int = 8000


def deployment_name(pool: PoolSpec) -> str:
    return f"engine-{pool.name}"


def deployment_options(model: ModelSpec, pool: PoolSpec, opts: RayOptions) -> dict[str, Any]:
    """Serve options of a pool's engine deployment, JSON-serialisable (the same in code and config file)."""
    r = pool.resources
    actor: dict[str, Any] = {"num_cpus": r.cpu, "memory": parse_memory(r.memory)}
    if r.gpu:
        actor["num_gpus"] = r.gpu
    seqs = model.engine_config(pool).scheduler.max_num_seqs
    out: dict[str, Any] = {
        "name": deployment_name(pool),
        "max_ongoing_requests": opts.max_ongoing_requests or 2 * seqs,
        "ray_actor_options": actor,
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 30,
        "request_router_config": {
            "request_router_class": REQUEST_ROUTER,
            "request_router_kwargs": {},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
            "request_routing_stats_timeout_s": 10.0,
        },
    }
    a = pool.autoscaling
    if a is None:
        out["num_replicas"] = pool.replicas
        return out
    out["autoscaling_config"] = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "initial_replicas": pool.replicas,
        "look_back_period_s": a.window_s,
        "upscale_delay_s": a.scale_up_stabilization_s,
        "downscale_delay_s": max(a.scale_down_stabilization_s, a.cooldown_s),
        "policy": {"policy_function": AUTOSCALING_POLICY, "policy_kwargs": a.model_dump(mode="json")},
    }
    if a.min_replicas == 0 and a.scale_to_zero_after_s is not None:
        out["autoscaling_config"]["downscale_to_zero_delay_s"] = a.scale_to_zero_after_s
    return out


def check_spec(spec: FleetSpec) -> None:
    for i, m in enumerate(spec.models):
        if m.disaggregated:
            raise ConfigError(
                f"models.{i}: model {m.name!r} is disaggregated; the Ray app serves `both` pools only "
                "(deploy prefill/decode pools with `inferd up` or `inferd deploy k8s`)"
            )


def serve_config(spec: FleetSpec, opts: RayOptions | None = None) -> dict[str, Any]:
    """The `serve deploy` / `serve run` config file (Serve's ServeDeploySchema) for the fleet."""
    opts = opts or RayOptions()
    check_spec(spec)
    deployments = [deployment_options(m, p, opts) for m, p in spec.pools()]
    deployments.append({"name": INGRESS_NAME, "num_replicas": 1})
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": opts.host, "port": opts.port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": BUILD_APP,
                "args": {"spec": spec.model_dump(mode="json"), "metrics_names": opts.metrics_names},
                "deployments": deployments,
            }
        ],
    }
