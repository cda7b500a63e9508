"""Speculative decoding: n-gram prompt lookup on and off against batch size, on outputs that quote their prompt
and on open continuations, greedy, in one engine; and the outputs compared token by token."""

from __future__ import annotations

import random

from inferd.bench.datasets import WORDS, QuoteDataset
from inferd.bench.drive import Job, random_prompts, serve
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext
from inferd.sampling import SamplingParams

DEFINITION = (
    "the lever on the Decode entry's bound, \"each step reads the whole model plus KV cache from GPU memory to "
    'produce one token": guess the next few tokens cheaply, check them all in one step, and keep those the '
    "model itself would have chosen."
)
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}


def _prompts(ctx: LabContext, workload: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of about `length` tokens: a passage of random words to copy, or random tokens to go on."""
    rng = random.Random(seed)
    if workload == "open":
        return random_prompts(rng, ctx.facts.vocab, count, length)
    passages = [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(count)]
    return [ctx.llm().engine.tokenizer.encode(QuoteDataset.INSTRUCTION.format(passage=p)) for p in passages]


def _run(ctx: LabContext, prompts: list[list[int]], out_len: int, spec: bool) -> tuple[float, float, float]:
    """The prompts served at once, greedy: (output tokens/s, tokens per verifying step, % of drafts accepted)."""
    llm = ctx.llm(**(SPEC | {"speculative_draft_policy": "all"} if spec else {}))  # every draft, at any batch
    run = serve(llm, [Job(p, out_len) for p in prompts])
    per_step, accepted = (run.spec_decode[f"spec_decode_{k}"] for k in ("mean_acceptance_length", "acceptance_rate"))
    return run.metrics()["output_throughput"], per_step or 1.0, 100 * (accepted or 0.0)


def _mismatches(ctx: LabContext, prompts: list[list[int]], out_len: int, **settings) -> int:
    """Requests whose greedy tokens differ with speculation on and off, each request alone both ways (a batch's
    size changes low-precision rounding by itself)."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    greedy = lambda spec: [ctx.llm(**settings, **spec).generate([p], params)[0].outputs[0].token_ids for p in prompts]
    return sum(a != b for a, b in zip(greedy(SPEC), greedy({}), strict=True))


def measure(ctx: LabContext) -> Measurement:
    batches, (length, out_len) = ctx.size([1, 2, 4], [1, 2, 4, 8, 16]), ctx.size((40, 24), (160, 96))
    m = Measurement(series={"batch": batches}, settings={"prompt_words": length, **SPEC, "greedy": True})
    for w, workload in enumerate(("quote", "open")):
        for b in batches:
            prompts = _prompts(ctx, workload, b, length, seed=1000 * w + b)
            off, (on, per_step, accept) = _run(ctx, prompts, out_len, False)[0], _run(ctx, prompts, out_len, True)
            for key, value in dict(off=off, spec=on, speedup=on / off, per_step=per_step, accept=accept).items():
                m.series.setdefault(f"{workload}_{key}", []).append(value)
        m.ends(*(f"{workload}_{k}" for k in ("off", "spec", "speedup", "per_step", "accept")))
    exact = _prompts(ctx, "quote", ctx.size(2, 4), length, seed=7) + _prompts(ctx, "open", 2, length, seed=8)
    m.numbers |= dict(batch_hi=batches[-1], out_len=out_len, checked=len(exact))
    m.numbers["mismatched"] = _mismatches(ctx, exact, out_len, dtype="float32", quantization="none")
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "mismatched <= 0",
            yes="In fp32, {mismatched} of {checked} requests' {out_len} greedy tokens differed with speculation on and "
            "off: a draft is kept only where it equals the model's own choice.",
            no="In fp32 speculation changed {mismatched} of {checked} requests' greedy tokens: verification is broken.",
        ),
        m.decide(
            "quote_speedup_lo > 1.0",
            yes="At batch 1, on outputs that copy the prompt, speculation ran {quote_speedup_lo}x as fast "
            "({quote_spec_lo} against {quote_off_lo} tokens/s): a verifying step kept {quote_per_step_lo} tokens "
            "({quote_accept_lo}% of drafts accepted) for one read of the weights.",
            no="At batch 1, on outputs that copy the prompt, speculation ran {quote_speedup_lo}x as fast "
            "({quote_spec_lo} against {quote_off_lo} tokens/s, {quote_accept_lo}% of drafts accepted): too few "
            "drafts held to pay for checking them.",
        ),
        m.either(
            "open_speedup_lo > 1.0",
            yes="On open continuations it paid too, {open_speedup_lo}x ({open_accept_lo}% accepted): this model's "
            "greedy text repeats itself, which lookup finds.",
            no="On open continuations it did not, {open_speedup_lo}x ({open_accept_lo}% accepted): text that repeats "
            "nothing gives lookup nothing to find.",
        ),
        m.decide(
            "quote_speedup_hi < quote_speedup_lo",
            yes="The gain shrinks with the batch, {quote_speedup_lo}x to {quote_speedup_hi}x at batch {batch_hi}: "
            "rejected drafts cost compute, so by default inferd verifies drafts only while their measured cost pays.",
            no="The gain did not shrink with the batch: {quote_speedup_lo}x, then {quote_speedup_hi}x at {batch_hi}.",
        ),
    ]
    intro = "A proposer guesses the next k tokens (here n-gram prompt lookup: what followed the last few tokens "
    intro += "earlier in the request), the model checks all k+1 in one step and keeps those its argmax agrees with."
    why = "Why it matters: at small batches a step costs the same for five tokens as for one."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ys = {w: m.series[f"{w}_speedup"] for w in ("quote", "open")}
    axes = dict(xlabel="batch size", ylabel="speed-up (tokens/s on / off)", xscale="log")
    lines(fig, m.series["batch"], ys, hline=("no speed-up", 1.0), title="n-gram speculation: speed-up by batch", **axes)


LAB = Lab("speculative-decoding", "Speculative decoding", measure, explain, plot, definition=DEFINITION)
