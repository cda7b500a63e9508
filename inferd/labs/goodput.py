"""Goodput: throughput that meets latency SLOs, against offered load; where the knee is.

The SLOs are set from this machine's unloaded latency (a request alone), so the lab means the same thing on
a laptop and on a GPU: TTFT within 4x and TPOT within 2.5x of what one request alone gets.
"""

from __future__ import annotations

import random

from inferd.bench.drive import Job, arriving, capacity_rps, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext

DEFINITION = "throughput that also meets latency SLOs. The number that actually matters for capacity planning."
TTFT_FACTOR, TPOT_FACTOR = 4.0, 2.5


def measure(ctx: LabContext) -> Measurement:
    batch = 8
    llm = ctx.llm(max_num_seqs=batch)
    prompt_len, out_len, count = ctx.size(32, 128), ctx.size(10, 32), ctx.size(24, 48)
    rng = random.Random(5)
    vocab = ctx.facts().vocab
    alone = serve(llm, [Job(p, out_len) for p in random_prompts(rng, vocab, 4, prompt_len)], concurrency=1).metrics()
    slos = {"ttft": TTFT_FACTOR * alone["median_ttft_ms"], "tpot": TPOT_FACTOR * alone["median_tpot_ms"]}
    capacity = capacity_rps(llm, random_prompts(random.Random(99), vocab, batch, prompt_len), out_len)
    loads = [0.25, 0.5, 1.0, 1.5, 2.5]
    series = {"load": loads, "rate": [], "tok_s": [], "goodput": [], "attainment": []}
    for i, load in enumerate(loads):
        r = serve(llm, arriving(random_prompts(rng, vocab, count, prompt_len), out_len, load * capacity, i)).metrics(
            slos
        )
        series["rate"].append(load * capacity)
        series["tok_s"].append(r["output_throughput"])
        series["goodput"].append(r["output_goodput"])
        series["attainment"].append(100 * r["slo_attainment"])
    best = max(range(len(loads)), key=lambda i: series["goodput"][i])
    m = Measurement(settings={"slo_ms": slos, "loads": loads, "capacity_rps": capacity, "max_num_seqs": batch})
    m.series = series
    m.numbers.update(
        ttft_slo_ms=slos["ttft"],
        tpot_slo_ms=slos["tpot"],
        knee_load=loads[best],
        knee_rps=series["rate"][best],
        best_goodput=series["goodput"][best],
        tok_s_at_best=series["tok_s"][best],
        attainment_at_best=series["attainment"][best],
        max_excess=max(g - t for g, t in zip(series["goodput"], series["tok_s"], strict=True)),
        high_load=loads[-1],
        goodput_high=series["goodput"][-1],
        tok_s_high=series["tok_s"][-1],
        attainment_high=series["attainment"][-1],
    )
    return m


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "max_excess <= 0.0",
            must=True,
            yes="At every load goodput stayed at or below throughput (it only counts tokens of requests that met "
            "both SLOs; goodput minus throughput was at most {max_excess} tokens/s); at the best load, "
            "{knee_rps} requests/s, it was {best_goodput} of {tok_s_at_best} output tokens/s, "
            "with {attainment_at_best}% of requests on target.",
            no="Goodput exceeded throughput by {max_excess} tokens/s: a measurement error.",
        ),
        m.decide(
            "goodput_high < best_goodput",
            yes="Past the knee ({knee_load} times the engine's capacity, {best_goodput} tokens/s of goodput) goodput "
            "fell: at {high_load} times it was {goodput_high} tokens/s while raw throughput was {tok_s_high}, "
            "with only {attainment_high}% of requests meeting the SLOs. Pushing more load buys throughput nobody "
            "can use.",
            no="Goodput did not fall at the highest load tried ({high_load} times capacity: {goodput_high} tokens/s "
            "against a best of {best_goodput}, {attainment_high}% on target): the knee lies beyond it.",
        ),
    ]
    intro = [
        f"The SLOs here come from this machine: TTFT at most {n['ttft_slo_ms']:.1f} ms ({TTFT_FACTOR:g}x a "
        f"request alone) and TPOT at most {n['tpot_slo_ms']:.1f} ms ({TPOT_FACTOR:g}x). The lab offered Poisson "
        f"arrivals at {', '.join(f'{x:g}' for x in m.settings['loads'])} times the engine's measured capacity and "
        "counted, with vLLM's definitions, the tokens of the requests that met both.",
    ]
    why = [
        "Why it matters: a replica's capacity is the load at the knee, not its peak throughput; cost per million "
        "tokens should be computed from goodput (the cost lab does)."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    s = m.series
    a.plot(s["rate"], s["tok_s"], "o-", label="throughput")
    a.plot(s["rate"], s["goodput"], "s-", label="goodput (meets SLOs)")
    a.axvline(m.numbers["knee_rps"], color="gray", ls="--", label="knee")
    a.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="Goodput vs load")
    a.legend()
    b.plot(s["rate"], s["attainment"], "o-")
    b.set(xlabel="offered load (requests/s)", ylabel="% requests meeting SLOs", title="SLO attainment", ylim=(0, 105))


LAB = Lab("goodput", "Goodput", DEFINITION, measure, explain, plot)
