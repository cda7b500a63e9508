"""PagedAttention: requests of mixed lengths that fit in one cache, in pages against contiguous reservations."""

from __future__ import annotations

import random

from inferd.labs.base import Explanation, Lab, Measurement, bars
from inferd.labs.context import LabContext


def measure(ctx: LabContext) -> Measurement:
    engine, rng = ctx.llm().engine, random.Random(0)
    bs, max_len, capacity = engine.kv.block_size, engine.max_model_len, engine.kv.num_blocks * engine.kv.block_size
    # prompt + output as chat traffic has them: mostly short, a long tail, capped at the context
    lengths = [min(max_len, max(16, int(rng.lognormvariate(5.3, 0.8)))) for _ in range(engine.kv.num_blocks + 1)]
    paged, used = engine.kv.fit(lengths)
    contiguous = capacity // max_len  # each request reserves the whole context up front
    waste = used * bs - sum(lengths[:paged])
    n = dict(capacity_tokens=capacity, max_len=max_len, mean_len=sum(lengths) / len(lengths), block_size=bs)
    n |= dict(paged_concurrency=paged, contiguous_concurrency=contiguous, gain=paged / contiguous)
    n |= dict(paged_waste_pct=100 * waste / (used * bs), paged_waste_per_request=waste / paged)
    n["contiguous_waste_pct"] = 100 * (1 - sum(lengths[:contiguous]) / (contiguous * max_len))
    return Measurement(n)


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "paged_concurrency > contiguous_concurrency",
            yes="Reserving the {max_len}-token context per request, a {capacity_tokens}-token cache fits "
            "{contiguous_concurrency} requests; in pages {paged_concurrency} (mean {mean_len} tokens), {gain}x.",
            no="Paged blocks fit {paged_concurrency} requests, contiguous reservation {contiguous_concurrency}.",
        ),
        m.must(
            "paged_waste_pct < contiguous_waste_pct",
            yes="Memory reserved but never written: {paged_waste_pct}% paged, {contiguous_waste_pct}% contiguous.",
            no="Paged allocation wasted {paged_waste_pct}%, contiguous {contiguous_waste_pct}%.",
        ),
        m.must(
            "paged_waste_per_request < block_size",
            yes="A paged request wastes only its last block's tail: {paged_waste_per_request} of {block_size} tokens.",
            no="Paged requests wasted {paged_waste_per_request} tokens each, a {block_size}-token block or more.",
        ),
    ]
    intro = "This lab packed request lengths drawn as chat traffic has them into the engine's cache twice: with its "
    intro += "block allocator, and as servers did before vLLM, reserving the whole context per request."
    why = "Why it matters: more requests per replica from the same memory, and blocks that prefixes can share."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    fits = {x: m.numbers[f"{x}_concurrency"] for x in ("contiguous", "paged")}
    bars(fig, fits, ylabel="requests that fit at once", title="Concurrency in the same memory")


LAB = Lab("paged-attention", "PagedAttention", measure, explain, plot, timed=False)
