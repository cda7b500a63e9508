"""A Grafana dashboard and Prometheus alert rules for a fleet, on the metrics inferd really exports.

The dashboard reads the replicas' `inferd:*` metrics (TTFT/ITL/E2E percentiles, token and request
throughput, queue, KV cache usage, prefix cache hit rate, preemptions) and the gateway's (per-tenant
tokens from `gen_ai_client_token_usage`, status codes, the gateway's queue, prefix-affinity hits).

The alerts are multiwindow, multi-burn-rate SLO alerts (Google SRE workbook, ch. 5): an SLO says
"`objective` of requests get their first token within `ttft_s`" (and likewise for inter-token
latency and for gateway availability); a page fires when the error budget burns 14.4x too fast
over both 1 h and 5 min, a ticket at 6x over both 6 h and 30 min. A latency SLO counts requests
under its threshold from the histogram bucket with that upper bound, so the threshold must be one
of the buckets (`inferd.server.metrics`): between buckets Prometheus could only interpolate.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.errors import ConfigError

# the replicas' histogram buckets (inferd/server/metrics.py, vLLM's): latency SLO thresholds must be one
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]

# (severity, burn rate, long window, short window): page on a fast burn, ticket on a slow one
BURN_WINDOWS = [("page", 14.4, "1h", "5m"), ("ticket", 6.0, "6h", "30m")]


@dataclass
class SLO:
    ttft_s: float = 1.0
    itl_s: float = 0.1
    objective: float = 0.99  # fraction of requests (tokens for ITL) within the thresholds, and answered OK

    def check(self, ttft_buckets: list[float] = TTFT_BUCKETS, itl_buckets: list[float] = ITL_BUCKETS) -> None:
        for name, value, buckets in (("ttft", self.ttft_s, ttft_buckets), ("itl", self.itl_s, itl_buckets)):
            if value not in buckets:
                near = min(buckets, key=lambda b: abs(b - value))
                raise ConfigError(
                    f"--{name}-slo {value:g}s is not a histogram bucket bound; use one of {buckets} (nearest: {near:g})"
                )
        if not 0.5 <= self.objective < 1:
            raise ConfigError(f"--slo-objective must be in [0.5, 1), got {self.objective}")


def _le(x: float) -> str:
    """A bucket bound as prometheus_client writes `le` (1 -> "1.0")."""
    return repr(float(x))


# -- PromQL ------------------------------------------------------------------------------------------
def _ratio_bad_latency(hist: str, threshold: float, window: str, sel: str = "") -> str:
    """Fraction of observations above `threshold` over `window` (0 when there were none)."""
    good = f'sum(rate(inferd:{hist}_bucket{{le="{_le(threshold)}"{sel}}}[{window}]))'
    total = f"sum(rate(inferd:{hist}_count{{{sel.lstrip(',')}}}[{window}]))"
    return f"(1 - {good} / {total})"


def _ratio_gateway_errors(window: str) -> str:
    bad = f'sum(rate(inferd_gateway_requests_total{{status=~"5.."}}[{window}]))'
    return f"({bad} / sum(rate(inferd_gateway_requests_total[{window}])))"


def alert_rules(slo: SLO) -> dict:
    """A Prometheus rules file (`rule_files:`), one group."""
    slo.check()
    budget = 1 - slo.objective
    sources = [
        ("TTFT", lambda w: _ratio_bad_latency("time_to_first_token_seconds", slo.ttft_s, w), f"TTFT > {slo.ttft_s}s"),
        ("ITL", lambda w: _ratio_bad_latency("inter_token_latency_seconds", slo.itl_s, w), f"ITL > {slo.itl_s}s"),
        ("Availability", _ratio_gateway_errors, "5xx answers at the gateway"),
    ]
    rules = []
    for name, ratio, what in sources:
        for severity, burn, long_w, short_w in BURN_WINDOWS:
            limit = f"{burn * budget:.6g}"
            rules.append(
                {
                    "alert": f"Inferd{name}SLOBurn{severity.capitalize()}",
                    "expr": f"{ratio(long_w)} > {limit} and {ratio(short_w)} > {limit}",
                    "for": "2m" if severity == "page" else "15m",
                    "labels": {"severity": severity, "slo": name.lower()},
                    "annotations": {
                        "summary": f"inferd {name} SLO error budget burning {burn}x too fast",
                        "description": (
                            f"{what} for more than {budget:.2%} of requests over {long_w} and {short_w} "
                            f"(objective {slo.objective:.2%}): at this rate the 30-day budget lasts "
                            f"{30 / burn:.1f} days."
                        ),
                    },
                }
            )
    rules.append(
        {
            "alert": "InferdReplicaQueueBacklog",
            "expr": "max by (model_name) (inferd:num_requests_waiting) > 32",
            "for": "5m",
            "labels": {"severity": "ticket"},
            "annotations": {"summary": "requests have waited at a replica for 5 minutes: scale out or shed load"},
        }
    )
    rules.append(
        {
            "alert": "InferdKVCacheFull",
            "expr": "max by (model_name) (inferd:kv_cache_usage_perc) > 0.95 and "
            "sum by (model_name) (rate(inferd:num_preemptions_total[5m])) > 0",
            "for": "10m",
            "labels": {"severity": "ticket"},
            "annotations": {"summary": "KV cache full and requests preempted: more replicas or more cache memory"},
        }
    )
    return {"groups": [{"name": "inferd-slo", "rules": rules}]}


# -- the dashboard -------------------------------------------------------------------------------------
SEL = 'model_name=~"$model_name"'
RI = "$__rate_interval"


def _q(hist: str, q: float) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate(inferd:{hist}_bucket{{{SEL}}}[{RI}])))"


def _panel(title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int, w: int = 12, h: int = 8) -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard(slo: SLO | None = None) -> dict:
    slo = slo or SLO()
    quantiles = [(0.5, "p50"), (0.95, "p95"), (0.99, "p99")]
    panels = [
        _panel("Time to first token", [(_q("time_to_first_token_seconds", q), n) for q, n in quantiles], "s", 0, 0),
        _panel("Inter-token latency", [(_q("inter_token_latency_seconds", q), n) for q, n in quantiles], "s", 12, 0),
        _panel(
            "Token throughput",
            [
                (f"sum(rate(inferd:prompt_tokens_total{{{SEL}}}[{RI}]))", "prompt tokens/s"),
                (f"sum(rate(inferd:generation_tokens_total{{{SEL}}}[{RI}]))", "generated tokens/s"),
            ],
            "short",
            0,
            8,
        ),
        _panel(
            "Requests finished",
            [(f"sum by (finished_reason) (rate(inferd:request_success_total{{{SEL}}}[{RI}]))", "{{finished_reason}}")],
            "reqps",
            12,
            8,
        ),
        _panel(
            "Queue",
            [
                (f"sum(inferd:num_requests_waiting{{{SEL}}})", "waiting at replicas"),
                (f"sum(inferd:num_requests_running{{{SEL}}})", "running"),
                ("sum(inferd_gateway_queue_size)", "waiting at the gateway"),
            ],
            "short",
            0,
            16,
        ),
        _panel(
            "KV cache usage",
            [(f"inferd:kv_cache_usage_perc{{{SEL}}}", "{{pod}}")],
            "percentunit",
            12,
            16,
        ),
        _panel(
            "Prefix cache hit rate",
            [
                (
                    f"sum(rate(inferd:prefix_cache_hits_total{{{SEL}}}[{RI}])) / "
                    f"sum(rate(inferd:prefix_cache_queries_total{{{SEL}}}[{RI}]))",
                    "replica prefix cache (tokens)",
                ),
                (
                    f'sum(rate(inferd_gateway_prefix_affinity_blocks_total{{result="hit"}}[{RI}])) / '
                    f"sum(rate(inferd_gateway_prefix_affinity_blocks_total[{RI}]))",
                    "gateway affinity (blocks)",
                ),
            ],
            "percentunit",
            0,
            24,
        ),
        _panel(
            "Preemptions",
            [(f"sum(rate(inferd:num_preemptions_total{{{SEL}}}[{RI}]))", "preemptions/s")],
            "short",
            12,
            24,
        ),
        _panel(
            "Tokens per tenant",
            [
                (
                    f"sum by (tenant, gen_ai_token_type) (rate(gen_ai_client_token_usage_sum[{RI}]))",
                    "{{tenant}} {{gen_ai_token_type}}",
                )
            ],
            "short",
            0,
            32,
        ),
        _panel(
            "Gateway answers",
            [(f"sum by (status) (rate(inferd_gateway_requests_total[{RI}]))", "{{status}}")],
            "reqps",
            12,
            32,
        ),
        _panel(
            "End-to-end latency and queue time (p95)",
            [
                (_q("e2e_request_latency_seconds", 0.95), "e2e p95"),
                (_q("request_queue_time_seconds", 0.95), "queue p95"),
            ],
            "s",
            0,
            40,
        ),
        _panel(
            "SLO: share of requests within the thresholds",
            [
                (f"1 - {_ratio_bad_latency('time_to_first_token_seconds', slo.ttft_s, RI, ',' + SEL)}", "TTFT"),
                (f"1 - {_ratio_bad_latency('inter_token_latency_seconds', slo.itl_s, RI, ',' + SEL)}", "ITL"),
            ],
            "percentunit",
            12,
            40,
        ),
    ]
    return {
        "title": "inferd",
        "uid": "inferd-fleet",
        "tags": ["inferd", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "model_name",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(inferd:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": panels,
    }


def expressions(dash: dict, rules: dict) -> list[str]:
    """Every PromQL expression in the dashboard and the rules."""
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [r["expr"] for g in rules["groups"] for r in g["rules"]]
