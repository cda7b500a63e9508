"""Continuous batching: static batches vs continuous batching on the same arrivals and the same engine:
throughput, TTFT, the share of time the engine is busy and the share of batch slots doing work."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, arriving, capacity_rps, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext

OUT_LENGTHS = {True: (4, 40), False: (8, 96)}  # by quick
OVERLOAD = 2.0  # arrivals at twice what the engine serves: there is always someone waiting for a slot
DEFINITION = (
    "instead of waiting to assemble a fixed batch, the scheduler adds and evicts requests from the running batch "
    "every decode step. New requests join immediately, and finished ones free their slots immediately."
)


def workload(ctx: LabContext, rate: float, seed: int = 0) -> list[Job]:
    """Requests arriving at `rate` per second, with output lengths that differ a lot."""
    count, prompt_len = ctx.size(24, 48), ctx.size(24, 96)
    lo, hi = OUT_LENGTHS[ctx.quick]
    rng = random.Random(seed)
    prompts = random_prompts(rng, ctx.facts().vocab, count, prompt_len)
    return arriving(prompts, [rng.randint(lo, hi) for _ in prompts], rate, seed)


def measure(ctx: LabContext) -> Measurement:
    batch = 8
    llm = ctx.llm(max_num_seqs=batch)
    lo, hi = OUT_LENGTHS[ctx.quick]
    prompts = random_prompts(random.Random(99), ctx.facts().vocab, batch, ctx.size(24, 96))
    capacity = capacity_rps(llm, prompts, (lo + hi) // 2)  # also warms up
    jobs = workload(ctx, OVERLOAD * capacity)
    runs = {"static": serve(llm, jobs, static_batch=batch), "continuous": serve(llm, jobs)}
    m = Measurement(settings={"batch": batch, "requests": len(jobs)})
    for name, run in runs.items():
        metrics = run.metrics()
        m.numbers[f"{name}_tok_s"] = metrics["output_throughput"]
        m.numbers[f"{name}_ttft_ms"] = metrics["mean_ttft_ms"]
        m.numbers[f"{name}_busy_pct"] = 100 * run.busy_fraction
        m.numbers[f"{name}_slots_pct"] = 100 * run.slot_use(batch)
        m.numbers[f"{name}_steps"] = len(run.steps)
        m.series[name] = {"ttft_ms": [s.ttft * 1000 for s in run.served], "finish_s": [s.finished for s in run.served]}
    m.numbers["batch"] = batch
    m.numbers["speedup"] = m.numbers["continuous_tok_s"] / m.numbers["static_tok_s"]
    return m


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "continuous_slots_pct > static_slots_pct",
            # not `must`: it holds while requests queue; if the engine ran faster than its calibration (a busy
            # machine freeing up mid-run), arrivals thin out and empty slots mean no requests, not batching
            yes="With continuous batching {continuous_slots_pct}% of the {batch} batch slots held a working request "
            "per step; with static batches {static_slots_pct}%, because a static batch keeps its finished "
            "requests' slots empty until its longest request ends.",
            no="Continuous batching kept {continuous_slots_pct}% of slots working, static {static_slots_pct}%: "
            "here requests arrived more slowly than the engine served them (it ran faster than its calibration "
            "said), so slots sat empty for want of requests, which no batching policy can fill.",
        ),
        m.decide(
            "continuous_steps < static_steps",
            yes="The same requests took {continuous_steps} engine steps instead of {static_steps}.",
            no="The same requests took {continuous_steps} engine steps continuous, {static_steps} static.",
        ),
        m.decide(
            "continuous_tok_s > static_tok_s",
            yes="Output throughput: {continuous_tok_s} tokens/s continuous against {static_tok_s} static "
            "({speedup} times).",
            no="Output throughput: {continuous_tok_s} tokens/s continuous against {static_tok_s} static: no gain "
            "here, because on this machine a step's cost grows with the batch almost as fast as its tokens do.",
        ),
        m.decide(
            "continuous_ttft_ms < static_ttft_ms",
            yes="Mean TTFT: {continuous_ttft_ms} ms continuous against {static_ttft_ms} ms static, since a new "
            "request joins at the next step instead of waiting for the running batch to finish.",
            no="Mean TTFT: {continuous_ttft_ms} ms continuous against {static_ttft_ms} ms static.",
        ),
    ]
    intro = [
        f"This lab sent the same {m.settings['requests']} requests (Poisson arrivals at twice what the engine "
        f"serves, output lengths that differ a lot) through the same engine twice, with room for "
        f"{m.settings['batch']} requests at once: as static batches (a batch starts when full, nobody joins until "
        "all of it is done) and continuously. The engine "
        f"was busy {n['static_busy_pct']:.0f}% of the time static and {n['continuous_busy_pct']:.0f}% continuous.",
    ]
    why = [
        "Why it matters: it is the single biggest throughput win in modern serving, and it costs no hardware, "
        "only a scheduler that works per step; every serious engine (vLLM, TGI, TensorRT-LLM, SGLang, inferd) "
        "does it."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    names = ["static", "continuous"]
    a.bar(names, [m.numbers[f"{x}_tok_s"] for x in names])
    a.set(ylabel="output tokens/s", title="Throughput, same arrivals")
    for x in names:
        b.plot(sorted(m.series[x]["ttft_ms"]), label=x)
    b.set(xlabel="requests (sorted)", ylabel="TTFT (ms)", title="TTFT per request")
    b.legend()


LAB = Lab("continuous-batching", "Continuous batching", DEFINITION, measure, explain, plot)
