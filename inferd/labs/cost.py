"""Cost per million tokens, from this machine's measured goodput and a price per hour: at the knee of the
goodput lab, at raw throughput, without batching, and at low utilisation."""

from __future__ import annotations

from inferd.bench.cost import cost_per_million
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext

DEFINITION = (
    "the unit economic that ties latency, batching, utilization, and GPU price together. The number to optimize "
    "and to report in the capstone write-up."
)
DEFAULT_PRICE = 1.0  # $/hour, used (and said) when no --price-per-hour is given


def _measurement(ctx: LabContext, name: str):
    from inferd.labs import find_lab

    if name not in ctx.measurements:
        ctx.measurements[name] = find_lab(name).measure(ctx)
    return ctx.measurements[name]


def measure(ctx: LabContext) -> Measurement:
    good = _measurement(ctx, "goodput")
    dec = _measurement(ctx, "decode")
    price = ctx.price_per_hour or DEFAULT_PRICE
    g, s = good.numbers, good.series
    batch1 = dec.series["tok_s"][0]
    low_goodput = s["goodput"][0]
    m = Measurement(settings={"price_given": ctx.price_per_hour is not None, "slo_ms": good.settings["slo_ms"]})
    m.numbers.update(
        price_per_hour=price,
        goodput_tok_s=g["best_goodput"],
        throughput_tok_s=g["tok_s_at_best"],
        batch1_tok_s=batch1,
        low_load=s["load"][0],
        low_goodput_tok_s=low_goodput,
        cost_goodput=cost_per_million(price, 1, g["best_goodput"]) or float("inf"),
        cost_throughput=cost_per_million(price, 1, g["tok_s_at_best"]) or float("inf"),
        cost_batch1=cost_per_million(price, 1, batch1) or float("inf"),
        cost_low_load=cost_per_million(price, 1, low_goodput) or float("inf"),
    )
    m.series = {
        "labels": ["goodput at the knee", "raw throughput", "batch 1", "low load"],
        "cost": [m.numbers[k] for k in ("cost_goodput", "cost_throughput", "cost_batch1", "cost_low_load")],
    }
    return m


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "cost_goodput >= cost_throughput",
            must=True,
            yes="At ${price_per_hour} an hour, the best goodput ({goodput_tok_s} output tokens/s that met the SLOs) "
            "costs ${cost_goodput} per million output tokens; counted from raw throughput ({throughput_tok_s} "
            "tokens/s) it would look like ${cost_throughput}, but those extra tokens missed their SLOs.",
            no="Goodput cost ${cost_goodput} per million tokens, below raw throughput's ${cost_throughput}.",
        ),
        m.decide(
            "cost_batch1 > cost_goodput",
            yes="Without batching (one request at a time, {batch1_tok_s} tokens/s) the same hour buys fewer "
            "tokens: ${cost_batch1} per million, against ${cost_goodput} batched.",
            no="One request at a time ({batch1_tok_s} tokens/s) cost ${cost_batch1} per million, no more than the "
            "batched ${cost_goodput}.",
        ),
        m.decide(
            "cost_low_load > cost_goodput",
            yes="At low utilisation ({low_load} times capacity offered, {low_goodput_tok_s} tokens/s served) the "
            "machine idles between requests and a million tokens costs ${cost_low_load}, against ${cost_goodput} at "
            "the knee.",
            no="At low load ({low_load} times capacity) a million tokens cost ${cost_low_load}, no more than at "
            "the knee.",
        ),
    ]
    price_note = (
        "the price you gave" if m.settings["price_given"] else "an example price; pass --price-per-hour for yours"
    )
    intro = [
        f"cost = price per hour / (tokens per second x 3600) x 1,000,000, with ${n['price_per_hour']:g} an hour "
        f"({price_note}) and the tokens per second measured by the goodput and decode labs on this machine.",
    ]
    why = [
        "Why it matters: it is the number a platform is judged by. Batching and high utilisation divide the "
        "price by more tokens; quantization raises tokens per second per chip; goodput, not peak throughput, "
        "is the honest denominator."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots(1, 1)
    ax.bar(m.series["labels"], m.series["cost"])
    ax.set(ylabel="$ per million output tokens", title=f"At ${m.numbers['price_per_hour']:g}/hour", yscale="log")


LAB = Lab("cost", "Cost per million tokens", DEFINITION, measure, explain, plot)
