"""Prefill: a prompt's processing time against its length, and its FLOP/s against this machine's matmul peak."""

from __future__ import annotations

import random

from inferd.bench.drive import random_prompts
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext
from inferd.measure.hardware import best_time
from inferd.sampling import SamplingParams


def measure(ctx: LabContext) -> Measurement:
    lengths, rng = ctx.size([8, 32, 128, 256], [32, 128, 512, 1024, 1536]), random.Random(0)
    llm, params = ctx.llm(), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    m = Measurement(series={"length": lengths, "ms": [], "tflops": []})
    for n in lengths:  # the fastest of 3 distinct prompts (no prefix-cache hit), after one more
        prompts = iter(random_prompts(rng, ctx.facts.vocab, 4, n))
        m.series["ms"].append(1000 * best_time(lambda p=prompts: llm.generate([next(p)], params), ctx.torch_device, 3))
        m.series["tflops"].append(ctx.facts.prefill_flops(n) / m.series["ms"][-1] / 1e9)
    m.ends("length", "ms", "tflops")
    m.numbers["peak_tflops"] = ctx.hardware.matmul_flops / 1e12
    m.numbers["peak_pct"] = 100 * m.numbers["tflops_hi"] / m.numbers["peak_tflops"]
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "ms_hi > ms_lo",
            yes="A {length_hi}-token prompt took {ms_hi} ms to prefill, a {length_lo}-token one {ms_lo} ms.",
            no="A {length_hi}-token prompt took {ms_hi} ms, no longer than {length_lo} tokens' {ms_lo} ms.",
        ),
        m.decide(
            "peak_pct >= 50.0",
            yes="It reached {tflops_hi} TFLOP/s, {peak_pct}% of the {peak_tflops} a large matmul reaches here: "
            "compute-bound, as the glossary says.",
            no="It reached {tflops_hi} TFLOP/s, only {peak_pct}% of the {peak_tflops} a large matmul reaches here: "
            "small kernels, attention and the engine's per-step work weigh more the smaller the model.",
        ),
    ]
    intro = "This lab timed single prompts from the pass that reads them to the first token: every prompt token "
    intro += "shares each weight read, so the work is large matmuls."
    why = "Why it matters: prefill sets time to first token, and long prompts make it the expensive phase."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    axes = dict(xlabel="prompt tokens", ylabel="TFLOP/s", title="FLOP/s reached vs prompt length")
    peak = ("measured matmul peak", m.numbers["peak_tflops"])
    lines(fig, m.series["length"], {"prefill": m.series["tflops"]}, hline=peak, **axes)


LAB = Lab("prefill", "Prefill", measure, explain, plot)
