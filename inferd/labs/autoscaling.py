"""Inference-aware autoscaling: a simulated day of diurnal load with bursts, served by a fleet that a
CPU-utilisation policy scales, then by one that a queue/TTFT policy scales, on the same trace.

The replica is this machine's: its prefill speed and decode step times at a few batch sizes are measured on
the engine (a profile, as `inferd profile` makes against a server); `--quick` uses the shipped example
profile instead, and a day compressed to a few hours, so it runs in seconds. Both fleets run in the
fleet simulator (`inferd.autoscale.sim`) with the real `PoolAutoscaler` and the same windows, steps and
cooldowns; only the signal differs:

- utilisation: what HPA does with CPU (or nvidia-smi's GPU) utilisation, replicas = ceil(sum of each
  replica's busy share of the window / target). A replica is busy whenever one request is stepping, so the
  signal is 100% at batch 1 and at a full batch alike;
- queue/TTFT: requests waiting per replica and the TTFT p95 against the SLO, the signals inferd scales on.
"""

from __future__ import annotations

import math
import random

import numpy as np

from inferd.autoscale.plan import PlanInputs, max_rate_at_slo, saturation
from inferd.autoscale.profile import Profile, load_profile
from inferd.autoscale.signals import Measured
from inferd.autoscale.sim import SLO, Simulator
from inferd.autoscale.workload import make_workload
from inferd.bench.drive import Job, random_prompts, serve
from inferd.fleet.spec import AutoscalingPolicy
from inferd.labs.base import Explanation, Lab, Measurement, fmt
from inferd.labs.context import LabContext
from inferd.labs.cost import DEFAULT_PRICE
from inferd.measure.stats import percentile

DEFINITION = (
    "scaling replicas on queue depth, KV cache usage or latency signals instead of CPU/GPU utilisation, "
    "because utilisation saturates long before an LLM replica runs out of capacity."
)
EXAMPLE = "example-cpu-gemma3-270m"
PROMPT, OUTPUT = "lognormal:256:0.6", "lognormal:128:0.6"
UTIL_TARGET = 0.7  # HPA's usual CPU target
BATCHES = (1, 4, 8, 16)
MAX_REQUESTS = 150_000  # per simulated run: a faster replica gets its day compressed instead


class UtilisationSim(Simulator):
    """The same fleet, its autoscaler fed HPA's CPU rule. ceil(replicas x mean utilisation / target) equals
    ceil(total utilisation / target), the rule the policy applies to a total signal against a per-replica
    target, so the utilisation total goes in as the one total the policy reads (`running`)."""

    def measure(self) -> Measured:
        return Measured(running=self.utilization())


def measured_profile(ctx: LabContext) -> Profile:
    """This machine's replica, timed on the engine: one prompt alone (prefill), then `b` requests at a time."""
    llm, vocab = ctx.llm(), ctx.facts().vocab  # random prompts: the prefix cache finds nothing to share
    lone = random_prompts(random.Random(0), vocab, 3, 256)
    run = serve(llm, [Job(p, 1) for p in lone], concurrency=1)
    prefill_s = min(s.prefill for s in run.served)
    steps = []
    for b in BATCHES:
        prompts = random_prompts(random.Random(100 + b), vocab, b, 16)
        run = serve(llm, [Job(p, 12) for p in prompts], concurrency=b)
        pure = run.pure_decode_steps(b)
        steps.append(percentile(pure, 50) if pure else run.duration / 12)
    steps = [float(x) for x in np.maximum.accumulate(steps)]  # a profile's step never shrinks with the batch
    return Profile(
        name="measured here",
        prefill_tokens_per_s=256 / prefill_s,
        decode_batch=list(BATCHES),
        decode_step_s=steps,
        max_num_seqs=BATCHES[-1],
        cold_start_s=30.0,
        description=f"{ctx.model_label} on this machine, timed by the lab on the engine",
        source="inferd lab inference-aware-autoscaling: lone 256-token prefills, 12-step decodes at batch 1-16",
    )


def policies(ttft_slo_s: float, most: int) -> dict[str, AutoscalingPolicy]:
    common = dict(
        min_replicas=1, max_replicas=most, interval_s=15, window_s=60, scale_up_stabilization_s=0,
        scale_down_stabilization_s=300, max_scale_up_step=4, max_scale_down_step=1, cooldown_s=120,
    )  # fmt: skip
    none = {"waiting": None, "kv_cache_usage": None}
    return {
        "util": AutoscalingPolicy(targets={**none, "running": UTIL_TARGET}, **common),
        "queue": AutoscalingPolicy(targets={**none, "waiting": 2.0, "ttft_p95_s": 0.8 * ttft_slo_s}, **common),
    }


