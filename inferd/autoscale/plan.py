"""The capacity planner: SLOs, a request rate and a price in; replicas, load per replica and cost out.

For one replica (its `Profile`) and the workload's lengths, it finds by simulation
- the saturation throughput: what a replica serves when requests never stop coming (the raw cost);
- the highest Poisson request rate at which the replica still meets every SLO given (TTFT p95 and
  ITL p95 over the run), by bisection;
then sizes the fleet as ceil(rate / that rate) and checks the whole fleet at the asked rate in the
simulator (the gateway's least-loaded routing usually does better than one replica alone; if it does
worse, replicas are added until it passes). Prices are inputs: the cost per million tokens is price x
replicas / tokens per hour, split between input and output tokens by the replica time spent
prefilling and decoding. With `disaggregated`, prefill and decode pools are also sized apart
(`plan_disaggregated`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from inferd.autoscale.profile import Profile
from inferd.autoscale.sim import SLO, simulate
from inferd.autoscale.workload import Workload, generate_arrivals, parse_lengths


@dataclass
class PlanInputs:
    rate: float
    slo: SLO
    price_per_hour: float
    prompt_len: str = "fixed:512"
    output_len: str = "fixed:128"
    burstiness: float = 1.0
    requests: int = 2000  # per simulation
    seed: int = 0


def _workload(inputs: PlanInputs, rate: float, n: int | None = None) -> Workload:
    rng = np.random.default_rng(inputs.seed)
    n = n or inputs.requests
    kind = "gamma" if inputs.burstiness != 1.0 else "poisson"
    t = generate_arrivals(f"{kind}:rate={rate},burstiness={inputs.burstiness},duration={n / rate}", rng)
    return Workload(t, parse_lengths(inputs.prompt_len, len(t), rng), parse_lengths(inputs.output_len, len(t), rng))


def meets(report: dict, slo: SLO) -> bool:
    if slo.ttft_p95_s is not None and (report["ttft_p95_s"] is None or report["ttft_p95_s"] > slo.ttft_p95_s):
        return False
    return slo.itl_p95_s is None or (report["itl_p95_s"] or 0.0) <= slo.itl_p95_s


def saturation(profile: Profile, inputs: PlanInputs) -> dict:
    """One replica under a queue that never empties: its most requests and tokens per second."""
    n = max(200, inputs.requests // 4)
    w = _workload(inputs, 1e6, n)
    return simulate(profile, w, replicas=1, price_per_hour=inputs.price_per_hour).report


def max_rate_at_slo(profile: Profile, inputs: PlanInputs, ceiling: float, iterations: int = 12) -> tuple[float, dict]:
    """The highest rate (requests/s) one replica serves within the SLOs; (0, report) if even a trickle fails."""
    lo, hi, best = 0.0, ceiling, None
    trickle = simulate(profile, _workload(inputs, ceiling * 0.01), replicas=1, slo=inputs.slo).report
    if not meets(trickle, inputs.slo):
        return 0.0, trickle
    for _ in range(iterations):
        mid = (lo + hi) / 2
        rep = simulate(profile, _workload(inputs, mid), replicas=1, slo=inputs.slo).report
        if meets(rep, inputs.slo):
            lo, best = mid, rep
        else:
            hi = mid
    return lo, best or trickle


def plan(profile: Profile, inputs: PlanInputs, max_replicas: int = 1000, disaggregated: bool = False) -> dict:
    sat = saturation(profile, inputs)
    r_sat = sat["request_throughput"]
    r_slo, at_slo = max_rate_at_slo(profile, inputs, r_sat)
    out = {
        "profile": profile.name,
        "rate": inputs.rate,
        "slo": {k: v for k, v in vars(inputs.slo).items() if v is not None},
        "prompt_len": inputs.prompt_len,
        "output_len": inputs.output_len,
        "price_per_hour": inputs.price_per_hour,
        "per_replica": {
            "saturation_request_rate": r_sat,
            "saturation_output_tokens_per_s": sat["output_token_throughput"],
            "max_request_rate_at_slo": r_slo,
            "at_slo": {k: at_slo.get(k) for k in ("ttft_p95_s", "itl_p95_s", "output_token_throughput")},
        },
        "raw_cost": _cost(inputs.price_per_hour, 1, sat),
    }
    if r_slo <= 0:
        out["replicas"] = None
        out["note"] = "one replica misses the SLOs even at a trickle of load: faster hardware or looser SLOs"
        return out
    n = math.ceil(inputs.rate / r_slo - 1e-9)
    while n <= max_replicas:
        fleet = simulate(profile, _workload(inputs, inputs.rate, inputs.requests * 2), replicas=n, slo=inputs.slo)
        if meets(fleet.report, inputs.slo):
            break
        n += 1
    rep = fleet.report
    out["replicas"] = n
    out["fleet"] = {k: rep[k] for k in ("ttft_p50_s", "ttft_p95_s", "itl_p95_s", "output_token_throughput")}
    out["fleet"]["utilisation"] = inputs.rate / (n * r_sat) if r_sat else None
    out["cost_at_slo"] = _cost(inputs.price_per_hour, n, rep, rate=inputs.rate)
    if disaggregated:
        d = plan_disaggregated(profile, inputs)
        if d["replicas"] is not None:
            d["cost_at_slo"] = _cost(inputs.price_per_hour, d["replicas"], rep, rate=inputs.rate)
        out["disaggregated"] = d
    return out


def _cost(price: float, replicas: int, report: dict, rate: float | None = None) -> dict:
    """Cost per million tokens for `replicas` serving `report`'s token rates (all of it, or at `rate`)."""
    scale = rate / report["request_throughput"] if rate and report["request_throughput"] else 1.0
    tin, tout = report["input_token_throughput"] * scale, report["output_token_throughput"] * scale
    per_hour = price * replicas
    share = report["prefill_time_share"]

    def per_m(cost: float, tps: float) -> float | None:
        return cost / (tps * 3600) * 1e6 if tps > 0 else None

    return {
        "per_million_tokens": per_m(per_hour, tin + tout),
        "per_million_input_tokens": per_m(per_hour * share, tin),
        "per_million_output_tokens": per_m(per_hour * (1 - share), tout),
        "per_hour": per_hour,
    }


