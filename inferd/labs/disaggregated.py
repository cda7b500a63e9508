"""Disaggregated prefill/decode: short streamed requests among long prompts, served colocated and then split into
a prefill and a decode instance (docs/disaggregation.md), on the same cores."""

from __future__ import annotations

import random

import numpy as np

from inferd.bench.client import send_all, ttfts
from inferd.bench.datasets import BenchRequest
from inferd.bench.drive import random_prompts
from inferd.bench.metrics import itls, summarize_ms, ttft
from inferd.cpu import usable_cores
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.measure.arrivals import arrivals_within
from inferd.procs import Scrape, leases_released


def _workload(url: str, load: dict, vocab: int) -> tuple[dict[str, float], list[float]]:
    """Poisson short requests plus a long prompt every `long_every` s, each streamed to its end: what the short
    requests saw (ms), and their gaps between tokens (ms, sorted)."""
    rng, reqs, at, next_long = random.Random(0), [], [], load["long_every"] / 2
    for t in arrivals_within(load["seconds"], load["rate"], 1.0, np.random.default_rng(0)):
        shapes = [(load["short_prompt"], load["short_tokens"])]
        if t >= next_long:
            shapes.append((load["long_prompt"], 2))
            next_long += load["long_every"]
        reqs += [BenchRequest(random_prompts(rng, vocab, 1, length)[0], length, out) for length, out in shapes]
        at += [t] * len(shapes)
    outs = send_all(url, reqs, at=at)
    if failed := [o.error for o in outs if not o.success]:
        raise RuntimeError(f"{url}: {len(failed)} of {len(outs)} requests failed, e.g. {failed[0]}")
    shorts = [o for o, r in zip(outs, reqs, strict=True) if r.prompt_len == load["short_prompt"]]
    gaps = sorted(g for s in shorts for g in itls(s))
    itl = summarize_ms(gaps, (99,))
    n = dict(shorts=len(shorts), longs=len(outs) - len(shorts), itl_p50_ms=itl.median, itl_p99_ms=itl.percentiles[99])
    n |= dict(itl_max_ms=1000 * max(gaps, default=0), ttft_p50_ms=summarize_ms([ttft(s) for s in shorts]).median)
    return n, [1000 * g for g in gaps]


