"""TTFT: time to first token split into queueing (arrival to first scheduled) and prefill (first scheduled to
first token) as the arrival rate rises past what the engine can serve."""

from __future__ import annotations

import random
import statistics

from inferd.bench.drive import arriving, capacity_rps, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext

DEFINITION = (
    "latency from request arrival to the first token. Dominated by queueing and prefill. It is the metric users "
    "feel first, and the primary latency SLI."
)


def measure(ctx: LabContext) -> Measurement:
    batch = 4
    llm = ctx.llm(max_num_seqs=batch)
    prompt_len, out_len, count = ctx.size(64, 256), ctx.size(8, 16), ctx.size(16, 32)
    capacity = capacity_rps(llm, random_prompts(random.Random(99), ctx.facts().vocab, batch, prompt_len), out_len)
    loads = [0.25, 0.75, 1.5, 3.0]
    rng = random.Random(1)
    m = Measurement(settings={"loads": loads, "capacity_rps": capacity, "max_num_seqs": batch})
    series = {"load": loads, "queue_ms": [], "prefill_ms": [], "ttft_ms": []}
    for i, load in enumerate(loads):
        run = serve(
            llm, arriving(random_prompts(rng, ctx.facts().vocab, count, prompt_len), out_len, load * capacity, i)
        )
        series["queue_ms"].append(statistics.mean(s.queueing for s in run.served) * 1000)
        series["prefill_ms"].append(statistics.mean(s.prefill for s in run.served) * 1000)
        series["ttft_ms"].append(run.metrics()["mean_ttft_ms"])
    m.series = series
    n = m.numbers
    n.update(
        capacity_rps=capacity,
        low=loads[0],
        high=loads[-1],
        queue_ms_low=series["queue_ms"][0],
        queue_ms_high=series["queue_ms"][-1],
        prefill_ms_low=series["prefill_ms"][0],
        prefill_ms_high=series["prefill_ms"][-1],
        ttft_ms_low=series["ttft_ms"][0],
        ttft_ms_high=series["ttft_ms"][-1],
        queue_pct_low=100 * series["queue_ms"][0] / series["ttft_ms"][0],
        queue_pct_high=100 * series["queue_ms"][-1] / series["ttft_ms"][-1],
    )
    return m


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "ttft_ms_high > ttft_ms_low",
            yes="Mean TTFT rose from {ttft_ms_low} ms at {low} times the engine's capacity to {ttft_ms_high} ms at "
            "{high} times.",
            no="Mean TTFT did not rise with load: {ttft_ms_low} ms at {low} times capacity, {ttft_ms_high} ms at "
            "{high} times.",
        ),
        m.decide(
            "queue_pct_high > queue_pct_low",
            yes="Queueing was {queue_pct_low}% of TTFT at the low load ({queue_ms_low} ms) and {queue_pct_high}% "
            "past capacity ({queue_ms_high} ms): once requests arrive faster than they finish, waiting dominates.",
            no="Queueing was {queue_pct_low}% of TTFT at the low load and {queue_pct_high}% past capacity.",
        ),
        m.decide(
            "prefill_ms_high < queue_ms_high",
            yes="Past capacity the prefill itself took {prefill_ms_high} ms, less than the {queue_ms_high} ms of "
            "waiting: adding replicas helps TTFT there, a faster prefill much less.",
            no="Even past capacity the prefill ({prefill_ms_high} ms) outweighed the wait ({queue_ms_high} ms): "
            "prefill speed decides TTFT here.",
        ),
    ]
    intro = [
        f"This lab measured what the engine completes per second when {m.settings['max_num_seqs']} requests run "
        f"at once ({n['capacity_rps']:.2f} requests/s), then sent Poisson arrivals at "
        f"{', '.join(f'{x:g}' for x in m.settings['loads'])} times that rate and split each request's TTFT into "
        "queueing (arrival to first scheduled) and prefill (first scheduled to first token), from the engine's "
        "own timestamps.",
    ]
    why = [
        "Why it matters: TTFT is the latency SLO most services state first. Its prefill part is engineering "
        "(prefix caching, chunked prefill, faster kernels); its queueing part is capacity, which is why "
        "autoscalers should watch queue depth and TTFT rather than CPU."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots(1, 1)
    s = m.series
    xs = [f"{x:g}x" for x in s["load"]]
    ax.bar(xs, s["prefill_ms"], label="prefill")
    ax.bar(xs, s["queue_ms"], bottom=s["prefill_ms"], label="queueing")
    ax.set(xlabel="arrival rate / capacity", ylabel="mean TTFT (ms)", title="TTFT = queueing + prefill")
    ax.legend()


LAB = Lab("ttft", "TTFT", DEFINITION, measure, explain, plot)
