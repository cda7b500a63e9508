"""Goodput against offered load, and its knee, under SLOs set from this machine's unloaded latency."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, arriving, capacity_rps, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext

TTFT_FACTOR, TPOT_FACTOR = 4.0, 2.5  # the SLOs, over a request alone: the same meaning on a laptop and a GPU


def measure(ctx: LabContext) -> Measurement:
    llm, vocab, rng = ctx.llm(max_num_seqs=8), ctx.facts.vocab, random.Random(5)
    prompt_len, out_len, count = ctx.size(32, 128), ctx.size(10, 32), ctx.size(24, 48)
    alone = serve(llm, [Job(p, out_len) for p in random_prompts(rng, vocab, 4, prompt_len)], concurrency=1).metrics()
    slos = {"ttft": TTFT_FACTOR * alone["median_ttft_ms"], "tpot": TPOT_FACTOR * alone["median_tpot_ms"]}
    capacity = capacity_rps(llm, random_prompts(random.Random(99), vocab, 8, prompt_len), out_len)
    loads = [0.25, 0.5, 1.0, 1.5, 2.5]
    s = {"load": loads, "rate": [x * capacity for x in loads], "tok_s": [], "goodput": []}
    for i, rate in enumerate(s["rate"]):
        r = serve(llm, arriving(random_prompts(rng, vocab, count, prompt_len), out_len, rate, i)).metrics(slos)
        s["tok_s"].append(r["output_throughput"])
        s["goodput"].append(r["output_goodput"])
    m = Measurement(series=s, settings={"slo_ms": slos, "capacity_rps": capacity})
    best = s["goodput"].index(max(s["goodput"]))
    m.ends("load", "goodput", "tok_s")
    m.numbers |= {f"{k}_best": s[k][best] for k in ("load", "rate", "goodput", "tok_s")}
    m.numbers["max_excess"] = max(g - t for g, t in zip(s["goodput"], s["tok_s"], strict=True))
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "max_excess <= 0.0",
            yes="Goodput never exceeded throughput (by at most {max_excess} tokens/s): at the best load, {rate_best} "
            "requests/s, {goodput_best} of {tok_s_best} output tokens/s met both SLOs.",
            no="Goodput exceeded throughput by {max_excess} tokens/s: a measurement error.",
        ),
        m.decide(
            "goodput_hi < goodput_best",
            yes="Past the knee ({load_best} times capacity) goodput fell: at {load_hi} times it was {goodput_hi} of "
            "{tok_s_hi} tokens/s served, against a best of {goodput_best}.",
            no="Goodput did not fall at {load_hi} times capacity ({goodput_hi} tokens/s, best {goodput_best}).",
        ),
    ]
    slo = m.settings["slo_ms"]
    intro = f"The SLOs: TTFT at most {slo['ttft']:.1f} ms ({TTFT_FACTOR:g}x a request alone here), TPOT at most "
    intro += f"{slo['tpot']:.1f} ms ({TPOT_FACTOR:g}x), under Poisson arrivals at multiples of the engine's capacity."
    why = "Why it matters: a replica's capacity is the load at the knee, and cost per token follows goodput."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ax = lines(fig, m.series["rate"], {"throughput": m.series["tok_s"], "goodput (meets SLOs)": m.series["goodput"]})
    ax.axvline(m.numbers["rate_best"], color="gray", ls="--")
    ax.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="Goodput vs load (dashed: the knee)")


LAB = Lab("goodput", "Goodput", measure, explain, plot)
