"""Speculative decoding: tokens per step, acceptance and per-token latency against batch size, with n-gram
prompt lookup on and off, on outputs that quote their prompt and on open continuations; the same engine for
both (only the speculative settings change), greedy, and the outputs compared token by token."""

from __future__ import annotations

import random

from inferd.bench.datasets import WORDS, QuoteDataset
from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.sampling import SamplingParams

# the glossary has no entry of its own for it: it is the lever on the Decode entry's bound
DEFINITION = (
    "the lever on the Decode entry's bound, \"each step reads the whole model plus KV cache from GPU memory to "
    'produce one token": guess the next few tokens cheaply, check them all in one step, and keep those the '
    "model itself would have chosen."
)
WORKLOADS = ("quote", "open")
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}


def _prompts(ctx: LabContext, workload: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of about `length` tokens: a passage of random words to copy, or random tokens to go on."""
    rng = random.Random(seed)
    if workload == "open":
        return random_prompts(rng, ctx.facts().vocab, count, length)
    tok = ctx.llm().engine.tokenizer
    out = []
    for _ in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(length))
        ids = tok.encode(QuoteDataset.INSTRUCTION.format(passage=words))
        out.append(ids)
    return out


def _run(ctx: LabContext, prompts: list[list[int]], out_len: int, spec: bool) -> dict:
    """Serve the prompts at once, greedy; vLLM's metrics plus the drafts proposed and accepted."""
    settings = SPEC | {"speculative_draft_policy": "all"} if spec else {}  # every draft, at every batch size
    llm = ctx.llm(**settings)
    before = llm.engine.stats()
    run = serve(llm, [Job(p, out_len) for p in prompts])
    after = llm.engine.stats()
    m = run.metrics()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "tok_s": m["output_throughput"],
        "tpot_ms": m["mean_tpot_ms"],
        "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
        "accept_pct": 100 * accepted / proposed if proposed else 0.0,
    }


