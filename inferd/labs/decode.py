"""Decode: one step's time against batch size, the bytes it reads (weights + KV cache) against this
machine's measured memory bandwidth, and prefill and decode on one roofline."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.labs.prefill import measure_prefill
from inferd.measure.stats import percentile

DEFINITION = (
    "the autoregressive loop that generates one token at a time after prefill. Memory-bandwidth-bound: each "
    "step reads the whole model plus KV cache from GPU memory to produce one token, so it's limited by memory "
    "bandwidth, not compute."
)


def decode_step_ms(ctx: LabContext, batch: int, prompt_len: int, steps: int) -> float:
    """Median time of a step in which exactly `batch` requests decode and nothing else runs."""
    rng = random.Random(batch)
    prompts = random_prompts(rng, ctx.facts().vocab, batch, prompt_len)
    run = serve(ctx.llm(), [Job(p, steps) for p in prompts])
    times = run.pure_decode_steps(batch)
    if not times:
        raise RuntimeError(f"no pure decode step at batch {batch}")
    return percentile(times, 50) * 1000


def measure(ctx: LabContext) -> Measurement:
    facts, hw = ctx.facts(), ctx.hardware()
    batches = ctx.size([1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 32])
    prompt_len, steps = ctx.size(32, 128), ctx.size(10, 24)
    context = prompt_len + steps // 2
    m = Measurement(settings={"batches": batches, "prompt_len": prompt_len, "output_len": steps})
    series = {"batch": batches, "step_ms": [], "tok_s": [], "gb_s": [], "intensity": [], "tflops": []}
    for b in batches:
        ms = decode_step_ms(ctx, b, prompt_len, steps)
        nbytes = facts.weight_bytes + b * facts.kv_bytes_read(context)
        flops = b * facts.flops_per_token(context)
        series["step_ms"].append(ms)
        series["tok_s"].append(b / ms * 1000)
        series["gb_s"].append(nbytes / ms * 1000 / 1e9)
        series["intensity"].append(flops / nbytes)
        series["tflops"].append(flops / ms * 1000 / 1e12)
        m.numbers[f"step_ms_b{b}"] = ms
    lo, hi = batches[0], batches[-1]
    bytes1 = facts.weight_bytes + facts.kv_bytes_read(context)
    t_mem = bytes1 / hw.memory_bandwidth * 1000
    t_flops = facts.flops_per_token(context) / hw.matmul_flops * 1000
    step1 = m.numbers[f"step_ms_b{lo}"]
    m.numbers.update(
        b_max=hi,
        step_ms_b1=step1,
        step_ms_bmax=m.numbers[f"step_ms_b{hi}"],
        step_ms_b1_times_bmax=step1 * hi,
        tok_s_b1=series["tok_s"][0],
        tok_s_bmax=series["tok_s"][-1],
        mb_read_b1=bytes1 / 1e6,
        gb_s_b1=series["gb_s"][0],
        bandwidth_gb_s=hw.memory_bandwidth / 1e9,
        bw_pct_b1=100 * series["gb_s"][0] / (hw.memory_bandwidth / 1e9),
        t_mem_ms_b1=t_mem,
        t_flops_ms_b1=t_flops,
        overhead_ms_b1=max(0.0, step1 - max(t_mem, t_flops)),
        peak_tflops=hw.matmul_flops / 1e12,
    )
    prefill = ctx.measurements.get("prefill")
    if prefill is not None:
        lengths, secs = prefill.series["lengths"], [ms / 1000 for ms in prefill.series["ms"]]
    else:
        lengths = ctx.size([32, 128], [128, 1024])
        times = measure_prefill(ctx, lengths)
        secs = [times[n] for n in lengths]
    series["prefill_intensity"] = [facts.prefill_intensity(n) for n in lengths]
    series["prefill_tflops"] = [facts.prefill_flops(n) / t / 1e12 for n, t in zip(lengths, secs, strict=True)]
    series["prefill_lengths"] = lengths
    m.series = series
    m.settings["bandwidth_gb_s"] = hw.memory_bandwidth / 1e9
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "step_ms_bmax < step_ms_b1_times_bmax",
            must=True,
            yes="A step at batch {b_max} took {step_ms_bmax} ms against {step_ms_b1} ms at batch 1: {b_max} times "
            "the tokens for far less than {b_max} times the time ({step_ms_b1_times_bmax} ms), because the "
            "weights are read once per step whatever the batch.",
            no="A step at batch {b_max} took {step_ms_bmax} ms, at least {b_max} times batch 1's {step_ms_b1} ms "
            "({step_ms_b1_times_bmax} ms): batching bought nothing here.",
        ),
        m.decide(
            "tok_s_bmax > tok_s_b1",
            yes="So decode throughput rose from {tok_s_b1} tokens/s at batch 1 to {tok_s_bmax} at batch {b_max}.",
            no="Decode throughput fell from {tok_s_b1} tokens/s at batch 1 to {tok_s_bmax} at batch {b_max}.",
        ),
        m.decide(
            "bw_pct_b1 >= 50.0",
            yes="At batch 1 a step reads {mb_read_b1} MB of weights and KV cache in {step_ms_b1} ms: {gb_s_b1} GB/s, "
            "{bw_pct_b1}% of the {bandwidth_gb_s} GB/s this machine reads: memory-bandwidth-bound, as the "
            "glossary says.",
            no="At batch 1 a step reads {mb_read_b1} MB of weights and KV cache in {step_ms_b1} ms: {gb_s_b1} GB/s, "
            "only {bw_pct_b1}% of the {bandwidth_gb_s} GB/s this machine reads. This decode is not "
            "memory-bandwidth-bound here, contrary to the glossary.",
        ),
        m.decide(
            "overhead_ms_b1 > t_mem_ms_b1",
            textbook=False,
            yes="Why: reading those bytes at full bandwidth would take {t_mem_ms_b1} ms and the FLOPs at the matmul "
            "peak {t_flops_ms_b1} ms, yet the step took {step_ms_b1} ms; the other {overhead_ms_b1} ms are fixed "
            "per-step costs (Python, scheduling, many small kernels) that a GPU engine hides with CUDA graphs "
            "and a bigger model amortizes.",
            no="Reading those bytes at full bandwidth takes {t_mem_ms_b1} ms of the {step_ms_b1} ms step (FLOPs at "
            "peak {t_flops_ms_b1} ms); fixed per-step costs add {overhead_ms_b1} ms, less than the reads.",
        ),
    ]
    intro = [
        f"This lab ran batches of {', '.join(map(str, m.settings['batches']))} requests "
        f"({m.settings['prompt_len']}-token prompts, {m.settings['output_len']} tokens out) and timed the steps "
        "in which every request of the batch decoded one token and nothing else ran.",
    ]
    why = [
        "Why it matters: since a decode step costs nearly the same for one request as for many, serving is "
        "cheap only when many requests decode together. That is what continuous batching and a large KV "
        "cache buy, and why quantized (smaller) weights make single-stream decode faster."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    s = m.series
    a.plot(s["batch"], s["step_ms"], "o-", label="decode step")
    a.plot(s["batch"], [s["step_ms"][0] * x for x in s["batch"]], "--", color="gray", label="linear in batch")
    a.set(xlabel="batch size", ylabel="step time (ms)", title="Decode step time vs batch", xscale="log", yscale="log")
    a.legend()
    peak, bw = m.numbers["peak_tflops"], m.settings["bandwidth_gb_s"]
    xs = [0.1, 1, 10, 100, 1000, 10000]
    b.plot(xs, [min(peak, x * bw / 1000) for x in xs], "k-", label="roofline (measured)")
    b.plot(s["intensity"], s["tflops"], "o-", label="decode, by batch")
    b.plot(s["prefill_intensity"], s["prefill_tflops"], "s-", label="prefill, by prompt length")
    b.set(xlabel="FLOP per byte", ylabel="TFLOP/s", title="Roofline", xscale="log", yscale="log")
    b.legend()


LAB = Lab("decode", "Decode", DEFINITION, measure, explain, plot)
