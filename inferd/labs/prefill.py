"""Prefill: the time to process a prompt against its length, and the FLOP/s it reaches against this
machine's measured matmul peak (is it compute-bound here?)."""

from __future__ import annotations

import random

from inferd.bench.drive import random_prompts
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.measure.hardware import best_time
from inferd.sampling import SamplingParams

DEFINITION = (
    "the first forward pass that processes the entire input prompt and produces the first output token. "
    "Compute-bound: work scales with prompt length, saturating GPU compute (FLOPs)."
)


def measure_prefill(ctx: LabContext, lengths: list[int]) -> dict[int, float]:
    """Seconds for one prefill (prompt in, first token out) at each length: the fastest of a few runs."""
    llm = ctx.llm()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for n in lengths:
        prompts = iter(random_prompts(rng, ctx.facts().vocab, 8, n))  # distinct: no prefix-cache hit
        out[n] = best_time(lambda p=prompts: llm.generate([next(p)], params), ctx.torch_device, runs=3)
    return out


def measure(ctx: LabContext) -> Measurement:
    facts, hw = ctx.facts(), ctx.hardware()
    lengths = ctx.size([8, 32, 128, 256], [32, 128, 512, 1024, 1536])
    times = measure_prefill(ctx, lengths)
    m = Measurement(settings={"lengths": lengths, "model": ctx.model_label})
    for n, t in times.items():
        m.numbers[f"prefill_ms_{n}"] = t * 1000
        m.numbers[f"tflops_{n}"] = facts.prefill_flops(n) / t / 1e12
    short, long = lengths[0], lengths[-1]
    m.numbers.update(
        short=short,
        long=long,
        prefill_ms_short=times[short] * 1000,
        prefill_ms_long=times[long] * 1000,
        per_token_ms_short=times[short] * 1000 / short,
        per_token_ms_long=times[long] * 1000 / long,
        tflops_long=facts.prefill_flops(long) / times[long] / 1e12,
        peak_tflops=hw.matmul_flops / 1e12,
        peak_pct_long=100 * facts.prefill_flops(long) / times[long] / hw.matmul_flops,
        intensity_long=facts.prefill_intensity(long),
        ridge=hw.ridge,
        length_ratio=long / short,
    )
    m.series = {"lengths": lengths, "ms": [times[n] * 1000 for n in lengths]}
    m.series["tflops"] = [m.numbers[f"tflops_{n}"] for n in lengths]
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "prefill_ms_long > prefill_ms_short",
            yes="A {long}-token prompt took {prefill_ms_long} ms to prefill, a {short}-token one "
            "{prefill_ms_short} ms: the work grows with the prompt.",
            no="A {long}-token prompt took {prefill_ms_long} ms, no longer than a {short}-token one "
            "({prefill_ms_short} ms): at these sizes fixed per-step costs hide the work of the prompt.",
        ),
        m.decide(
            "per_token_ms_long < per_token_ms_short",
            yes="Per prompt token that is {per_token_ms_long} ms at {long} tokens against {per_token_ms_short} ms at "
            "{short}: many tokens in one pass share each weight read, so the matrix units do more useful work.",
            no="Per prompt token that is {per_token_ms_long} ms at {long} tokens against {per_token_ms_short} ms at "
            "{short}: longer prompts did not get cheaper per token here (attention over the whole prompt grows "
            "faster than the shared weight reads save).",
        ),
        m.decide(
            "intensity_long > ridge",
            yes="Its arithmetic intensity at {long} tokens is {intensity_long} FLOP per byte, above this machine's "
            "ridge point of {ridge} (matmul peak / memory bandwidth): by the roofline, compute is the limit.",
            no="Its arithmetic intensity at {long} tokens is {intensity_long} FLOP per byte, below this machine's "
            "ridge point of {ridge}: even prefill is bandwidth-bound on this model and machine.",
        ),
        m.decide(
            "peak_pct_long >= 50.0",
            yes="It reached {tflops_long} TFLOP/s, {peak_pct_long}% of the {peak_tflops} TFLOP/s a large matmul "
            "reaches here: compute-bound, as the glossary says.",
            no="It reached {tflops_long} TFLOP/s, only {peak_pct_long}% of the {peak_tflops} TFLOP/s a large matmul "
            "reaches here: this prefill is not compute-bound on this machine. The time goes to what is not a big "
            "matmul: small per-layer kernels, norms, attention, and the per-step work of the engine in Python, "
            "which weigh more the smaller the model.",
        ),
    ]
    intro = [
        f"This lab sent single prompts of {', '.join(map(str, m.settings['lengths']))} tokens to "
        f"{m.settings['model']} and timed the pass that reads the prompt and writes the first token.",
    ]
    why = [
        "Why it matters: prefill sets time to first token and competes with decoding for the same hardware. "
        "Long prompts (RAG, agents, chat history) make it the expensive phase, which is why servers cap the "
        "tokens per step, split long prompts into chunks, cache shared prefixes, or give prefill its own pool."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    a.plot(m.series["lengths"], m.series["ms"], "o-")
    a.set(xlabel="prompt tokens", ylabel="prefill time (ms)", title="Prefill time vs prompt length")
    b.plot(m.series["lengths"], m.series["tflops"], "o-", label="prefill")
    b.axhline(m.numbers["peak_tflops"], color="r", ls="--", label="measured matmul peak")
    b.set(xlabel="prompt tokens", ylabel="TFLOP/s", title="FLOP/s reached")
    b.legend()


LAB = Lab("prefill", "Prefill", DEFINITION, measure, explain, plot)
