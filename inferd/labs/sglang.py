"""SGLang: prefix reuse, RadixAttention's idea. A shared-prefix workload (few long system prompts, many
questions) runs with prefix caching off and on in one engine; then over two replicas behind the gateway,
routed round-robin and prefix-aware, with each replica's cache big enough for about half the prefixes."""

from __future__ import annotations

import random
import statistics

from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext, summed_delta, ttfts
from inferd.procs import metrics

DEFINITION = (
    "engine with RadixAttention (prefix-cache reuse), strong for structured generation and high-concurrency workloads."
)


def shared_prefix_prompts(seed: int, prefixes: int, users: int, prefix_len: int, question_len: int, vocab: int):
    """`prefixes` system prompts, each followed by `users` different questions, in random order."""
    rng = random.Random(seed)
    heads = random_prompts(rng, vocab, prefixes, prefix_len)
    prompts = [h + random_prompts(rng, vocab, 1, question_len)[0] for h in heads for _ in range(users)]
    rng.shuffle(prompts)
    return prompts


def in_engine(ctx: LabContext, prompts: list[list[int]], caching: bool, concurrency: int) -> tuple[float, int]:
    """(mean TTFT in ms, prompt tokens computed) of the workload on one engine, prefix caching off or on."""
    llm = ctx.llm(enable_prefix_caching=caching)
    llm.engine.kv.reset_prefix_cache()
    run = serve(llm, [Job(p, 2) for p in prompts], concurrency=concurrency)
    return run.metrics()["mean_ttft_ms"], sum(s.input_tokens - s.cached_tokens for s in run.served)


def routed(ctx: LabContext, picker: str, prompts: list[list[int]], replicas, concurrency: int) -> tuple[float, float]:
    """(mean TTFT in ms, % of prompt tokens the replicas found cached) through a gateway with this picker."""
    with ctx.scoped():
        gw = ctx.gateway(replicas, routing={"picker": picker})
        before = [metrics(r.url) for r in replicas]
        times = ttfts(gw.url, prompts, concurrency)
        after = [metrics(r.url) for r in replicas]
    hits = summed_delta(after, before, "inferd:prefix_cache_hits_total")
    queries = summed_delta(after, before, "inferd:prefix_cache_queries_total")
    return statistics.mean(times) * 1000, 100 * hits / max(queries, 1.0)


def measure(ctx: LabContext) -> Measurement:
    vocab = ctx.facts().vocab
    k, users, plen, qlen = ctx.size((6, 4, 128, 16), (8, 4, 512, 32))
    prompts = shared_prefix_prompts(0, k, users, plen, qlen, vocab)
    ttft_on, computed_on = in_engine(ctx, prompts, True, 4)
    ttft_off, computed_off = in_engine(ctx, prompts, False, 4)
    # two replicas whose caches hold ~60% of all prefix blocks: enough for half the prefixes each, not for all
    max_len = 16 * (2 + (plen + qlen) // 16)
    blocks = max(int(0.6 * k * plen / 16), 2 * max_len // 16)
    replicas = ctx.replicas(2, "--num-blocks", str(blocks), "--max-model-len", str(max_len))
    rr_ttft, rr_hit = routed(ctx, "round_robin", shared_prefix_prompts(1, k, users, plen, qlen, vocab), replicas, 2)
    pa_ttft, pa_hit = routed(ctx, "scored", shared_prefix_prompts(2, k, users, plen, qlen, vocab), replicas, 2)
    settings = {"prefixes": k, "users": users, "prefix_len": plen, "question_len": qlen, "replica_blocks": blocks}
    return Measurement(settings=settings, numbers=dict(
        prefixes=k, users=users, prefix_len=plen, requests=len(prompts), computed_off=computed_off,
        computed_on=computed_on, ttft_off_ms=ttft_off, ttft_on_ms=ttft_on,
        saved_pct=100 * (1 - computed_on / computed_off),
        replica_blocks=blocks, rr_hit_pct=rr_hit, pa_hit_pct=pa_hit, rr_ttft_ms=rr_ttft, pa_ttft_ms=pa_ttft,
    ))  # fmt: skip


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "computed_on < computed_off",
            must=True,
            yes="With {prefixes} shared {prefix_len}-token prefixes and {users} questions each, the engine computed "
            "{computed_on} prompt tokens with prefix caching against {computed_off} without: {saved_pct}% of "
            "prefill skipped because the blocks were already in the cache.",
            no="With prefix caching the engine computed {computed_on} prompt tokens against {computed_off} without.",
        ),
        m.decide(
            "ttft_on_ms < ttft_off_ms",
            yes="Mean TTFT fell from {ttft_off_ms} ms to {ttft_on_ms} ms.",
            no="Mean TTFT did not fall: {ttft_off_ms} ms without the cache, {ttft_on_ms} ms with it; at these sizes "
            "a prefill costs little more than the step around it.",
        ),
        m.decide(
            "pa_hit_pct > rr_hit_pct",
            yes="Over two replicas whose caches hold about half the prefixes each ({replica_blocks} blocks), "
            "round-robin routing found {rr_hit_pct}% of prompt tokens cached and prefix-aware routing "
            "{pa_hit_pct}%: sending a prefix to the replica that already holds it keeps each cache on its own "
            "half of the prefixes.",
            no="Over two replicas, round-robin found {rr_hit_pct}% of prompt tokens cached and prefix-aware "
            "routing {pa_hit_pct}%: no gain from affinity here.",
        ),
        m.decide(
            "pa_ttft_ms < rr_ttft_ms",
            yes="Mean TTFT through the gateway: {rr_ttft_ms} ms round-robin, {pa_ttft_ms} ms prefix-aware.",
            no="Mean TTFT through the gateway: {rr_ttft_ms} ms round-robin, {pa_ttft_ms} ms prefix-aware: the hit "
            "rate did not turn into lower latency at these sizes.",
        ),
    ]
    intro = [
        "RadixAttention keeps computed KV blocks in a tree keyed by their tokens, so any request that starts "
        "with a cached prefix skips that part of prefill. inferd's prefix cache does the same with a hash chain "
        "over full blocks; its gateway carries the idea across replicas (the llm-d and SGLang-router idea) by "
        "routing a prompt to the replica that already holds its prefix.",
    ]
    why = [
        "Why it matters: system prompts, few-shot examples, agents' tool descriptions and chat history repeat "
        "across requests. Reusing their KV cuts prefill work and TTFT, and only pays off across a fleet when "
        "routing keeps each prefix where its cache is."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    n = m.numbers
    a.bar(["caching off", "caching on"], [n["computed_off"], n["computed_on"]])
    a.set(ylabel="prompt tokens computed", title="One engine")
    b.bar(["round-robin", "prefix-aware"], [n["rr_hit_pct"], n["pa_hit_pct"]], color="C1")
    b.set(ylabel="% prompt tokens from cache", title="Two replicas behind the gateway", ylim=(0, 100))


LAB = Lab("sglang", "SGLang", DEFINITION, measure, explain, plot)
