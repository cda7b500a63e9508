"""The fleet spec: one YAML file for models, their pools of replicas, the gateway and the scaling policy.

```yaml
models:
  - name: gemma                      # the name clients send as `model`
    aliases: [gemma-3-270m]
    model: gemma3-270m               # what the replicas load (alias, folder, .gguf)
    engine: {max_num_seqs: 16}       # engine settings (inferd serve's flags, by field name)
    pools:
      - name: gemma-both
        role: both                   # both | prefill | decode
        replicas: 1                  # initial (and fixed, without autoscaling)
        resources: {cpu: 2, memory: 4Gi}
        autoscaling:
          min_replicas: 1
          max_replicas: 3
          targets: {waiting: 4, kv_cache_usage: 0.8}
gateway:                             # inferd gateway's settings, less `pools` and `models` (derived here)
  routing: {picker: scored}
```

A model has either `both` pools, or exactly one `prefill` and one `decode` pool (disaggregated).
Everything here is checked when the file is read, with errors naming the line; the tools that consume
the spec (`serve_argv`, `engine_config`, `gateway_config`) never meet an invalid one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferd.config import (
    DEFAULT_MODEL,
    EngineConfig,
    engine_argv,
    engine_config_from_argv,
    parse_memory,
)
from inferd.errors import ConfigError
from inferd.gateway.config import GatewayConfig
from inferd.yaml_config import RefError, parse_yaml_model, read_text

Role = Literal["both", "prefill", "decode"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Targets(_Model):
    """Per-replica targets; each set one gives replicas = ceil(fleet total / target), the largest wins (as HPA/KEDA).

    Latency targets (`ttft_p95_s`, `itl_p95_s`, `predicted_ttft_s`) are fleet-wide values, not totals:
    they scale the current replicas by value / target.
    """

    waiting: float | None = Field(4.0, gt=0, description="waiting requests per replica")
    running: float | None = Field(None, gt=0, description="running requests per replica")
    kv_cache_usage: float | None = Field(0.8, gt=0, le=1, description="KV cache usage fraction per replica")
    ttft_p95_s: float | None = Field(None, gt=0, description="TTFT p95 over the window, seconds")
    itl_p95_s: float | None = Field(None, gt=0, description="inter-token latency p95 over the window, seconds")
    predicted_ttft_s: float | None = Field(None, gt=0, description="queued prompt tokens / prefill rate, seconds")
    request_rate: float | None = Field(None, gt=0, description="requests/s per replica")
    token_rate: float | None = Field(None, gt=0, description="tokens/s (prompt + output) per replica")


class AutoscalingPolicy(_Model):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    targets: Targets = Targets()
    interval_s: float = Field(5.0, gt=0, description="how often signals are read and a decision made")
    window_s: float = Field(30.0, gt=0, description="window of the rates and latency quantiles")
    scale_up_stabilization_s: float = Field(0.0, ge=0, description="scale up to the lowest desire over this window")
    scale_down_stabilization_s: float = Field(
        60.0, ge=0, description="scale down to the highest desire over this window"
    )
    max_scale_up_step: int = Field(4, ge=1, description="most replicas added in one decision")
    max_scale_down_step: int = Field(1, ge=1, description="most replicas removed in one decision")
    cooldown_s: float = Field(30.0, ge=0, description="no scale-down within this long of the last change")
    scale_to_zero_after_s: float | None = Field(
        None, gt=0, description="with min_replicas 0: no request for this long scales to zero"
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        if self.scale_to_zero_after_s is not None and self.min_replicas != 0:
            raise ValueError("scale_to_zero_after_s needs min_replicas: 0")
        if not any(v is not None for v in self.targets.model_dump().values()):
            raise RefError(("targets",), "set at least one target")
        return self


class Resources(_Model):
    """Per replica; what Kubernetes requests and what `inferd up` gives each process (threads)."""

    cpu: float = Field(2.0, gt=0, description="cores")
    memory: str = Field("4Gi", description="e.g. 4Gi, 512Mi")
    gpu: int = Field(0, ge=0, description="nvidia.com/gpu")

    @model_validator(mode="after")
    def _memory(self) -> Resources:
        try:
            parse_memory(self.memory)
        except ConfigError as e:
            raise RefError(("memory",), str(e)) from None
        return self

    @property
    def threads(self) -> int:
        return max(1, math.floor(self.cpu))


class PoolSpec(_Model):
    name: str = Field(min_length=1, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=50)
    role: Role = "both"
    replicas: int = Field(1, ge=0, description="initial replicas; fixed without autoscaling")
    resources: Resources = Resources()
    engine: dict[str, Any] = Field(default_factory=dict, description="engine settings over the model's")
    autoscaling: AutoscalingPolicy | None = None

    @model_validator(mode="after")
    def _replicas_in_bounds(self) -> PoolSpec:
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise RefError(("replicas",), f"replicas {self.replicas} is outside [{a.min_replicas}, {a.max_replicas}]")
        return self


class ModelSpec(_Model):
    name: str = Field(min_length=1, description="the name clients send as `model`")
    aliases: list[str] = Field(default_factory=list)
    model: str = Field(DEFAULT_MODEL, description="what the replicas load: alias, folder, .gguf, hub id")
    engine: dict[str, Any] = Field(default_factory=dict, description="engine settings for every pool")
    pools: list[PoolSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        roles = [p.role for p in self.pools]
        if "both" in roles and len(set(roles)) > 1:
            raise RefError(("pools",), "a model has either `both` pools, or one prefill and one decode pool")
        if "both" not in roles and sorted(roles) != ["decode", "prefill"]:
            raise RefError(("pools",), "a disaggregated model needs exactly one prefill and one decode pool")
        for where, settings in [(("engine",), self.engine)] + [
            (("pools", i, "engine"), p.engine) for i, p in enumerate(self.pools)
        ]:
            try:  # read as a replica reads its flags
                engine_config_from_argv(["--model", self.model, *engine_argv(self.engine | settings)]).validate()
            except (ConfigError, TypeError) as e:
                raise RefError(where, str(e)) from None
        return self

    @property
    def disaggregated(self) -> bool:
        return self.pools[0].role != "both"

    def engine_settings(self, pool: PoolSpec) -> dict[str, Any]:
        return self.engine | pool.engine

    def engine_flags(self, pool: PoolSpec) -> list[str]:
        """The engine flags of one replica of `pool`, less --model: its settings, and its threads from
        resources.cpu unless the settings name them."""
        settings = self.engine_settings(pool)
        if "num_threads" not in settings:
            settings = settings | {"num_threads": pool.resources.threads}
        return engine_argv(settings)

    def engine_config(self, pool: PoolSpec) -> EngineConfig:
        """The engine config `inferd serve` builds from a replica's flags: every setting the spec leaves out
        is the engine's default (`inferd.config`)."""
        return engine_config_from_argv(["--model", self.model, *self.engine_flags(pool)])

    def adapters(self) -> list[str]:
        """The LoRA adapters its replicas serve from the start (`lora_modules` in `engine`), by name: clients
        send them as `model` too."""
        names = [name for p in self.pools for name, _ in self.engine_config(p).lora.modules()]
        return list(dict.fromkeys(names))