def measure(ctx: LabContext) -> Measurement:
    load = dict(seconds=4.0, rate=4.0, short_prompt=24, short_tokens=16, long_prompt=900, long_every=1.0)
    load |= ctx.size({}, dict(seconds=30.0, rate=2.0, short_tokens=32, long_prompt=1024, long_every=5.0))
    facts, block_size, cores = ctx.facts, ctx.llm().engine.kv.block_size, usable_cores()
    threads, short, long = min(2, cores), load["short_prompt"], load["long_prompt"]
    warm = [list(range(16, 16 + short)), [16 + i % (facts.vocab - 16) for i in range(long)]]
    with ctx.procs.scoped():
        colo = ctx.procs.serve("--num-threads", str(threads))
        prefill, kv = ctx.procs.prefill()
        decode = ctx.procs.decode([kv])
        proxy = ctx.procs.proxy([prefill], [decode])
        ctx.procs.wait(colo, prefill, decode, proxy)
        ttfts(colo.url, warm, 1)  # the first request of each shape pays one-time costs
        colocated, colo_gaps = _workload(colo.url, load, facts.vocab)
        colo.stop()  # idle, but nothing of it should share the cores with the roles
        ttfts(proxy.url, warm, 1)
        with Scrape([decode.url]) as scraped:
            disagg, dis_gaps = _workload(proxy.url, load, facts.vocab)
        leases_left = leases_released(prefill.url)
    rise = lambda key: scraped.rise(f"inferd:kv_transfer_{key}")
    blocks, kv_bytes, pulls = rise("blocks_total"), rise("bytes_total"), rise("seconds_count")
    expected = facts.kv_bytes_per_token * block_size
    n = {f"colo_{k}": v for k, v in colocated.items()} | {f"dis_{k}": v for k, v in disagg.items()}
    n |= dict(cores=cores, colo_threads=threads, long_prompt=long, leases_left=leases_left)
    n |= dict(remote_prefills=scraped.rise("inferd:remote_prefills_total"), kv_blocks=blocks, transfers=pulls)
    n |= dict(kv_mb=kv_bytes / 1e6, kv_kb_per_request=kv_bytes / 1e3 / max(pulls, 1.0), elem_bytes=facts.elem_bytes)
    n |= dict(transfer_ms=1000 * rise("seconds_sum") / max(pulls, 1.0), expected_bytes_per_block=expected)
    n["bytes_per_block"] = kv_bytes / blocks if blocks else 0.0
    n["block_bytes_error"] = abs(kv_bytes - blocks * expected) if blocks else expected  # none moved: wrong
    n |= dict(layers=facts.num_layers, kv_heads=facts.num_kv_heads, head_dim=facts.head_dim, block_size=block_size)
    n["colo_spike"] = n["colo_itl_p99_ms"] / max(n["colo_itl_p50_ms"], 1e-9)
    settings = load | {"cores": cores, "colocated_threads": threads}
    return Measurement(numbers=n, series={"colocated": colo_gaps, "disaggregated": dis_gaps}, settings=settings)


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "dis_itl_p99_ms < colo_itl_p99_ms",
            yes="With {long_prompt}-token prompts among short streamed requests, the short ones' ITL p99 was "
            "{colo_itl_p99_ms} ms colocated (p50 {colo_itl_p50_ms} ms: the tail {colo_spike} x the median), "
            "{dis_itl_p99_ms} ms disaggregated (p50 {dis_itl_p50_ms} ms): no long prefill ran in decode's steps.",
            no="With {long_prompt}-token prompts among short streamed requests, the short ones' ITL p99 was "
            "{colo_itl_p99_ms} ms colocated and {dis_itl_p99_ms} ms disaggregated: no gain from one decode thread "
            "against {colo_threads} on shared cores, loading each handed-over prompt ({transfer_ms} ms a pull).",
        ),
        m.decide(
            "dis_ttft_p50_ms > colo_ttft_p50_ms",
            yes="What it costs: the short requests' TTFT p50 rose from {colo_ttft_p50_ms} ms to {dis_ttft_p50_ms} ms, "
            "a second HTTP request, a lease and a pull before the first token.",
            no="The short requests' TTFT p50 was {colo_ttft_p50_ms} ms colocated and {dis_ttft_p50_ms} ms "
            "disaggregated: the hop and the pull ({transfer_ms} ms) cost less than queueing behind long prefills.",
        ),
        m.must(
            "block_bytes_error <= 0.0",
            yes="The handoff moved {kv_mb} MB in {kv_blocks} blocks over {transfers} requests ({kv_kb_per_request} kB "
            "each), {bytes_per_block} bytes a block: exactly K and V x {layers} layers x {kv_heads} KV heads x "
            "{head_dim} dims x {elem_bytes} bytes x {block_size} tokens ({block_bytes_error} bytes off in all).",
            no="The handoff moved {bytes_per_block} bytes per block, not the {expected_bytes_per_block} the model's "
            "shape gives ({block_bytes_error} bytes off in all).",
        ),
        m.must(
            "leases_left <= 0.0",
            yes="When the run ended the prefill instance lent no block ({leases_left} leases active): the decode side "
            "acknowledged every lease.",
            no="{leases_left} leases still held prefill blocks after the run.",
        ),
    ]
    intro = "The same arrivals went to one colocated `inferd serve`, then through `inferd disagg proxy` to a `--role "
    intro += "prefill` instance that lends each prompt's KV blocks under a signed lease and a `--role decode` instance "
    intro += "that pulls them through shared memory. ITL is what the client saw: the gaps between streamed chunks."
    why = "Why it matters: long prompts (RAG contexts, documents, agents' histories) and chat streams share replicas; "
    why += "split, each pool is sized for its own bottleneck, at the price of a KV transfer per request."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots()
    for name, gaps in m.series.items():
        ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=name)
    ax.set(xscale="log", xlabel="ITL of the short requests (ms)", ylabel="fraction of gaps at or below", ylim=(0, 1.01))
    ax.set_title("Every gap between tokens while long prompts arrive, sorted")
    ax.legend(loc="lower right")


LAB = Lab("disaggregated-prefill-decode", "Disaggregated prefill/decode", measure, explain, plot)
