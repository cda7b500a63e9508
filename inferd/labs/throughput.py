"""Throughput: the throughput-latency curve across concurrency (closed loop: N requests always in flight)."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext

DEFINITION = (
    "tokens per second (and requests per second) the system sustains across all concurrent requests. Trades off "
    "against latency, since bigger batches raise throughput but worsen TTFT and ITL."
)


def sweep(ctx: LabContext, levels: list[int], count: int, prompt_len: int, out_len: int) -> list[dict]:
    """One closed-loop run per concurrency level: vLLM's metrics for each."""
    llm = ctx.llm(max_num_seqs=max(levels))
    rng = random.Random(11)
    out = []
    for c in levels:
        jobs = [Job(p, out_len) for p in random_prompts(rng, ctx.facts().vocab, max(count, 2 * c), prompt_len)]
        out.append(serve(llm, jobs, concurrency=c).metrics() | {"concurrency": c})
    return out


def measure(ctx: LabContext) -> Measurement:
    levels = ctx.size([1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 32])
    runs = sweep(ctx, levels, ctx.size(16, 48), ctx.size(32, 128), ctx.size(12, 48))
    m = Measurement(settings={"levels": levels})
    m.series = {
        "concurrency": levels,
        "tok_s": [r["output_throughput"] for r in runs],
        "rps": [r["request_throughput"] for r in runs],
        "tpot_ms": [r["mean_tpot_ms"] for r in runs],
        "ttft_ms": [r["mean_ttft_ms"] for r in runs],
    }
    s = m.series
    best = max(range(len(levels)), key=lambda i: s["tok_s"][i])
    m.numbers.update(
        c_lo=levels[0],
        c_hi=levels[-1],
        tok_s_lo=s["tok_s"][0],
        tok_s_hi=s["tok_s"][-1],
        rps_hi=s["rps"][-1],
        tpot_ms_lo=s["tpot_ms"][0],
        tpot_ms_hi=s["tpot_ms"][-1],
        ttft_ms_lo=s["ttft_ms"][0],
        ttft_ms_hi=s["ttft_ms"][-1],
        c_best=levels[best],
        tok_s_best=s["tok_s"][best],
    )
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "tok_s_hi > tok_s_lo",
            yes="Output throughput went from {tok_s_lo} tokens/s with {c_lo} request in flight to {tok_s_hi} with "
            "{c_hi} ({rps_hi} requests/s); the best level was {c_best} at {tok_s_best} tokens/s.",
            no="Output throughput did not rise with concurrency: {tok_s_lo} tokens/s at {c_lo}, {tok_s_hi} at {c_hi}.",
        ),
        m.decide(
            "tpot_ms_hi > tpot_ms_lo",
            yes="The price is latency: mean TPOT went from {tpot_ms_lo} ms to {tpot_ms_hi} ms and mean TTFT from "
            "{ttft_ms_lo} ms to {ttft_ms_hi} ms.",
            no="Mean TPOT did not worsen: {tpot_ms_lo} ms at {c_lo} in flight, {tpot_ms_hi} ms at {c_hi}.",
        ),
    ]
    intro = [
        "This lab kept a fixed number of requests in flight (a new one as soon as one finished: a closed loop, "
        f"like `inferd bench --max-concurrency`) at {', '.join(map(str, m.settings['levels']))} and measured "
        "tokens/s with the latencies each level cost.",
    ]
    why = [
        "Why it matters: the operating point is a choice on this curve. Capacity planning picks the highest "
        "throughput whose latency still meets the SLOs, which is goodput (next lab)."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    s = m.series
    a.plot(s["concurrency"], s["tok_s"], "o-")
    a.set(xlabel="requests in flight", ylabel="output tokens/s", title="Throughput vs concurrency", xscale="log")
    b.plot(s["tpot_ms"], s["tok_s"], "o-")
    for c, x, y in zip(s["concurrency"], s["tpot_ms"], s["tok_s"], strict=True):
        b.annotate(str(c), (x, y))
    b.set(xlabel="mean TPOT (ms)", ylabel="output tokens/s", title="Throughput-latency curve")


LAB = Lab("throughput", "Throughput", DEFINITION, measure, explain, plot)
