"""Cost per million tokens from this machine's goodput and a price per hour, at the knee and at low load."""

from __future__ import annotations

from inferd.bench.cost import cost_per_million
from inferd.labs.base import Explanation, Lab, Measurement, bars
from inferd.labs.context import LabContext

DEFAULT_PRICE = 1.0  # $/hour, used (and said) when no --price-per-hour is given
CASES = {"goodput": "goodput at the knee", "throughput": "raw throughput", "batch1": "batch 1", "low": "low load"}


def measure(ctx: LabContext) -> Measurement:
    good, price = ctx.measured("goodput"), ctx.price_per_hour or DEFAULT_PRICE
    g = good.numbers
    n = {"price_per_hour": price, "low_load": g["load_lo"], "goodput_tok_s": g["goodput_best"]}
    n |= {"throughput_tok_s": g["tok_s_best"], "low_tok_s": g["goodput_lo"]}
    n["batch1_tok_s"] = ctx.measured("decode").series["tok_s"][0]
    n |= {f"cost_{k}": cost_per_million(price, 1, n[f"{k}_tok_s"]) or float("inf") for k in CASES}
    return Measurement(n, settings={"price_given": ctx.price_per_hour is not None, "slo_ms": good.settings["slo_ms"]})


def explain(m: Measurement) -> Explanation:
    batch1 = "One request at a time ({batch1_tok_s} tokens/s) it costs ${cost_batch1}, batched ${cost_goodput}."
    claims = [
        m.must(
            "cost_goodput >= cost_throughput",
            yes="At ${price_per_hour} an hour the best goodput ({goodput_tok_s} tokens/s within the SLOs) costs "
            "${cost_goodput} per million output tokens; raw throughput would say ${cost_throughput}.",
            no="Goodput cost ${cost_goodput} per million tokens, below raw throughput's ${cost_throughput}.",
        ),
        m.decide("cost_batch1 > cost_goodput", yes=batch1, no=batch1),  # the same sentence either way
        m.decide(
            "cost_low > cost_goodput",
            yes="At low utilisation ({low_load} times capacity) the machine idles between requests: ${cost_low}, not "
            "${cost_goodput}.",
            no="At low utilisation ({low_load} times capacity) it costs ${cost_low}, no more than ${cost_goodput}.",
        ),
    ]
    given = "the price you gave" if m.settings["price_given"] else "an example price; pass --price-per-hour for yours"
    intro = "cost = price per hour / (tokens per second x 3600) x 1,000,000, with tokens per second from the goodput "
    intro += f"and decode labs and ${m.numbers['price_per_hour']:g} an hour ({given})."
    why = "Why it matters: batching and utilisation divide the price by more tokens; goodput is the honest divisor."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    costs = {label: m.numbers[f"cost_{k}"] for k, label in CASES.items()}
    title = f"At ${m.numbers['price_per_hour']:g}/hour"
    bars(fig, costs, ylabel="$ per million output tokens", title=title, yscale="log")


LAB = Lab("cost", "Cost per million tokens", measure, explain, plot)
