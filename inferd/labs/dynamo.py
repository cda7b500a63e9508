"""NVIDIA Dynamo: a prefill instance, two decode workers each behind an `inferd disagg proxy` (llm-d's sidecar
pattern), and `inferd gateway` choosing the worker round-robin or by prefix (as Dynamo's KV router), on a
shared-prefix workload of which each worker's cache holds about half."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from inferd.bench.client import ttfts
from inferd.labs.base import Explanation, Lab, Measurement, bars
from inferd.labs.context import LabContext
from inferd.labs.sglang import workload
from inferd.procs import Proc, Scrape, leases_released

PICKERS = {"rr": "round_robin", "pa": "scored"}  # the numbers' prefix -> the gateway's picker


def routed(name: str, gateway: Proc, decodes: list[Proc], prompts: list[list[int]]) -> dict[str, float]:
    """One gateway's run of the shared-prefix workload, read from the decode workers' own counters."""
    with Scrape([d.url for d in decodes]) as scraped:
        ttfts(gateway.url, prompts, 2)  # (how prefix-aware routing cuts TTFT is the SGLang lab's)
    rise, served = lambda key: scraped.rise(f"inferd:{key}_total"), scraped.rises("inferd:request_success_total")
    n = dict(busiest_pct=100 * max(served) / max(sum(served), 1), requests=len(prompts))
    n |= dict(hit_pct=100 * rise("prefix_cache_hits") / max(rise("prefix_cache_queries"), 1.0))
    n |= dict(kb_per_req=rise("kv_transfer_bytes") / 1e3 / len(prompts), remote=rise("remote_prefills"))
    return {f"{name}_{k}": v for k, v in n.items()} | {f"{name}_local": rise("local_prefills")}


def measure(ctx: LabContext) -> Measurement:
    w, vocab, procs = workload(ctx), ctx.facts.vocab, ctx.procs
    blocks, max_len = w.blocks_holding(0.6), str(w.max_len)  # about half the prefixes per decode worker
    with procs.scoped():
        prefill, kv = procs.prefill("--max-model-len", max_len)
        decodes = [procs.decode([kv], "--max-model-len", max_len, "--num-blocks", str(blocks)) for _ in "ab"]
        proxies = [procs.proxy([prefill], [d]) for d in decodes]
        procs.wait(prefill, *decodes, *proxies)
        with ThreadPoolExecutor(2) as pool:  # both gateways start at once
            gateways = list(pool.map(lambda p: procs.gateway(proxies, routing={"picker": p}), PICKERS.values()))
        for proxy, prompt in zip(proxies, replace(w, prefixes=2, users=1).prompts(9, vocab), strict=True):
            ttfts(proxy.url, [prompt], 1)  # the first request of a path pays extra
        n = {"prefixes": w.prefixes, "users": w.users, "prefix_len": w.prefix_len}
        for seed, (name, gateway) in enumerate(zip(PICKERS, gateways, strict=True), 1):
            n |= routed(name, gateway, decodes, w.prompts(seed, vocab))
        n["leases_left"] = leases_released(prefill.url)
    n["requests"] = n["rr_requests"] + n["pa_requests"]
    n["accounted"] = n["rr_remote"] + n["rr_local"] + n["pa_remote"] + n["pa_local"]
    return Measurement(numbers=n, settings={"question_len": w.question_len, "decode_blocks": blocks})


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "pa_kb_per_req < rr_kb_per_req",
            yes="With {prefixes} shared {prefix_len}-token prefixes, {users} questions each, prefix-aware routing "
            "found {pa_hit_pct}% of prompt tokens in the workers' caches, pulling {pa_kb_per_req} kB per request, "
            "round-robin {rr_hit_pct}% and {rr_kb_per_req} kB: each prefix went back to the worker holding it.",
            no="With {prefixes} shared prefixes, prefix-aware routing pulled {pa_kb_per_req} kB of KV per request "
            "({pa_hit_pct}% cached), round-robin {rr_kb_per_req} kB ({rr_hit_pct}%): no saving here.",
        ),
        m.either(
            "pa_busiest_pct > rr_busiest_pct",
            yes="Affinity costs balance: the busier worker had {pa_busiest_pct}% of the requests prefix-aware, "
            "{rr_busiest_pct}% round-robin; Dynamo's router and inferd's gateway weigh prefix against load.",
            no="Prefix-aware routing kept the load as even as round-robin (busier worker {pa_busiest_pct}%, "
            "against {rr_busiest_pct}%).",
        ),
        m.must(
            "leases_left <= 0.0",
            yes="After {requests} requests the prefill instance held no lease ({leases_left} active): all were freed.",
            no="{leases_left} leases still held prefill blocks after the run.",
        ),
        m.must(
            "accounted >= requests",
            yes="The decode workers counted {accounted} prefills, remote or local, for the {requests} requests.",
            no="The decode workers counted {accounted} prefills for {requests} requests.",
        ),
    ]
    intro = "Dynamo pairs disaggregation (prefill workers hand the KV cache to decode workers) with a KV-aware "
    intro += "router; here both are inferd's parts: `--role` instances, `inferd disagg proxy` and `inferd gateway`."
    why = "Why it matters: at scale the KV transfer is interconnect traffic and time in every request; routing "
    why += "that knows where the KV already is cuts both."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    kb = {"round-robin": m.numbers["rr_kb_per_req"], "prefix-aware": m.numbers["pa_kb_per_req"]}
    bars(fig, kb, ylabel="KV pulled per request (kB)", title="Routing over two decode workers")


LAB = Lab("nvidia-dynamo", "NVIDIA Dynamo", measure, explain, plot)