def measure(ctx: LabContext) -> Measurement:
    if ctx.quick:
        profile, where = load_profile(EXAMPLE), f"the shipped example profile {EXAMPLE} (--quick)"
    else:
        profile = measured_profile(ctx)
        where = "this machine's replica, measured on the engine (its cold start assumed)"
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
    scale = period / 86400
    trace = (
        f"diurnal:mean={mean_rate},peak_to_trough=4,duration={period},period={period},"
        f"bursts=4,burst_x=2.5,burst_s={max(60.0, 900 * scale)}"
    )
    workload = make_workload(trace, PROMPT, OUTPUT, seed=0)
    bins = np.bincount((workload.arrivals // max(60.0, 300 * scale)).astype(int))
    peak = float(bins.max()) / max(60.0, 300 * scale)
    most = math.ceil(peak / per_replica) + 2
    runs = {}
    for name, policy in policies(slo.ttft_s, most).items():
        cls = UtilisationSim if name == "util" else Simulator
        sim = cls(profile, workload, policy, 1, slo, price, timeline_s=max(60.0, period / 300))
        runs[name] = (sim, sim.run())
    m = Measurement(
        settings={
            "profile": profile.name, "profile_from": where, "trace": trace, "prompt_len": PROMPT,
            "output_len": OUTPUT, "policies": {k: p.model_dump() for k, p in policies(slo.ttft_s, most).items()},
        },
    )  # fmt: skip
    n = m.numbers
    n.update(
        hours=period / 3600, requests=len(workload), mean_rate=mean_rate, peak_rate=peak, per_replica=per_replica,
        ttft_slo_s=slo.ttft_s, tpot_slo_ms=1000 * slo.tpot_s, util_target_pct=100 * UTIL_TARGET, max_allowed=most,
        prefill_tok_s=profile.prefill_tokens_per_s, step_ms_b1=1000 * profile.step_s(1),
        step_ms_bmax=1000 * profile.step_s(profile.max_num_seqs), price_per_hour=price,
        cold_start_s=profile.cold_start_s, max_num_seqs=profile.max_num_seqs,
    )  # fmt: skip
    for name, (sim, r) in runs.items():
        rep = r.report
        n.update({
            f"{name}_slo_pct": 100 * rep["slo_attainment"], f"{name}_replica_hours": rep["replica_hours"],
            f"{name}_mean_replicas": rep["mean_replicas"], f"{name}_max_replicas": rep["max_replicas"],
            f"{name}_ttft_p95_s": rep["ttft_p95_s"], f"{name}_cost": rep["cost"],
            f"{name}_usd_per_m": rep["cost_per_million_tokens"],
            f"{name}_usd_per_m_good": rep["goodput_cost_per_million_tokens"] or float("inf"),
            f"{name}_in_flight": _in_flight_per_replica(sim, rep),
        })  # fmt: skip
        m.series[name] = {k: [float(x) for x in v] for k, v in r.timeline.items()}
    n["unfinished"] = sum(len(workload) - r.report["finished"] for _, r in runs.values())
    n["hours_saved_pct"] = 100 * (1 - n["queue_replica_hours"] / n["util_replica_hours"])
    return m


def _in_flight_per_replica(sim: Simulator, report: dict) -> float:
    """Requests in flight per replica, averaged over the replica time paid for (Little's law: the sum of the
    requests' times in the system over the replica-seconds): how full the batches the fleet paid for were."""
    replica_s = report["replica_hours"] * 3600
    return float(np.nansum(sim.done - sim.w.arrivals)) / replica_s if replica_s else 0.0


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "queue_replica_hours < util_replica_hours",
            yes="Over the same simulated {hours}-hour day ({requests} requests, {mean_rate} per second on average, "
            "{peak_rate} at the busiest moment), the utilisation policy (target {util_target_pct}% busy) paid for "
            "{util_replica_hours} replica-hours and the queue/TTFT policy {queue_replica_hours}: "
            "{hours_saved_pct}% fewer.",
            no="Over the same simulated {hours}-hour day ({requests} requests), the queue/TTFT policy used "
            "{queue_replica_hours} replica-hours, not fewer than the utilisation policy's {util_replica_hours}.",
        ),
        m.decide(
            "util_in_flight < queue_in_flight",
            yes="The utilisation fleet averaged {util_mean_replicas} replicas (up to {util_max_replicas} of "
            "{max_allowed} allowed) with {util_in_flight} requests in flight per replica; the queue/TTFT fleet "
            "{queue_mean_replicas} replicas with {queue_in_flight}: a replica stepping one request reads as busy "
            "as one stepping a full batch, so utilisation kept adding replicas whose batches ran nearly empty.",
            no="The utilisation fleet averaged {util_in_flight} requests in flight per replica and the queue/TTFT "
            "fleet {queue_in_flight}: here utilisation did not leave batches emptier.",
        ),
        m.decide(
            "unfinished <= 0.0",
            must=True,
            yes="Both fleets served every one of the {requests} requests ({unfinished} left unfinished): a "
            "scale-down drains a replica before it leaves.",
            no="{unfinished} requests were never finished.",
        ),
        m.decide(
            "queue_slo_pct >= 90.0",
            yes="The queue/TTFT policy still met the SLOs (TTFT {ttft_slo_s} s, TPOT {tpot_slo_ms} ms) for "
            "{queue_slo_pct}% of requests (utilisation policy: {util_slo_pct}%).",
            no="The queue/TTFT policy met the SLOs (TTFT {ttft_slo_s} s, TPOT {tpot_slo_ms} ms) for only "
            "{queue_slo_pct}% of requests (utilisation policy: {util_slo_pct}%): the bursts outran its "
            "scale-ups and cold starts.",
        ),
        m.decide(
            "queue_usd_per_m <= util_usd_per_m",
            yes="At ${price_per_hour} per replica-hour that is ${queue_usd_per_m} per million tokens against "
            "${util_usd_per_m}.",
            no="At ${price_per_hour} per replica-hour the queue/TTFT policy cost ${queue_usd_per_m} per million "
            "tokens against ${util_usd_per_m}.",
        ),
    ]
    intro = [
        f"The replica here: {m.settings['profile_from']} (prefill {fmt(n['prefill_tok_s'])} tokens/s, a decode "
        f"step {fmt(n['step_ms_b1'])} ms at batch 1 and {fmt(n['step_ms_bmax'])} ms at batch "
        f"{fmt(n['max_num_seqs'])}); one replica carries {fmt(n['per_replica'])} requests/s within the TTFT SLO "
        "(prompts about 256 tokens, answers about 128). The day's load is a sine from trough to four times the "
        "trough, plus four bursts of 2.5x; both fleets start with one replica, may grow to "
        f"{fmt(n['max_allowed'])}, decide every 15 s on a 60 s window, scale down after 5 minutes' stability, "
        f"and a new replica takes {fmt(n['cold_start_s'])} s to serve. Only the signal differs: the "
        "utilisation policy sums each replica's busy share of the window (CPU or GPU utilisation: 100% as "
        "soon as one request is stepping), the queue/TTFT policy counts requests waiting per replica and "
        "the TTFT p95 against 80% of the SLO.",
    ]
    if n["hours"] < 24:
        intro.append(
            f"The day is compressed into {fmt(n['hours'])} simulated hours (the same shape, faster), so that the "
            "simulation stays short; ramps are then steeper than a real day's, which is harder on both policies."
        )
    why = [
        "Why it matters: replicas are the cost. A utilisation target cannot tell a replica running one "
        "request from one running a full batch, so it either over-provisions (paying for idle batch slots) or, "
        "set high, reacts only once queues have formed; queue depth and TTFT measure what users feel and "
        "what one more replica would fix."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    labels = {"util": f"utilisation ({m.numbers['util_target_pct']:.0f}% target)", "queue": "queue/TTFT"}
    first = True
    for name, tl in m.series.items():
        t = np.asarray(tl["t"]) / 3600
        if first:
            ax2 = a.twinx()
            ax2.plot(t, tl["arrival_rate"], color="0.7", lw=0.7)
            ax2.set_ylabel("arrivals / s", color="0.5")
            first = False
        a.step(t, tl["replicas"], where="post", label=labels[name])
        b.plot(t, np.asarray(tl["ttft_p95_s"], dtype=float), lw=0.7, label=labels[name])
    a.set(xlabel="simulated hours", ylabel="replicas", title="Replicas over the day")
    a.legend(loc="upper left")
    b.axhline(m.numbers["ttft_slo_s"], color="k", ls="--", lw=0.8, label="TTFT SLO")
    b.set(xlabel="simulated hours", ylabel="TTFT p95 per interval (s)", yscale="log", title="Latency")
    b.legend(loc="upper left")


LAB = Lab("inference-aware-autoscaling", "Inference-aware autoscaling", DEFINITION, measure, explain, plot)