class FleetSpec(_Model):
    models: list[ModelSpec] = Field(min_length=1)
    gateway: dict[str, Any] = Field(default_factory=dict, description="inferd gateway settings, less pools/models")

    @model_validator(mode="after")
    def _check(self) -> FleetSpec:
        names: set[str] = set()
        for i, m in enumerate(self.models):
            for n in [m.name, *m.aliases, *m.adapters()]:
                if n in names:
                    raise RefError(("models", i, "name"), f"model name, alias or adapter {n!r} is used twice")
                names.add(n)
        pools = [p.name for m in self.models for p in m.pools]
        if len(set(pools)) != len(pools):
            raise RefError(("models",), f"pool names must be unique across the fleet: {pools}")
        for key in ("pools", "models"):
            if key in self.gateway:
                raise RefError(("gateway", key), f"gateway.{key} is derived from the fleet's models; remove it")
        try:  # validate the gateway section now, with placeholder pools
            self.gateway_config({p.name: {"replicas": ["http://127.0.0.1:1"]} for _, p in self.pools()})
        except ValidationError as e:
            first = e.errors()[0]
            raise RefError(("gateway", *first["loc"]), first["msg"]) from None
        return self

    def pools(self) -> list[tuple[ModelSpec, PoolSpec]]:
        return [(m, p) for m in self.models for p in m.pools]

    def serve_argv(self, model: ModelSpec, pool: PoolSpec) -> list[str]:
        """`inferd serve` arguments for one replica of `pool` (host and port are the caller's)."""
        argv = ["--model", model.model, "--served-model-name", model.name]
        if pool.role != "both":
            argv += ["--role", pool.role]
        return argv + model.engine_flags(pool)

    def gateway_config(self, endpoints: dict[str, dict[str, Any]]) -> GatewayConfig:
        """The gateway's config for this fleet, given where each front pool's replicas are found.

        `endpoints[pool]` is a gateway pool's discovery fields: `{"replicas": [urls]}`, `{"replicas_file":
        path}` (what `inferd up` rewrites as replicas come and go) or `{"replicas_dns": {...}}` (a
        Kubernetes headless Service). The front pool of a disaggregated model is its decode pool, whose
        endpoints are the disaggregation proxies in front of it.
        """
        pools, routes = [], []
        for m in self.models:
            front = [p for p in m.pools if p.role in ("both", "decode")]
            for p in front:
                engine = m.engine_config(p)
                pools.append(
                    {"name": p.name, "model": m.name, "block_size": engine.cache.block_size,
                     "scheduling_policy": engine.scheduler.scheduling_policy} | endpoints[p.name]
                )  # fmt: skip
            backends = [{"pool": p.name} for p in front]
            routes.append({"name": m.name, "aliases": m.aliases, "adapters": m.adapters(), "backends": backends})
        return GatewayConfig.model_validate(self.gateway | {"pools": pools, "models": routes})


def parse_fleet(text: str, source: str = "<fleet>") -> FleetSpec:
    return parse_yaml_model(text, FleetSpec, source, "fleet spec")


def load_fleet(path: str | Path) -> FleetSpec:
    return parse_fleet(read_text(path, "fleet spec"), str(path))
