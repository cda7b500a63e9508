"""KV cache: bytes per token, growth with length x batch and the concurrency a budget fits, by the engine's
own tensors and block allocator."""

from __future__ import annotations

from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext


def measure(ctx: LabContext) -> Measurement:
    engine, facts, L, fit_len = ctx.llm().engine, ctx.facts, ctx.size(128, 512), ctx.max_model_len
    blocks, bs = engine.kv.num_blocks, engine.kv.block_size
    cache = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)

    def mib(length: int, batch: int) -> float:  # of blocks, for `batch` requests of `length` tokens
        fitted, used = engine.kv.fit([length] * batch)
        return used * cache / blocks / 2**20 if fitted == batch else float("nan")

    n = dict(layers=facts.num_layers, kv_heads=facts.num_kv_heads, head_dim=facts.head_dim, elem_bytes=facts.elem_bytes)
    n |= dict(formula_bytes_per_token=facts.kv_bytes_per_token, allocator_bytes_per_token=cache / blocks / bs)
    n |= dict(L=L, mib_L=mib(L, 2), mib_2L=mib(2 * L, 2), mib_2B=mib(L, 4), cache_mib=cache / 2**20, fit_len=fit_len)
    n |= dict(fit=engine.kv.fit([fit_len] * (blocks + 1))[0], fit_predicted=blocks * bs // (-(-fit_len // bs) * bs))
    n |= dict(serving_kv_mib=32 * fit_len * facts.kv_bytes_per_token / 2**20, weights_mib=facts.weight_bytes / 2**20)
    n["mismatch"] = abs(n["allocator_bytes_per_token"] - n["formula_bytes_per_token"])
    n["growth"] = max(n["mib_2L"], n["mib_2B"]) / n["mib_L"]
    lengths = {f"{x} tokens": [mib(x, b) for b in (1, 2, 4, 8)] for x in ctx.size([128, 512], [512, 2048])}
    return Measurement(n, {"batch": [1, 2, 4, 8]} | lengths, {"block_size": bs, "num_blocks": blocks})


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "mismatch <= 0",
            yes="The engine's cache holds {allocator_bytes_per_token} bytes per token, the formula's 2 (K and V) x "
            "{layers} layers x {kv_heads} KV heads x {head_dim} dims x {elem_bytes} bytes (off by {mismatch}).",
            no="The cache holds {allocator_bytes_per_token} bytes per token, {mismatch} off the formula's.",
        ),
        m.must(
            "growth <= 2",
            yes="2 requests of {L} tokens took {mib_L} MiB of blocks, twice the length {mib_2L} MiB, twice the batch "
            "{mib_2B} MiB: at most {growth} times as much, linear in both.",
            no="Twice the length or the batch took {growth} times the {mib_L} MiB of 2 requests of {L} tokens.",
        ),
        m.must(
            "fit >= fit_predicted",
            yes="The {cache_mib} MiB cache fits {fit} requests of {fit_len} tokens at once, as bytes per token "
            "predict ({fit_predicted}): the cache, not compute, caps concurrency.",
            no="The allocator fitted {fit} requests of {fit_len} tokens, fewer than the {fit_predicted} predicted.",
        ),
        m.decide(
            "serving_kv_mib > weights_mib",
            yes="32 requests at {fit_len} tokens need {serving_kv_mib} MiB of KV cache, more than the model's "
            "{weights_mib} MiB of weights: the cache is the dominant consumer of memory.",
            no="32 requests at {fit_len} tokens need {serving_kv_mib} MiB of KV cache, under the model's "
            "{weights_mib} MiB of weights (few KV heads keep it small).",
        ),
    ]
    intro = f"This lab read the engine's cache tensors ({m.settings['num_blocks']} blocks of "
    intro += f"{m.settings['block_size']} tokens) and allocated requests with its own block allocator."
    why = "Why it matters: concurrency = cache memory / (bytes per token x tokens per request)."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ys = {k: v for k, v in m.series.items() if k != "batch"}
    lines(fig, m.series["batch"], ys, xlabel="batch size (requests)", ylabel="KV cache (MiB)", title="KV cache growth")


LAB = Lab("kv-cache", "KV cache", measure, explain, plot, timed=False)