def _mismatches(ctx: LabContext, prompts: list[list[int]], out_len: int, **settings) -> int:
    """Requests whose greedy tokens differ with speculation on and off, each request alone both ways (a batch's
    size changes low-precision rounding by itself)."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    runs = []
    for spec in ({}, SPEC):
        llm = ctx.llm(**settings, **spec)
        runs.append([llm.generate([p], params)[0].outputs[0].token_ids for p in prompts])
    return sum(a != b for a, b in zip(*runs, strict=True))


def measure(ctx: LabContext) -> Measurement:
    batches = ctx.size([1, 2, 4], [1, 2, 4, 8, 16])
    length, out_len = ctx.size((40, 24), (160, 96))
    series: dict[str, list] = {"batch": batches}
    numbers: dict[str, float] = {"b_max": batches[-1], "out_len": out_len}
    for w, workload in enumerate(WORKLOADS):
        for b in batches:
            prompts = _prompts(ctx, workload, b, length, seed=1000 * w + b)
            off, on = _run(ctx, prompts, out_len, False), _run(ctx, prompts, out_len, True)
            for key in ("tok_s", "tpot_ms"):
                series.setdefault(f"{workload}_{key}_off", []).append(off[key])
                series.setdefault(f"{workload}_{key}_spec", []).append(on[key])
            series.setdefault(f"{workload}_tokens_per_step", []).append(on["tokens_per_step"])
            series.setdefault(f"{workload}_accept_pct", []).append(on["accept_pct"])
            tag = "b1" if b == batches[0] else "bmax" if b == batches[-1] else f"b{b}"
            numbers |= {
                f"{workload}_tps_off_{tag}": off["tok_s"],
                f"{workload}_tps_spec_{tag}": on["tok_s"],
                f"{workload}_tpot_off_{tag}": off["tpot_ms"],
                f"{workload}_tpot_spec_{tag}": on["tpot_ms"],
                f"{workload}_speedup_{tag}": on["tok_s"] / off["tok_s"],
                f"{workload}_tokens_per_step_{tag}": on["tokens_per_step"],
                f"{workload}_accept_pct_{tag}": on["accept_pct"],
            }
    exact_prompts = _prompts(ctx, "quote", ctx.size(2, 4), length, seed=7) + _prompts(ctx, "open", 2, length, seed=8)
    numbers["checked"] = len(exact_prompts)
    numbers["mismatched_served"] = _mismatches(ctx, exact_prompts, out_len)  # the default mode
    numbers["mismatched"] = _mismatches(ctx, exact_prompts, out_len, dtype="float32", quantization="none")
    settings = {"batches": batches, "prompt_words": length, "output_len": out_len, **SPEC, "greedy": True}
    return Measurement(numbers=numbers, series=series, settings=settings)


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "mismatched <= 0",
            must=True,
            yes="In fp32, {mismatched} of {checked} requests' {out_len} greedy tokens differed with speculation on "
            "and off: a draft is kept only where it equals the model's own choice.",
            no="In fp32, {mismatched} of {checked} requests' greedy tokens differed with speculation on: "
            "verification is broken.",
        ),
        m.decide(
            "mismatched_served <= 0",
            textbook=False,
            yes="In its default mode, too, {mismatched_served} of {checked} differed.",
            no="In its default mode, {mismatched_served} of {checked} differed somewhere: checking k + 1 "
            "positions in one pass rounds differently from one at a time in low precision, which flips near-ties "
            "of the argmax, as changing the batch size does without speculation.",
        ),
        m.decide(
            "quote_speedup_b1 > 1.0",
            yes="At batch 1, on outputs that copy the prompt, speculation ran {quote_speedup_b1}x as fast: a "
            "step that verified drafts gave {quote_tokens_per_step_b1} tokens ({quote_accept_pct_b1}% of drafts "
            "accepted), {quote_tps_spec_b1} tokens/s against {quote_tps_off_b1} without, {quote_tpot_spec_b1} ms "
            "a token against {quote_tpot_off_b1}, because checking 5 positions reads the weights once, as 1 does.",
            no="At batch 1, on outputs that copy the prompt, speculation ran {quote_speedup_b1}x as fast "
            "({quote_tps_spec_b1} tokens/s against {quote_tps_off_b1} without; {quote_tokens_per_step_b1} "
            "tokens per verifying step, {quote_accept_pct_b1}% of drafts accepted): too few drafts held to pay "
            "for checking them.",
        ),
        m.decide(
            "open_speedup_b1 > 1.0",
            textbook=False,
            yes="On open continuations it paid too, {open_speedup_b1}x ({open_tps_spec_b1} against "
            "{open_tps_off_b1} tokens/s, {open_accept_pct_b1}% accepted): this model's greedy text repeats "
            "itself, which lookup finds.",
            no="On open continuations it did not, {open_speedup_b1}x ({open_tps_spec_b1} against "
            "{open_tps_off_b1} tokens/s, {open_accept_pct_b1}% of drafts accepted): text that repeats nothing "
            "gives lookup nothing to find.",
        ),
        m.decide(
            "quote_speedup_bmax < quote_speedup_b1",
            yes="The gain shrinks with the batch: {quote_speedup_b1}x at batch 1, {quote_speedup_bmax}x at batch "
            "{b_max}, where the step is no longer bound by the weights' bytes and every rejected draft costs "
            "compute; by default inferd verifies a draft only while the step's measured cost says it pays.",
            no="The gain did not shrink with the batch: {quote_speedup_b1}x at batch 1, {quote_speedup_bmax}x at "
            "batch {b_max}.",
        ),
    ]
    intro = [
        "Speculative decoding: a proposer guesses the next k tokens (here n-gram prompt lookup: what followed "
        "the last few tokens where they appeared before in the request's own text), the model computes all "
        "k+1 positions in one step, and the longest run of guesses that match its own argmax is kept, plus its "
        "token after them. Greedy output is unchanged; only the number of steps falls.",
    ]
    why = [
        "Why it matters: at small batches a decode step costs the same for one token as for five, so a good "
        "proposer divides single-stream latency by the tokens each step keeps. At large batches the step is "
        "bound by compute and rejected drafts are paid for, so engines turn speculation off there."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    s = m.series
    for i, workload in enumerate(WORKLOADS):
        a.plot(s["batch"], s[f"{workload}_tok_s_off"], "o--", color=f"C{i}", label=f"{workload}, off")
        a.plot(s["batch"], s[f"{workload}_tok_s_spec"], "o-", color=f"C{i}", label=f"{workload}, ngram")
        b.plot(s["batch"], s[f"{workload}_tokens_per_step"], "s-", color=f"C{i}", label=workload)
    a.set(xlabel="batch size", ylabel="output tokens/s", title="Throughput", xscale="log")
    a.legend()
    b.set(xlabel="batch size", ylabel="tokens per verifying step", title="Tokens a step keeps", xscale="log")
    b.legend()


LAB = Lab("speculative-decoding", "Speculative decoding", DEFINITION, measure, explain, plot)
