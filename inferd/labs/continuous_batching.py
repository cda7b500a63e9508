"""Continuous batching against static batches on the same arrivals and engine: slots in use, throughput, TTFT."""

from __future__ import annotations

import random

from inferd.bench.drive import arriving, capacity_rps, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement, bars
from inferd.labs.context import LabContext


def measure(ctx: LabContext) -> Measurement:
    llm, rng, vocab, batch = ctx.llm(max_num_seqs=8), random.Random(0), ctx.facts.vocab, 8
    (lo, hi), count, prompt_len = ctx.size((4, 40), (8, 96)), ctx.size(24, 48), ctx.size(24, 96)
    capacity = capacity_rps(llm, random_prompts(random.Random(99), vocab, batch, prompt_len), (lo + hi) // 2)
    prompts = random_prompts(rng, vocab, count, prompt_len)  # output lengths that differ a lot, arriving at twice
    jobs = arriving(prompts, [rng.randint(lo, hi) for _ in prompts], 2 * capacity)  # the rate the engine serves
    m = Measurement({"batch": batch, "requests": count})
    for name, run in {"static": serve(llm, jobs, static_batch=batch), "continuous": serve(llm, jobs)}.items():
        metrics = run.metrics()
        m.numbers |= {f"{name}_tok_s": metrics["output_throughput"], f"{name}_ttft_ms": metrics["mean_ttft_ms"]}
        m.numbers[f"{name}_slots_pct"] = 100 * run.slot_use(batch)
    m.numbers["speedup"] = m.numbers["continuous_tok_s"] / m.numbers["static_tok_s"]
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "continuous_slots_pct > static_slots_pct",
            # not `must`: it holds while requests queue; if the engine ran faster than its calibration (a busy
            # machine freeing up mid-run), arrivals thin out and empty slots mean no requests, not batching
            yes="Continuously, {continuous_slots_pct}% of the {batch} batch slots held a working request per step; "
            "in static batches {static_slots_pct}%, as a finished request's slot waits for its batch's longest.",
            no="Continuously {continuous_slots_pct}% of slots worked, static {static_slots_pct}%: too few arrivals.",
        ),
        m.decide(
            "continuous_tok_s > static_tok_s",
            yes="Output throughput: {continuous_tok_s} tokens/s against {static_tok_s} static ({speedup} times).",
            no="Output throughput: {continuous_tok_s} tokens/s continuous against {static_tok_s} static: no gain.",
        ),
        m.decide(
            "continuous_ttft_ms < static_ttft_ms",
            yes="Mean TTFT: {continuous_ttft_ms} ms against {static_ttft_ms} ms, as a new request joins at the next "
            "step instead of waiting for the batch to finish.",
            no="Mean TTFT: {continuous_ttft_ms} ms continuous against {static_ttft_ms} ms static.",
        ),
    ]
    intro = f"This lab sent the same {m.numbers['requests']:g} requests through one engine with "
    intro += f"{m.numbers['batch']:g} slots as static batches (started when full, nobody joins) and continuously."
    why = "Why it matters: it is the biggest throughput win in serving, and it costs only a per-step scheduler."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    tok_s = {x: m.numbers[f"{x}_tok_s"] for x in ("static", "continuous")}
    bars(fig, tok_s, ylabel="output tokens/s", title="Throughput, same arrivals")


LAB = Lab("continuous-batching", "Continuous batching", measure, explain, plot)
