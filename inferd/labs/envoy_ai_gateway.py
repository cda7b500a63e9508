"""Envoy AI Gateway: per-tenant token budgets in front of the engines, through `inferd gateway` and a real
replica: a 429 exactly at the budget, reserve at admission vs settle to the real usage, and fairness when one
tenant floods while another keeps within its budget."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.procs import complete

DEFINITION = "token-aware rate limiting, model routing, and multi-tenant traffic shaping in front of the engines."
PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]  # token ids: the gateway counts them exactly, no tokenizer needed
M = 4
COST = len(PROMPT) + M  # tokens one request reserves and, with ignore_eos, uses


def _tenant(name: str, **limits) -> dict:
    key = f"sk-lab-{name}"
    return {"id": name, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()], "limits": limits}


def _post(url: str, tenant: str, **body) -> httpx.Response:
    auth = {"Authorization": f"Bearer sk-lab-{tenant}"}
    return complete(url, PROMPT, body.pop("max_tokens", M), headers=auth, **body)


@dataclass
class Exact:
    """Tenant 'exact': requests until one is refused, then one asking for exactly what remains."""

    limit: int
    cost: int
    admitted: int
    used_at_refusal: int
    remaining_at_refusal: int
    refused_status: int
    exact_fit_ok: float


def exact_budget(url: str) -> Exact:
    limit = 3 * COST + (COST - 1)  # three requests fit, and one token short of a fourth
    statuses, used = [], 0
    for _ in range(4):
        r = _post(url, "exact")
        statuses.append(r.status_code)
        if r.status_code == 200:
            used += r.json()["usage"]["total_tokens"]
        else:
            remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    fit = _post(url, "exact", max_tokens=M - 1)  # asks for exactly what remains
    return Exact(limit, COST, statuses.count(200), used, remaining, statuses[-1], float(fit.status_code == 200))


@dataclass
class Settled:
    """A request that reserves 64 output tokens but stops early on a stop string: what is charged?"""

    out_limit: int
    reserved: int
    reserved_seen: int  # at admission, from the remaining-tokens header
    actual: int
    charged: int
    settle_error: int


def reserve_settle(url: str, replica_url: str) -> Settled:
    limit, reserve = 1000, 64
    greedy = complete(replica_url, PROMPT, 8).json()["choices"][0]["text"]
    r1 = _post(url, "settle", max_tokens=reserve, ignore_eos=True, stop=[greedy] if greedy else None)
    actual = r1.json()["usage"]["completion_tokens"]
    at_admission = int(r1.headers["x-ratelimit-remaining-output-tokens"])
    after = int(_post(url, "settle", max_tokens=1).headers["x-ratelimit-remaining-output-tokens"])
    charged = limit - 1 - after
    return Settled(limit, reserve, limit - at_admission, actual, charged, abs(charged - actual))


@dataclass
class Fairness:
    """Tenant 'heavy' floods while 'light' keeps within the same budget."""

    budget: int
    heavy_sent: int
    heavy_ok: int
    heavy_429: int
    heavy_tokens: int
    light_sent: int
    light_ok: int
    light_ok_pct: float


def fairness(url: str) -> Fairness:
    heavy, light = [], []
    with ThreadPoolExecutor(8) as pool:  # interleaved: light's requests arrive in the middle of heavy's flood
        for i in range(30):
            heavy.append(pool.submit(_post, url, "heavy"))
            if i % 4 == 1 and len(light) < 8:
                light.append(pool.submit(_post, url, "light"))
        light += [pool.submit(_post, url, "light") for _ in range(8 - len(light))]
        heavy_codes = [f.result().status_code for f in heavy]
        light_codes = [f.result().status_code for f in light]
    ok = heavy_codes.count(200)
    light_ok = light_codes.count(200)
    return Fairness(10 * COST, 30, ok, heavy_codes.count(429), ok * COST, 8, light_ok, 100 * light_ok / 8)


def measure(ctx: LabContext) -> Measurement:
    replicas = ctx.any_replicas()
    tenants = [
        _tenant("exact", tokens={"total": 3 * COST + COST - 1}),
        _tenant("settle", tokens={"output": 1000}),
        _tenant("heavy", tokens={"total": 10 * COST}),
        _tenant("light", tokens={"total": 10 * COST}),
    ]
    with ctx.scoped():
        gw = ctx.gateway(replicas[:1], tenants=tenants)
        exact, settled, fair = exact_budget(gw.url), reserve_settle(gw.url, replicas[0].url), fairness(gw.url)
    n = asdict(exact) | asdict(settled) | asdict(fair)
    n["used_plus_cost"] = exact.used_at_refusal + COST
    return Measurement(numbers=n, settings={"prompt_tokens": len(PROMPT), "max_tokens": M})


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "used_plus_cost > limit",
            must=True,
            yes="Tenant 'exact' had {limit} tokens per window and each request costs {cost} (prompt + max_tokens): "
            "{admitted} were served, using {used_at_refusal}; the next was refused with HTTP {refused_status}, "
            "because it needed {cost} and {remaining_at_refusal} remained ({used_plus_cost} would pass the limit).",
            no="The gateway refused a request although {used_plus_cost} tokens were within the {limit} limit.",
        ),
        m.decide(
            "exact_fit_ok >= 1.0",
            must=True,
            yes="A request asking for exactly the {remaining_at_refusal} remaining tokens was then served "
            "({exact_fit_ok} = yes): the limit is exact, not approximate.",
            no="A request for exactly the remaining tokens was refused ({exact_fit_ok} = no).",
        ),
        m.decide(
            "charged < reserved",
            yes="Reserve vs settle: a request asking for up to {reserved} output tokens had {reserved_seen} reserved "
            "at admission, stopped on a stop string after {actual}, and the window was charged {charged}: the "
            "reservation was settled to the real usage and the rest given back.",
            no="Reserve vs settle: the request reserved {reserved} output tokens and was charged {charged} (it "
            "produced {actual}).",
        ),
        m.decide(
            "settle_error <= 0.0",
            must=True,
            yes="The settled charge matched the tokens produced exactly (difference {settle_error}).",
            no="The settled charge was off the tokens produced by {settle_error}.",
        ),
        m.decide(
            "heavy_tokens <= budget",
            must=True,
            yes="Under contention, tenant 'heavy' sent {heavy_sent} requests at once: {heavy_ok} were served "
            "({heavy_tokens} tokens, within its {budget}) and {heavy_429} refused with 429.",
            no="Tenant 'heavy' was served {heavy_tokens} tokens, past its budget of {budget}.",
        ),
        m.decide(
            "light_ok_pct >= 100.0",
            yes="Meanwhile tenant 'light', within its own budget, had {light_ok_pct}% of its {light_sent} requests "
            "served: one tenant's flood did not spend another's share.",
            no="Tenant 'light' had only {light_ok_pct}% of its {light_sent} requests served while 'heavy' flooded.",
        ),
    ]
    intro = [
        "inferd's gateway does the same job in one Python process: it counts each request's prompt tokens "
        "exactly, reserves prompt + max_tokens against the tenant's budget at admission (refusing with 429 and "
        "OpenAI's x-ratelimit-* headers when it does not fit), and settles to the real usage when the response "
        "ends. This lab ran it in front of a real inferd replica.",
    ]
    why = [
        "Why it matters: tokens, not requests, are what cost money on an LLM platform; budgets per tenant in "
        "tokens keep one team's batch job from starving another's chat, and settling to real usage keeps the "
        "budgets honest when answers stop early."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    n = m.numbers
    a.bar(["reserved", "charged", "produced"], [n["reserved_seen"], n["charged"], n["actual"]])
    a.set(ylabel="output tokens", title="Reserve at admission, settle at the end")
    b.bar(["heavy served", "heavy 429", "light served"], [n["heavy_ok"], n["heavy_429"], n["light_ok"]], color="C1")
    b.set(ylabel="requests", title="Two tenants, equal budgets, one floods")


LAB = Lab("envoy-ai-gateway", "Envoy AI Gateway", DEFINITION, measure, explain, plot)
