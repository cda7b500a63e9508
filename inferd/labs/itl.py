"""ITL / TPOT: the distribution of gaps between tokens against batch size, and what a long prompt joining
does to the requests already decoding, with chunked prefill off and on."""

from __future__ import annotations

import random

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.measure.stats import percentile

DEFINITION = 'time between successive output tokens during decode. Drives perceived "typing speed."'


def join_stall(ctx: LabContext, chunk: int, long_len: int, decoders: int, out_len: int) -> tuple[float, float]:
    """Longest gap between two tokens of the decoding requests while a `long_len` prompt joins, and the
    long request's TTFT (ms). chunk 0 prefills the whole prompt in one step."""
    llm = ctx.llm(long_prefill_token_threshold=chunk)
    rng = random.Random(7)
    vocab = ctx.facts().vocab
    short = [Job(p, out_len) for p in random_prompts(rng, vocab, decoders, 16)]
    long = Job(random_prompts(rng, vocab, 1, long_len)[0], 2, at_step=4)
    run = serve(llm, [*short, long])
    stall = max(max(s.itls) for s in run.served[:decoders])
    return stall * 1000, run.served[-1].ttft * 1000


def measure(ctx: LabContext) -> Measurement:
    batches = ctx.size([1, 4, 16], [1, 4, 16, 32])
    out_len, prompt_len = ctx.size(12, 32), ctx.size(32, 128)
    rng = random.Random(3)
    m = Measurement(settings={"batches": batches})
    series = {"batch": batches, "itl_ms": []}
    llm = ctx.llm()
    for b in batches:
        run = serve(llm, [Job(p, out_len) for p in random_prompts(rng, ctx.facts().vocab, b, prompt_len)])
        series["itl_ms"].append([g * 1000 for s in run.served for g in s.itls])
    for b, gaps in zip(batches, series["itl_ms"], strict=True):
        m.numbers[f"itl_p50_ms_b{b}"] = percentile(gaps, 50)
        m.numbers[f"itl_p99_ms_b{b}"] = percentile(gaps, 99)
    long_len, chunk = ctx.size(768, 1536), ctx.size(64, 256)
    decoders, join_out = 4, ctx.size(24, 48)
    stall_off, ttft_off = join_stall(ctx, 0, long_len, decoders, join_out)
    stall_on, ttft_on = join_stall(ctx, chunk, long_len, decoders, join_out)
    lo, hi = batches[0], batches[-1]
    m.numbers.update(
        b_lo=lo,
        b_hi=hi,
        itl_p50_lo=m.numbers[f"itl_p50_ms_b{lo}"],
        itl_p50_hi=m.numbers[f"itl_p50_ms_b{hi}"],
        long_len=long_len,
        chunk=chunk,
        decoders=decoders,
        stall_off_ms=stall_off,
        stall_on_ms=stall_on,
        long_ttft_off_ms=ttft_off,
        long_ttft_on_ms=ttft_on,
    )
    m.series = series
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "itl_p50_hi > itl_p50_lo",
            yes="Median ITL grew from {itl_p50_lo} ms at batch {b_lo} to {itl_p50_hi} ms at batch {b_hi}: each "
            "request types slower when it shares the step with more others.",
            no="Median ITL did not grow with the batch: {itl_p50_lo} ms at batch {b_lo}, {itl_p50_hi} ms at "
            "batch {b_hi}; fixed per-step costs dominate a step at these sizes.",
        ),
        m.decide(
            "stall_on_ms < stall_off_ms",
            yes="When a {long_len}-token prompt joined {decoders} decoding requests, their longest gap between two "
            "tokens was {stall_off_ms} ms with the whole prompt in one step, and {stall_on_ms} ms with chunked "
            "prefill ({chunk} tokens per step): chunks let decodes keep flowing.",
            no="When a {long_len}-token prompt joined {decoders} decoding requests, their longest gap was "
            "{stall_off_ms} ms unchunked and {stall_on_ms} ms with {chunk}-token chunks: chunking did not shorten "
            "the stall here.",
        ),
        m.decide(
            "long_ttft_on_ms >= long_ttft_off_ms",
            textbook=False,
            yes="The price: the long request's own TTFT was {long_ttft_on_ms} ms chunked against {long_ttft_off_ms} "
            "ms in one piece.",
            no="The long request's own TTFT was {long_ttft_on_ms} ms chunked against {long_ttft_off_ms} ms in one "
            "piece: chunking cost it nothing measurable here.",
        ),
    ]
    intro = [
        "ITL is every gap between two tokens of a stream; TPOT is a request's (end-to-end latency - TTFT) / "
        "(output tokens - 1), vLLM's definitions, used by `inferd bench` too. This lab collected every gap at "
        f"batch sizes {', '.join(map(str, m.settings['batches']))}, then let one long prompt join requests that "
        "were decoding, with chunked prefill off and on (`--long-prefill-token-threshold`).",
    ]
    why = [
        "Why it matters: ITL is the typing speed a user sees, and its tail is what a long prompt arriving does "
        "to everyone else. Chunked prefill (and, further, separate prefill and decode pools) keeps that tail short."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    s = m.series
    a.boxplot(s["itl_ms"], tick_labels=[str(x) for x in s["batch"]], showfliers=True)
    a.set(xlabel="batch size", ylabel="ITL (ms)", title="ITL distribution vs batch")
    b.bar(["one step", "chunked"], [m.numbers["stall_off_ms"], m.numbers["stall_on_ms"]])
    b.set(ylabel="longest ITL of decoding requests (ms)", title="A long prompt joins")


LAB = Lab("itl", "ITL / TPOT", DEFINITION, measure, explain, plot)
