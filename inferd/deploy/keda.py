"""KEDA ScaledObjects from a pool's autoscaling policy: the same targets `inferd up` scales on, as
Prometheus triggers on inferd's metric names.

HPA (which KEDA drives) computes, per trigger of type AverageValue, desired = ceil(query / threshold)
and takes the largest: exactly the policy's "replicas = ceil(fleet total / per-replica target), the
largest over signals". So each query returns ONE value, the pool's total:

- waiting, running, KV cache usage: `sum(gauge{pool})`;
- request and token rates: `sum(rate(counter{pool}[window]))`;
- TTFT and ITL p95 (fleet-wide values, not totals): the p95 times the number of replicas reporting,
  so ceil(p95 * n / target) scales the current replicas by p95 / target, as the policy does.
  An empty histogram's NaN reads as 0 (`> 0 or vector(0)`), never as an error.

The policy's windows map to HPA's behavior: scale-up stabilisation and step, scale-down stabilisation
(the longer of it and the cooldown: HPA has no separate cooldown) and step, per polling interval.
Scale from zero: a pool with `min_replicas: 0` gets a demand trigger on the gateway's requests for
the model (answered or queued, over the idle period) clamped to 1: any demand activates the pool and
holds one replica, and KEDA's `cooldownPeriod` (the policy's `scale_to_zero_after_s`) returns it to
zero after that long without. If the metrics cannot be read, `fallback` holds the pool at its initial
replicas. `predicted_ttft_s` needs the queued prompt tokens, which no exported metric carries: it is
left to `inferd up`'s autoscaler and a warning says so.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from inferd.deploy.pods import K8sOptions, Manifest, pool_labels, pool_name
from inferd.fleet.spec import AutoscalingPolicy, FleetSpec, ModelSpec, PoolSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trigger:
    name: str
    query: str
    threshold: float


def _num(x: float) -> str:
    """A threshold as KEDA reads it: a plain decimal string."""
    return f"{x:.6g}" if not float(x).is_integer() else str(int(x))


def _selector(pool: PoolSpec, opts: K8sOptions) -> str:
    # target labels the Prometheus operator sets from the ServiceMonitor: namespace and service
    return f'namespace="{opts.namespace}",service="{pool_name(pool)}"'


def _p95_times_replicas(hist: str, sel: str, window: str) -> str:
    q = f"histogram_quantile(0.95, sum by (le) (rate(inferd:{hist}_bucket{{{sel}}}[{window}])))"
    return f"(({q} * count(inferd:num_requests_running{{{sel}}})) > 0) or vector(0)"


def triggers(pool: PoolSpec, policy: AutoscalingPolicy, opts: K8sOptions) -> list[Trigger]:
    t, sel, w = policy.targets, _selector(pool, opts), f"{math.ceil(policy.window_s)}s"
    queries = {
        "waiting": f"sum(inferd:num_requests_waiting{{{sel}}})",
        "running": f"sum(inferd:num_requests_running{{{sel}}})",
        "kv_cache_usage": f"sum(inferd:kv_cache_usage_perc{{{sel}}})",
        "ttft_p95_s": _p95_times_replicas("time_to_first_token_seconds", sel, w),
        "itl_p95_s": _p95_times_replicas("inter_token_latency_seconds", sel, w),
        "request_rate": f"sum(rate(inferd:e2e_request_latency_seconds_count{{{sel}}}[{w}]))",
        "token_rate": (
            f"sum(rate(inferd:prompt_tokens_total{{{sel}}}[{w}]))"
            f" + sum(rate(inferd:generation_tokens_total{{{sel}}}[{w}]))"
        ),
    }
    out = []
    for name, target in t.model_dump().items():
        if target is None:
            continue
        if name not in queries:
            logger.warning(
                "pool %s: target %s has no Prometheus metric; KEDA scales on the other targets", pool.name, name
            )
            continue
        out.append(Trigger(name, queries[name], target))
    return out


def demand_trigger(model: ModelSpec, policy: AutoscalingPolicy, opts: K8sOptions) -> Trigger:
    """Requests for the model at the gateway (answered, or waiting there for a replica), clamped to 1."""
    names = "|".join(re.escape(n) for n in [model.name, *model.aliases])
    idle = f"{math.ceil(policy.scale_to_zero_after_s or policy.cooldown_s or 60)}s"
    gw = f'namespace="{opts.namespace}",service="inferd-gateway"'
    query = (
        f'clamp_max((sum(increase(inferd_gateway_requests_total{{{gw},model=~"{names}"}}[{idle}])) or vector(0))'
        f" + (sum(inferd_gateway_queue_size{{{gw}}}) or vector(0)), 1)"
    )
    return Trigger("demand", query, 1)


def _behavior(policy: AutoscalingPolicy) -> dict:
    period = max(1, math.ceil(policy.interval_s))
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": math.ceil(policy.scale_up_stabilization_s),
            "policies": [{"type": "Pods", "value": policy.max_scale_up_step, "periodSeconds": period}],
            "selectPolicy": "Max",
        },
        "scaleDown": {
            "stabilizationWindowSeconds": math.ceil(max(policy.scale_down_stabilization_s, policy.cooldown_s)),
            "policies": [{"type": "Pods", "value": policy.max_scale_down_step, "periodSeconds": period}],
            "selectPolicy": "Max",
        },
    }


def scaled_object(model: ModelSpec, pool: PoolSpec, opts: K8sOptions) -> Manifest:
    policy = pool.autoscaling
    assert policy is not None
    trig = triggers(pool, policy, opts)
    if policy.min_replicas == 0:
        trig.append(demand_trigger(model, policy, opts))
    name = pool_name(pool)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": pool_labels(model, pool)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": policy.min_replicas,
            "maxReplicaCount": policy.max_replicas,
            "pollingInterval": max(1, math.ceil(policy.interval_s)),
            "cooldownPeriod": math.ceil(policy.scale_to_zero_after_s or policy.cooldown_s or 300),
            "fallback": {"failureThreshold": 3, "replicas": max(pool.replicas, policy.min_replicas, 1)},
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(policy)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "name": t.name.replace("_", "-"),
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": opts.prometheus_url,
                        "query": t.query,
                        "threshold": _num(t.threshold),
                        "activationThreshold": "0",
                        "ignoreNullValues": "true",
                    },
                }
                for t in trig
            ],
        },
    }


def scaled_objects(spec: FleetSpec, opts: K8sOptions) -> list[Manifest]:
    """One per pool with an autoscaling policy; pools without one keep their fixed replicas."""
    return [scaled_object(m, p, opts) for m, p in spec.pools() if p.autoscaling is not None]
