"""Inference-aware autoscaling: a simulated day of diurnal load with bursts on one replica profile, scaled by a
CPU-utilisation policy, then by a queue/TTFT one, in the fleet simulator with the real `PoolAutoscaler`."""

from __future__ import annotations

import math

import numpy as np

from inferd.autoscale.measure import ProfileRun, measure_profile
from inferd.autoscale.plan import PlanInputs, max_rate_at_slo, saturation
from inferd.autoscale.profile import load_profile
from inferd.autoscale.sim import SLO, Simulator, UtilisationSimulator
from inferd.autoscale.workload import make_workload
from inferd.fleet.spec import AutoscalingPolicy
from inferd.labs.base import Explanation, Lab, Measurement, fmt
from inferd.labs.context import LabContext
from inferd.labs.cost import DEFAULT_PRICE

EXAMPLE = "example-cpu-gemma3-270m"
PROMPT, OUTPUT = "lognormal:256:0.6", "lognormal:128:0.6"
UTIL_TARGET = 0.7  # HPA's usual CPU target
MAX_REQUESTS = 150_000  # per simulated run: a faster replica gets its day compressed instead


def measure(ctx: LabContext) -> Measurement:
    if ctx.quick:
        profile, where = load_profile(EXAMPLE), f"the shipped example profile {EXAMPLE} (--quick)"
    else:
        run = ProfileRun(ctx.procs.any_replicas()[0].url, batches=(1, 4, 8, 16), output_len=12, requests_per_point=4)
        profile, where = measure_profile(run), "this machine's replica, measured by `inferd profile`"
    price = ctx.price_per_hour or DEFAULT_PRICE
    lone_ttft = 256 / profile.prefill_tokens_per_s + profile.step_s(1)
    # a TTFT of four lone prefills, a TPOT of three full-batch steps (room for prompts joining the batch)
    slo = SLO(ttft_s=max(0.5, 4 * lone_ttft), tpot_s=3 * profile.step_s(profile.max_num_seqs))
    inputs = PlanInputs(1.0, SLO(ttft_p95_s=slo.ttft_s), price, PROMPT, OUTPUT, requests=ctx.size(800, 2000))
    ceiling = saturation(profile, inputs)["request_throughput"]
    per_replica, _ = max_rate_at_slo(profile, inputs, ceiling, iterations=ctx.size(7, 10))
    if per_replica <= 0:
        raise RuntimeError(f"one replica of this profile misses a {slo.ttft_s:.2f} s TTFT even at a trickle of load")
    mean_rate = 1.5 * per_replica  # the trough needs under one replica, the peak about 2.4, bursts more
    period = min(86400.0, ctx.size(3 * 3600.0, MAX_REQUESTS / mean_rate))
    burst_s, bin_s = max(60.0, 900 * period / 86400), max(60.0, 300 * period / 86400)
    trace = f"diurnal:mean={mean_rate},peak_to_trough=4,duration={period},period={period},bursts=4,burst_x=2.5"
    workload = make_workload(f"{trace},burst_s={burst_s}", PROMPT, OUTPUT, seed=0)
    peak = float(np.bincount((workload.arrivals // bin_s).astype(int)).max()) / bin_s
    most = math.ceil(peak / per_replica) + 2
    n = dict(hours=period / 3600, requests=len(workload), mean_rate=mean_rate, peak_rate=peak, max_allowed=most)
    n |= dict(ttft_slo_s=slo.ttft_s, tpot_slo_ms=1000 * slo.tpot_s, util_target_pct=100 * UTIL_TARGET)
    n |= dict(per_replica=per_replica, cold_start_s=profile.cold_start_s, price_per_hour=price, unfinished=0)
    common = dict(min_replicas=1, max_replicas=most, interval_s=15, window_s=60, scale_down_stabilization_s=300)
    common |= dict(scale_up_stabilization_s=0, max_scale_up_step=4, max_scale_down_step=1, cooldown_s=120)
    targets = {"util": {"running": UTIL_TARGET}, "queue": {"waiting": 2.0, "ttft_p95_s": 0.8 * slo.ttft_s}}
    m = Measurement(n, settings={"profile": profile.name, "profile_from": where, "trace": trace})
    for (name, target), simulator in zip(targets.items(), (UtilisationSimulator, Simulator), strict=True):
        policy = AutoscalingPolicy(targets={"waiting": None, "kv_cache_usage": None, **target}, **common)
        sim = simulator(profile, workload, policy, 1, slo, price, timeline_s=max(60.0, period / 300))
        r = sim.run()
        rep, replica_s = r.report, r.report["replica_hours"] * 3600
        # requests in flight per replica over the replica time paid for (Little's law): how full its batches were
        n[f"{name}_in_flight"] = float(np.nansum(sim.done - sim.w.arrivals)) / replica_s if replica_s else 0.0
        n |= {f"{name}_{k}": rep[k] for k in ("replica_hours", "mean_replicas", "max_replicas")}
        n |= {f"{name}_slo_pct": 100 * rep["slo_attainment"], f"{name}_usd_per_m": rep["cost_per_million_tokens"]}
        n["unfinished"] += len(workload) - rep["finished"]
        m.series[name] = {k: [float(x) for x in v] for k, v in r.timeline.items()}
    n["hours_saved_pct"] = 100 * (1 - n["queue_replica_hours"] / n["util_replica_hours"])
    return m


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "queue_replica_hours < util_replica_hours",
            yes="Over one simulated {hours}-hour day ({requests} requests, {mean_rate}/s on average, {peak_rate} at "
            "peak) the utilisation policy (target {util_target_pct}% busy) paid for {util_replica_hours} "
            "replica-hours, the queue/TTFT policy {queue_replica_hours}: {hours_saved_pct}% fewer, "
            "${queue_usd_per_m} per million tokens against ${util_usd_per_m} at ${price_per_hour} an hour.",
            no="Over the same {hours}-hour day the queue/TTFT policy used {queue_replica_hours} replica-hours "
            "(${queue_usd_per_m} per million tokens), the utilisation policy {util_replica_hours} (${util_usd_per_m}).",
        ),
        m.decide(
            "util_in_flight < queue_in_flight",
            yes="The utilisation fleet averaged {util_mean_replicas} replicas (up to {util_max_replicas} of "
            "{max_allowed}), {util_in_flight} requests in flight each, the queue/TTFT fleet {queue_mean_replicas}, "
            "{queue_in_flight} each: one request reads as busy as a full batch, so utilisation added idle slots.",
            no="The utilisation fleet averaged {util_in_flight} requests in flight per replica and the queue/TTFT "
            "fleet {queue_in_flight}: here utilisation did not leave batches emptier.",
        ),
        m.must(
            "unfinished <= 0.0",
            yes="Both fleets served all {requests} requests ({unfinished} unfinished): a scale-down drains first.",
            no="{unfinished} requests were never finished.",
        ),
        m.decide(
            "queue_slo_pct >= 90.0",
            yes="The queue/TTFT policy met the SLOs (TTFT {ttft_slo_s} s, TPOT {tpot_slo_ms} ms) for {queue_slo_pct}% "
            "of requests (utilisation policy: {util_slo_pct}%).",
            no="The queue/TTFT policy met the SLOs for only {queue_slo_pct}% of requests (TTFT {ttft_slo_s} s, TPOT "
            "{tpot_slo_ms} ms; utilisation: {util_slo_pct}%): bursts outran its scale-ups.",
        ),
    ]
    intro = f"The replica ({m.settings['profile_from']}, a cold start of {fmt(n['cold_start_s'])} s) carries "
    intro += f"{fmt(n['per_replica'])} requests/s within the TTFT SLO. "
    intro += "The load swings from a trough to four times it, with four bursts of 2.5x. Both fleets grow from one "
    intro += f"replica up to {fmt(n['max_allowed'])} on the same rules, on CPU utilisation or on queue and TTFT p95."
    if n["hours"] < 24:
        intro += f" The day is compressed into {fmt(n['hours'])} simulated hours: steeper ramps than a real day's."
    why = "Why it matters: replicas are the cost, and utilisation cannot tell one request from a full batch, so it "
    why += "either pays for idle batch slots or, set high, reacts once queues have formed."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots()
    arrivals = ax.twinx()
    for name, label in (("util", f"utilisation ({m.numbers['util_target_pct']:.0f}% target)"), ("queue", "queue")):
        t = np.asarray(m.series[name]["t"]) / 3600
        ax.step(t, m.series[name]["replicas"], where="post", label=label)
    arrivals.plot(t, m.series["queue"]["arrival_rate"], color="0.7", lw=0.7)
    arrivals.set_ylabel("arrivals / s", color="0.5")
    ax.set(xlabel="simulated hours", ylabel="replicas", title="Replicas over the day, on the same trace")
    ax.legend(loc="upper left")


LAB = Lab("inference-aware-autoscaling", "Inference-aware autoscaling", measure, explain, plot)