def format_plan(p: dict) -> str:
    def money(x: float | None) -> str:
        return "-" if x is None else f"${x:,.4f}"

    pr = p["per_replica"]
    lines = [
        f"profile {p['profile']}: prompts {p['prompt_len']}, outputs {p['output_len']}, SLOs {p['slo']}",
        f"one replica: saturates at {pr['saturation_request_rate']:.2f} req/s "
        f"({pr['saturation_output_tokens_per_s']:.0f} output tok/s); within the SLOs up to "
        f"{pr['max_request_rate_at_slo']:.2f} req/s",
    ]
    if p.get("replicas") is None:
        return "\n".join([*lines, p.get("note", "")])
    f = p["fleet"]
    lines += [
        f"for {p['rate']:g} req/s: {p['replicas']} replicas (utilisation {f['utilisation']:.0%}), simulated "
        f"TTFT p50 {f['ttft_p50_s'] * 1000:.0f} ms p95 {f['ttft_p95_s'] * 1000:.0f} ms, "
        f"ITL p95 {(f['itl_p95_s'] or 0) * 1000:.1f} ms",
        f"at ${p['price_per_hour']:g}/replica-hour: ${p['cost_at_slo']['per_hour']:.2f}/hour",
        "cost per million tokens     all         input       output",
        *(
            f"  {label:<20}"
            + " ".join(
                f"{money(c[k]):>11}"
                for k in ("per_million_tokens", "per_million_input_tokens", "per_million_output_tokens")
            )
            for label, c in (("raw (saturated)", p["raw_cost"]), ("at the SLOs", p["cost_at_slo"]))
        ),
        "(input/output split by replica time spent prefilling/decoding)",
    ]
    d = p.get("disaggregated")
    if d is not None:
        pools = d["pools"]
        if d["replicas"] is None:
            lines.append("disaggregated: a pool misses its SLO even at a trickle of load")
        else:
            lines.append(
                f"disaggregated: {pools['prefill']['replicas']} prefill + {pools['decode']['replicas']} decode "
                f"replicas (each within its SLO up to {pools['prefill']['max_request_rate_at_slo']:.2f} and "
                f"{pools['decode']['max_request_rate_at_slo']:.2f} req/s), "
                f"{money(d['cost_at_slo']['per_million_tokens'])} per million tokens at the SLOs ({d['note']})"
            )
    return "\n".join(lines)


def plan_disaggregated(profile: Profile, inputs: PlanInputs) -> dict:
    """Separate prefill and decode pools, each sized on its own share of the work.

    A prefill replica runs only prompts (one output token, prefill at the profile's rate): it is sized so
    the prefill part of the TTFT meets the TTFT SLO less one decode step. A decode replica never prefills
    (the KV cache arrives from the prefill pool; its transfer is not modelled): it is sized on the ITL SLO,
    which prefill stalls no longer touch. Each pool is sized at the asked rate; the fleet's cost covers both.
    """
    from dataclasses import replace

    step1 = profile.step_s(1)
    prefill_prof = replace(profile, name=profile.name + " (prefill)", decode_step_s=[1e-6] * len(profile.decode_step_s))
    decode_prof = replace(profile, name=profile.name + " (decode)", prefill_tokens_per_s=1e12)
    ttft = inputs.slo.ttft_p95_s
    p_in = replace(inputs, output_len="fixed:1", slo=SLO(ttft_p95_s=None if ttft is None else max(1e-6, ttft - step1)))
    d_in = replace(inputs, slo=SLO(itl_p95_s=inputs.slo.itl_p95_s))
    pools = {}
    for role, prof, pin in (("prefill", prefill_prof, p_in), ("decode", decode_prof, d_in)):
        sat = saturation(prof, pin)["request_throughput"]
        r, _ = max_rate_at_slo(prof, pin, sat)
        n = math.ceil(inputs.rate / r - 1e-9) if r > 0 else None
        pools[role] = {"max_request_rate_at_slo": r, "saturation_request_rate": sat, "replicas": n}
    total = (
        None
        if None in (pools["prefill"]["replicas"], pools["decode"]["replicas"])
        else (pools["prefill"]["replicas"] + pools["decode"]["replicas"])
    )
    return {"pools": pools, "replicas": total, "note": "KV cache transfer between the pools is not modelled"}
