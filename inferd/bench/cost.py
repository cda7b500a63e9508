"""Cost per million tokens: price per hour x replicas / (tokens per second x 3600) x 1e6.

Computed for raw throughput and for goodput (the tokens of requests that met every SLO), per million output
tokens and per million total (input + output) tokens. No throughput means no finite cost: None.
"""

from __future__ import annotations

from collections.abc import Sequence


def cost_per_million(price_per_hour: float, replicas: int, tokens_per_s: float | None) -> float | None:
    if not tokens_per_s or tokens_per_s <= 0:
        return None
    return price_per_hour * replicas / (tokens_per_s * 3600.0) * 1e6


def cost_fields(run: dict, price_per_hour: float | None, replicas: int = 1) -> dict:
    """Cost fields for one run's metrics dict; empty without a price."""
    if price_per_hour is None:
        return {}

    def cost(tps: float | None) -> float | None:
        return cost_per_million(price_per_hour, replicas, tps)

    return {
        "price_per_hour": price_per_hour,
        "replicas": replicas,
        "cost_per_million_output_tokens": cost(run.get("output_throughput")),
        "cost_per_million_total_tokens": cost(run.get("total_token_throughput")),
        "goodput_cost_per_million_output_tokens": cost(run.get("output_goodput")),
        "goodput_cost_per_million_total_tokens": cost(run.get("total_token_goodput")),
    }


def best_level(runs: Sequence[dict], level_key: str, attainment: float) -> dict | None:
    """The highest load of a sweep whose share of requests meeting every SLO is at least `attainment`.

    Runs without SLOs have no best level. Failed requests count as missing the SLOs.
    """
    meeting = [r for r in runs if r.get("slo_attainment") is not None and r["slo_attainment"] >= attainment]
    if not meeting:
        return None
    best = max(meeting, key=lambda r: float(r[level_key]))
    keys = (
        level_key,
        "slo_attainment",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "output_goodput",
        "cost_per_million_output_tokens",
        "cost_per_million_total_tokens",
        "goodput_cost_per_million_output_tokens",
        "goodput_cost_per_million_total_tokens",
    )
    return {"level_key": level_key, "required_attainment": attainment} | {k: best.get(k) for k in keys if k in best}
