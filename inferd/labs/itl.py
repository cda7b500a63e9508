"""ITL / TPOT: gaps between tokens against batch size, and a long prompt joining decodes, chunked or not."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.measure.stats import percentile


def measure(ctx: LabContext) -> Measurement:
    batches, rng, vocab = ctx.size([1, 4, 16], [1, 4, 16, 32]), random.Random(3), ctx.facts.vocab
    out_len, prompt_len, long_len, chunk = ctx.size((12, 32, 768, 64), (32, 128, 1536, 256))
    m = Measurement({"long_len": long_len, "chunk": chunk}, {"batch": batches, "itl_ms": [], "p50": []})
    for b in batches:
        run = serve(ctx.llm(), [Job(p, out_len) for p in random_prompts(rng, vocab, b, prompt_len)])
        m.series["itl_ms"].append([g * 1000 for s in run.served for g in s.itls])
        m.series["p50"].append(percentile(m.series["itl_ms"][-1], 50))
    m.ends("batch", "p50")
    jobs = [Job(p, 2 * out_len) for p in random_prompts(rng, vocab, 4, 16)]
    jobs.append(Job(random_prompts(rng, vocab, 1, long_len)[0], 2, at_step=4))  # joins 4 decoding requests
    for name, tokens in (("off", 0), ("on", chunk)):  # the prompt in one step, or `chunk` tokens a step
        run = serve(ctx.llm(long_prefill_token_threshold=tokens), jobs)
        m.numbers[f"stall_{name}_ms"] = max(max(s.itls) for s in run.served[:4]) * 1000  # their longest gap
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "p50_hi > p50_lo",
            yes="Median ITL grew from {p50_lo} ms at batch {batch_lo} to {p50_hi} ms at batch {batch_hi}: a request "
            "types slower when it shares each step with more others.",
            no="Median ITL did not grow with the batch ({p50_lo} ms at {batch_lo}, {p50_hi} ms at {batch_hi}).",
        ),
        m.decide(
            "stall_on_ms < stall_off_ms",
            yes="When a {long_len}-token prompt joined 4 decoding requests, their longest gap was {stall_off_ms} ms "
            "with the prompt in one step and {stall_on_ms} ms in {chunk}-token chunks: chunks let decodes flow.",
            no="When a {long_len}-token prompt joined 4 decoding requests, their longest gap was {stall_off_ms} ms "
            "whole and {stall_on_ms} ms in {chunk}-token chunks.",
        ),
    ]
    intro = "ITL is every gap between two tokens of a stream; TPOT is a request's (latency - TTFT) / (output tokens "
    intro += "- 1), as vLLM and `inferd bench` define them."
    why = "Why it matters: ITL is the typing speed users see; chunked prefill keeps a long prompt from stalling it."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots()
    ax.boxplot(m.series["itl_ms"], tick_labels=[str(x) for x in m.series["batch"]])
    ax.set(xlabel="batch size", ylabel="ITL (ms)", title="ITL distribution vs batch")


LAB = Lab("itl", "ITL / TPOT", measure, explain, plot)
