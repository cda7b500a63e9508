"""Envoy AI Gateway: per-tenant token budgets in `inferd gateway` before a real replica: a 429 exactly at the
budget, reserve at admission then settle to the real usage, and fairness when one tenant floods."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from inferd.labs.base import Explanation, Lab, Measurement, bars
from inferd.labs.context import LabContext
from inferd.procs import complete

PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]  # token ids: the gateway counts them exactly, no tokenizer needed
M = 4
COST = len(PROMPT) + M  # tokens one request reserves and, with ignore_eos, uses
LIMIT, BUDGET = 4 * COST - 1, 10 * COST  # 'exact': 3 requests and a 4th but for one token; 'heavy', 'light' each
OUT_LIMIT, RESERVE = 1000, 64  # tenant 'settle': output tokens per window, and what one request asks for


def _post(url: str, tenant: str, max_tokens: int = M, **body):
    return complete(url, PROMPT, max_tokens, headers={"Authorization": f"Bearer sk-lab-{tenant}"}, **body)


def measure(ctx: LabContext) -> Measurement:
    replica = ctx.procs.any_replicas()[0]
    limits = {t: {"total": b} for t, b in (("exact", LIMIT), ("heavy", BUDGET), ("light", BUDGET))}
    limits["settle"] = {"output": OUT_LIMIT}
    key = lambda tenant: hashlib.sha256(f"sk-lab-{tenant}".encode()).hexdigest()  # what the gateway's config holds
    tenants = [{"id": t, "api_key_sha256": [key(t)], "limits": {"tokens": tokens}} for t, tokens in limits.items()]
    with ctx.procs.scoped():
        url = ctx.procs.gateway([replica], tenants=tenants).url
        # tenant 'exact': four requests (the fourth one token short), then one asking for exactly what remains
        rs = [_post(url, "exact") for _ in range(4)]
        fit = _post(url, "exact", max_tokens=M - 1)
        # tenant 'settle': a request reserving RESERVE output tokens that stops early on a stop string, then a
        # 1-token one, whose remaining-output header shows what the first was charged
        greedy = complete(replica.url, PROMPT, 8).json()["choices"][0]["text"]
        settled = _post(url, "settle", max_tokens=RESERVE, stop=[greedy] if greedy else None)
        after = int(_post(url, "settle", max_tokens=1).headers["x-ratelimit-remaining-output-tokens"])
        # tenant 'heavy' sends 30 requests at once; 'light', with the same budget, 8 among them (every 4th)
        with ThreadPoolExecutor(8) as pool:
            sent = [(t, pool.submit(_post, url, t)) for i in range(30) for t in ["heavy"] + ["light"] * (i % 4 == 1)]
    heavy, light = ([f.result().status_code for t, f in sent if t == who] for who in ("heavy", "light"))
    used = sum(r.json()["usage"]["total_tokens"] for r in rs if r.status_code == 200)
    n = dict(limit=LIMIT, cost=COST, admitted=sum(r.status_code == 200 for r in rs), used_at_refusal=used)
    n |= dict(used_plus_cost=used + COST, refused_status=rs[-1].status_code, exact_fit_ok=float(fit.status_code == 200))
    n["remaining_at_refusal"] = int(rs[-1].headers["x-ratelimit-remaining-tokens"])
    actual, charged = settled.json()["usage"]["completion_tokens"], OUT_LIMIT - 1 - after
    seen = OUT_LIMIT - int(settled.headers["x-ratelimit-remaining-output-tokens"])
    n |= dict(reserved=RESERVE, reserved_seen=seen, actual=actual, charged=charged, settle_error=abs(charged - actual))
    ok, light_ok = heavy.count(200), light.count(200)
    n |= dict(budget=BUDGET, heavy_sent=len(heavy), heavy_ok=ok, heavy_429=heavy.count(429), heavy_tokens=ok * COST)
    n |= dict(light_sent=len(light), light_ok=light_ok, light_ok_pct=100 * light_ok / len(light))
    return Measurement(numbers=n, settings={"prompt_tokens": len(PROMPT), "max_tokens": M})


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "used_plus_cost > limit",
            yes="Tenant 'exact' had {limit} tokens a window at {cost} a request (prompt + max_tokens): {admitted} were "
            "served ({used_at_refusal} tokens); the next, to {used_plus_cost}, got HTTP {refused_status}.",
            no="The gateway refused a request although {used_plus_cost} tokens were within the {limit} limit.",
        ),
        m.must(
            "exact_fit_ok >= 1.0",
            yes="Then a request for exactly the {remaining_at_refusal} tokens left was served ({exact_fit_ok} = yes).",
            no="A request for exactly the remaining tokens was refused ({exact_fit_ok} = no).",
        ),
        m.must(
            "settle_error <= 0.0",
            yes="A request for up to {reserved} output tokens had {reserved_seen} reserved at admission, stopped on "
            "a stop string after {actual} and was charged {charged}: settled to the real usage ({settle_error} off).",
            no="A request that produced {actual} tokens was charged {charged}: {settle_error} off the real usage.",
        ),
        m.must(
            "heavy_tokens <= budget",
            yes="Tenant 'heavy' sent {heavy_sent} requests at once: {heavy_ok} were served ({heavy_tokens} tokens, "
            "within its {budget}) and {heavy_429} refused with 429.",
            no="Tenant 'heavy' was served {heavy_tokens} tokens, past its budget of {budget}.",
        ),
        m.decide(
            "light_ok_pct >= 100.0",
            yes="Meanwhile tenant 'light', within its own budget, had {light_ok_pct}% of its {light_sent} requests "
            "served: one tenant's flood did not spend another's share.",
            no="Tenant 'light' had only {light_ok_pct}% of its {light_sent} requests served while 'heavy' flooded.",
        ),
    ]
    intro = "inferd's gateway does the same job in one Python process, here in front of a real inferd replica, "
    intro += "counting each prompt's tokens exactly and answering with OpenAI's x-ratelimit-* headers."
    why = "Why it matters: tokens, not requests, are what cost money on an LLM platform; per-tenant token budgets "
    why += "keep one team's batch job from starving another's chat, and settling keeps them honest."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    n = m.numbers
    served = {"heavy served": n["heavy_ok"], "heavy 429": n["heavy_429"], "light served": n["light_ok"]}
    bars(fig, served, ylabel="requests", title="Two tenants, equal budgets, one floods")


LAB = Lab("envoy-ai-gateway", "Envoy AI Gateway", measure, explain, plot)
