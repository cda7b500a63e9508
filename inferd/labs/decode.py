"""Decode: a step's time against batch size, and its bytes (weights + KV cache) against this machine's bandwidth."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext
from inferd.measure.stats import percentile


def measure(ctx: LabContext) -> Measurement:
    facts, hw = ctx.facts, ctx.hardware
    batches, prompt_len, steps = ctx.size([1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 32]), ctx.size(32, 128), ctx.size(10, 24)
    context = prompt_len + steps // 2  # the mean context of a decode step
    flops, nbytes = facts.flops_per_token(context), facts.weight_bytes + facts.kv_bytes_read(context)
    m = Measurement(series={"batch": batches, "step_ms": []}, settings={"prompt_len": prompt_len, "output_len": steps})
    for b in batches:  # the median step in which the whole batch decoded and nothing else ran
        run = serve(ctx.llm(), [Job(p, steps) for p in random_prompts(random.Random(b), facts.vocab, b, prompt_len)])
        m.series["step_ms"].append(percentile(run.pure_decode_steps(b), 50) * 1000)
    m.series["tok_s"] = [b / ms * 1000 for b, ms in zip(batches, m.series["step_ms"], strict=True)]
    m.series["tflops"] = [b * flops / ms / 1e9 for b, ms in zip(batches, m.series["step_ms"], strict=True)]
    n, step1, b_max = m.numbers, m.series["step_ms"][0], batches[-1]
    n |= dict(b_max=b_max, step_ms_b1=step1, step_ms_bmax=m.series["step_ms"][-1], step_ms_b1_times_bmax=step1 * b_max)
    n |= dict(mb_read_b1=nbytes / 1e6, gb_s_b1=nbytes / step1 / 1e6, bandwidth_gb_s=hw.memory_bandwidth / 1e9)
    n |= dict(t_mem_ms_b1=nbytes / hw.memory_bandwidth * 1000, t_flops_ms_b1=flops / hw.matmul_flops * 1000)
    n["bw_pct_b1"] = 100 * n["gb_s_b1"] / n["bandwidth_gb_s"]
    n["overhead_ms_b1"] = max(0.0, step1 - max(n["t_mem_ms_b1"], n["t_flops_ms_b1"]))
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "step_ms_bmax < step_ms_b1_times_bmax",
            yes="A step at batch {b_max} took {step_ms_bmax} ms against {step_ms_b1} ms at batch 1, far less than "
            "{b_max} times ({step_ms_b1_times_bmax} ms): the weights are read once per step whatever the batch.",
            no="A batch-{b_max} step took {step_ms_bmax} ms, {b_max}x batch 1's or more ({step_ms_b1_times_bmax} ms).",
        ),
        m.decide(
            "bw_pct_b1 >= 50.0",
            yes="At batch 1 a step reads {mb_read_b1} MB in {step_ms_b1} ms: {gb_s_b1} GB/s, {bw_pct_b1}% of the "
            "{bandwidth_gb_s} GB/s this machine reads: memory-bandwidth-bound, as the glossary says.",
            no="At batch 1 a step reads {mb_read_b1} MB in {step_ms_b1} ms: {gb_s_b1} GB/s, only {bw_pct_b1}% of the "
            "{bandwidth_gb_s} GB/s this machine reads: not memory-bandwidth-bound here, contrary to the glossary.",
        ),
        m.either(
            "overhead_ms_b1 > t_mem_ms_b1",
            yes="Why: the reads would take {t_mem_ms_b1} ms and the FLOPs {t_flops_ms_b1} ms; the other "
            "{overhead_ms_b1} ms are fixed per-step costs (Python, scheduling, small kernels) that CUDA graphs hide.",
            no="The reads take {t_mem_ms_b1} ms (the FLOPs {t_flops_ms_b1} ms), fixed per-step costs {overhead_ms_b1}.",
        ),
    ]
    intro = f"This lab decoded batches of {m.settings['prompt_len']}-token prompts and timed the steps in which "
    intro += "every request decoded one token and nothing else ran."
    why = "Why it matters: a step costs nearly the same for one request as for many, so decode is cheap only batched."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    s, axes = m.series, dict(xlabel="batch size", ylabel="step time (ms)", xscale="log", yscale="log")
    ys = {"decode step": s["step_ms"], "linear in batch": [s["step_ms"][0] * b for b in s["batch"]]}
    lines(fig, s["batch"], ys, title="Decode step time vs batch", **axes)


LAB = Lab("decode", "Decode", measure, explain, plot)
