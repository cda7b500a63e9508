"""TTFT split into queueing and prefill (the engine's timestamps) as arrivals rise past the engine's capacity."""

from __future__ import annotations

import random
import statistics

from inferd.bench.drive import arriving, capacity_rps, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext


def measure(ctx: LabContext) -> Measurement:
    llm, vocab, rng = ctx.llm(max_num_seqs=4), ctx.facts.vocab, random.Random(1)
    prompt_len, out_len, count = ctx.size(64, 256), ctx.size(8, 16), ctx.size(16, 32)
    capacity = capacity_rps(llm, random_prompts(random.Random(99), vocab, 4, prompt_len), out_len)
    m = Measurement({"capacity_rps": capacity}, {"load": [0.25, 0.75, 1.5, 3.0], "queue_ms": [], "prefill_ms": []})
    for i, load in enumerate(m.series["load"]):
        run = serve(llm, arriving(random_prompts(rng, vocab, count, prompt_len), out_len, load * capacity, i))
        m.series["queue_ms"].append(statistics.mean(r.queueing for r in run.served) * 1000)
        m.series["prefill_ms"].append(statistics.mean(r.prefill for r in run.served) * 1000)
    m.series["ttft_ms"] = [q + p for q, p in zip(m.series["queue_ms"], m.series["prefill_ms"], strict=True)]
    m.ends("load", "queue_ms", "prefill_ms", "ttft_ms")
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "ttft_ms_hi > ttft_ms_lo",
            yes="Mean TTFT rose from {ttft_ms_lo} ms at {load_lo} times the engine's capacity to {ttft_ms_hi} ms at "
            "{load_hi} times, its queueing part from {queue_ms_lo} ms to {queue_ms_hi} ms.",
            no="Mean TTFT did not rise with load: {ttft_ms_lo} ms at {load_lo} times capacity, {ttft_ms_hi} ms after.",
        ),
        m.decide(
            "prefill_ms_hi < queue_ms_hi",
            yes="Past capacity the prefill took {prefill_ms_hi} ms and the wait {queue_ms_hi} ms: replicas help TTFT "
            "there more than a faster prefill.",
            no="Even past capacity the prefill ({prefill_ms_hi} ms) outweighed the wait ({queue_ms_hi} ms).",
        ),
    ]
    intro = f"This lab measured what the engine completes with 4 requests at once ({m.numbers['capacity_rps']:.2f} "
    intro += "requests/s), then sent Poisson arrivals at fractions and multiples of that rate."
    why = "Why it matters: prefill time is engineering (caching, chunking, kernels), queueing is capacity (replicas)."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    s, ax = m.series, fig.subplots()
    xs = [f"{x:g}x" for x in s["load"]]
    ax.bar(xs, s["prefill_ms"], label="prefill")
    ax.bar(xs, s["queue_ms"], bottom=s["prefill_ms"], label="queueing")
    ax.set(xlabel="arrival rate / capacity", ylabel="mean TTFT (ms)", title="TTFT = queueing + prefill")
    ax.legend()


LAB = Lab("ttft", "TTFT", measure, explain, plot)
