"""Throughput: the throughput-latency curve across concurrency (closed loop: N requests always in flight)."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext

METRICS = {"tok_s": "output_throughput", "tpot_ms": "mean_tpot_ms", "ttft_ms": "mean_ttft_ms"}


def measure(ctx: LabContext) -> Measurement:
    levels, rng = ctx.size([1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 32]), random.Random(11)
    count, prompt_len, out_len = ctx.size(16, 48), ctx.size(32, 128), ctx.size(12, 48)
    m = Measurement(series={"concurrency": levels} | {k: [] for k in METRICS})
    for c in levels:
        jobs = [Job(p, out_len) for p in random_prompts(rng, ctx.facts.vocab, max(count, 2 * c), prompt_len)]
        run = serve(ctx.llm(max_num_seqs=max(levels)), jobs, concurrency=c).metrics()
        for key, name in METRICS.items():
            m.series[key].append(run[name])
    m.ends("concurrency", *METRICS)
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "tok_s_hi > tok_s_lo",
            yes="Output throughput went from {tok_s_lo} tokens/s with {concurrency_lo} request in flight to "
            "{tok_s_hi} with {concurrency_hi}.",
            no="Output throughput did not rise with concurrency: {tok_s_lo} tokens/s at {concurrency_lo}, {tok_s_hi} "
            "at {concurrency_hi}.",
        ),
        m.decide(
            "tpot_ms_hi > tpot_ms_lo",
            yes="The price is latency: mean TPOT went from {tpot_ms_lo} ms to {tpot_ms_hi} ms, mean TTFT from "
            "{ttft_ms_lo} ms to {ttft_ms_hi} ms.",
            no="Mean TPOT did not worsen: {tpot_ms_lo} ms, then {tpot_ms_hi} ms.",
        ),
    ]
    intro = "This lab kept a fixed number of requests in flight (a closed loop, like `inferd bench --max-concurrency`)."
    why = "Why it matters: capacity planning picks the point on this curve whose latency meets the SLOs: goodput."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    s = m.series
    ax = lines(fig, s["tpot_ms"], {"": s["tok_s"]}, xlabel="mean TPOT (ms)", ylabel="output tokens/s")
    for c, x, y in zip(s["concurrency"], s["tpot_ms"], s["tok_s"], strict=True):
        ax.annotate(f"{c} in flight", (x, y))
    ax.set(title="Throughput-latency curve")


LAB = Lab("throughput", "Throughput", measure, explain, plot)
