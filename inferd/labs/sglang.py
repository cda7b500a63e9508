"""SGLang: prefix reuse (RadixAttention's idea) in one engine, and across two replicas routed by prefix."""

from __future__ import annotations

import statistics

from inferd.bench.client import ttfts
from inferd.bench.drive import Job, SharedPrefixes, serve
from inferd.labs.base import Explanation, Lab, Measurement, bars
from inferd.labs.context import LabContext
from inferd.procs import Scrape


def workload(ctx: LabContext) -> SharedPrefixes:
    """This lab's shared-prefix workload at the run's size (the Dynamo lab routes the same one)."""
    return SharedPrefixes(*ctx.size((6, 4, 128, 16), (8, 4, 512, 32)))


def routed(ctx: LabContext, picker: str, prompts: list[list[int]], replicas) -> tuple[float, float]:
    """(mean TTFT in ms, % of prompt tokens the replicas found cached) through a gateway with this picker."""
    with ctx.procs.scoped():
        gw = ctx.procs.gateway(replicas, routing={"picker": picker})
        with Scrape([r.url for r in replicas]) as scraped:
            ttft = statistics.mean(ttfts(gw.url, prompts, 2)) * 1000
    hits, queries = (scraped.rise(f"inferd:prefix_cache_{k}_total") for k in ("hits", "queries"))
    return ttft, 100 * hits / max(queries, 1.0)


def measure(ctx: LabContext) -> Measurement:
    w, vocab = workload(ctx), ctx.facts.vocab
    n = dict(prefixes=w.prefixes, users=w.users, prefix_len=w.prefix_len)
    for caching in ("on", "off"):  # one engine
        llm = ctx.llm(enable_prefix_caching=caching == "on")
        llm.reset_prefix_cache()
        run = serve(llm, [Job(p, 2) for p in w.prompts(0, vocab)], concurrency=4)
        n[f"ttft_{caching}_ms"] = run.metrics()["mean_ttft_ms"]
        n[f"computed_{caching}"] = sum(s.input_tokens - s.cached_tokens for s in run.served)
    n["saved_pct"] = 100 * (1 - n["computed_on"] / n["computed_off"])
    # two replicas whose caches hold ~60% of all prefix blocks: enough for half the prefixes each, not for all
    n["replica_blocks"] = blocks = w.blocks_holding(0.6)
    replicas = ctx.procs.replicas(2, "--num-blocks", str(blocks), "--max-model-len", str(w.max_len))
    n["rr_ttft_ms"], n["rr_hit_pct"] = routed(ctx, "round_robin", w.prompts(1, vocab), replicas)
    n["pa_ttft_ms"], n["pa_hit_pct"] = routed(ctx, "scored", w.prompts(2, vocab), replicas)
    return Measurement(n)


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "computed_on < computed_off",
            yes="With {prefixes} shared {prefix_len}-token prefixes and {users} questions each, one engine computed "
            "{computed_on} prompt tokens with prefix caching against {computed_off} without ({saved_pct}% saved).",
            no="With prefix caching the engine computed {computed_on} prompt tokens against {computed_off} without.",
        ),
        m.decide(
            "ttft_on_ms < ttft_off_ms",
            yes="Mean TTFT fell from {ttft_off_ms} ms to {ttft_on_ms} ms.",
            no="Mean TTFT did not fall ({ttft_off_ms} ms, then {ttft_on_ms} ms): a prefill this small costs little.",
        ),
        m.decide(
            "pa_hit_pct > rr_hit_pct",
            yes="Over two replicas whose caches hold about half the prefixes each, round-robin found {rr_hit_pct}% of "
            "prompt tokens cached, prefix-aware routing {pa_hit_pct}% (mean TTFT {rr_ttft_ms} and {pa_ttft_ms} ms).",
            no="Over two replicas, round-robin found {rr_hit_pct}% of prompt tokens cached and prefix-aware routing "
            "{pa_hit_pct}%: no gain from affinity here.",
        ),
    ]
    intro = "RadixAttention keeps computed KV blocks in a tree keyed by their tokens, so a request starting with a "
    intro += "cached prefix skips that prefill; inferd's gateway routes a prompt to the replica holding its prefix."
    why = "Why it matters: system prompts, tools and chat history repeat; reusing their KV cuts prefill and TTFT."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    n = m.numbers
    hits = {"one engine": n["saved_pct"], "round-robin": n["rr_hit_pct"], "prefix-aware": n["pa_hit_pct"]}
    bars(fig, hits, ylabel="% prompt tokens from cache", title="Prefix reuse: one engine, two replicas", ylim=(0, 100))


LAB = Lab("sglang", "SGLang", measure, explain, plot)
