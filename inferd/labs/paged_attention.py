"""PagedAttention: how many requests of realistic, mixed lengths fit in the same KV memory with paged blocks
(the engine's allocator) against contiguous max-length allocation, and the memory each wastes."""

from __future__ import annotations

import random

from inferd.engine.kv_cache import KVCacheManager
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.labs.kv_cache import allocate

DEFINITION = (
    'vLLM\'s technique that manages KV cache in fixed-size "pages" (like OS virtual memory) instead of one '
    "contiguous block per request. It slashes memory fragmentation, so you fit far more concurrent requests on "
    "the same GPU."
)


def request_lengths(rng: random.Random, count: int, max_len: int) -> list[int]:
    """Prompt + output lengths as chat traffic has them: mostly short, a long tail, capped at the context."""
    return [min(max_len, max(16, int(rng.lognormvariate(5.3, 0.8)))) for _ in range(count)]


def measure(ctx: LabContext) -> Measurement:
    engine = ctx.llm().engine
    bs, num_blocks = engine.kv.block_size, engine.kv.num_blocks
    max_len = engine.max_model_len
    capacity = num_blocks * bs
    lengths = request_lengths(random.Random(0), num_blocks + 1, max_len)
    paged, used_blocks = allocate(KVCacheManager(num_blocks, bs, enable_caching=False), lengths)
    fitted = lengths[:paged]
    contiguous = capacity // max_len  # each request reserves the whole context up front
    held = lengths[:contiguous]
    paged_waste = used_blocks * bs - sum(fitted)
    m = Measurement(settings={"block_size": bs, "capacity_tokens": capacity, "max_model_len": max_len})
    m.numbers.update(
        capacity_tokens=capacity,
        max_len=max_len,
        mean_len=sum(lengths) / len(lengths),
        paged_concurrency=paged,
        contiguous_concurrency=contiguous,
        gain=paged / max(contiguous, 1),
        paged_waste_pct=100 * paged_waste / (used_blocks * bs),
        contiguous_waste_pct=100 * (1 - sum(held) / (contiguous * max_len)) if contiguous else 100.0,
        paged_waste_per_request=paged_waste / max(paged, 1),
        block_size=bs,
    )
    m.series = {"lengths": lengths[: max(paged, 1)], "paged": paged, "contiguous": contiguous}
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "paged_concurrency > contiguous_concurrency",
            must=True,
            yes="In the same {capacity_tokens}-token cache, paged blocks fit {paged_concurrency} requests of mixed "
            "length (mean {mean_len} tokens) at once; reserving the {max_len}-token context contiguously per "
            "request fits {contiguous_concurrency}: {gain} times as many.",
            no="Paged blocks fit {paged_concurrency} requests, contiguous reservation {contiguous_concurrency}.",
        ),
        m.decide(
            "paged_waste_pct < contiguous_waste_pct",
            must=True,
            yes="Memory reserved but never written: {paged_waste_pct}% with pages against {contiguous_waste_pct}% "
            "with contiguous reservation.",
            no="Paged allocation wasted {paged_waste_pct}%, contiguous {contiguous_waste_pct}%.",
        ),
        m.decide(
            "paged_waste_per_request < block_size",
            must=True,
            yes="A paged request wastes at most its last, partly filled block: {paged_waste_per_request} tokens on "
            "average, under the {block_size}-token block.",
            no="Paged requests wasted {paged_waste_per_request} tokens each, a block or more.",
        ),
    ]
    intro = [
        "This lab drew request lengths the way chat traffic has them (mostly short, a long tail) and packed them "
        "into the engine's cache twice: with its real block allocator, and the way servers did before vLLM, "
        "reserving the whole context for each request because its final length is unknown.",
    ]
    why = [
        "Why it matters: concurrency is what makes decode cheap (see the decode lab), and the cache is what "
        "limits it (see the KV cache lab). Pages turn memory that contiguous reservation leaves empty into more "
        "requests per replica, and they make prefix sharing possible: two requests can point at the same block."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    a.bar(["contiguous", "paged"], [m.numbers["contiguous_concurrency"], m.numbers["paged_concurrency"]])
    a.set(ylabel="requests that fit at once", title="Concurrency in the same memory")
    b.bar(["contiguous", "paged"], [m.numbers["contiguous_waste_pct"], m.numbers["paged_waste_pct"]], color="C1")
    b.set(ylabel="% of reserved memory never written", title="Fragmentation")


LAB = Lab("paged-attention", "PagedAttention", DEFINITION, measure, explain, plot, timed=False)
