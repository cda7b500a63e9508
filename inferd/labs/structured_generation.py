"""Structured generation: output held to a JSON schema by masking, token by token, what the grammar forbids.
Real schemas (`inferd.bench.schemas`) are compiled cold and again from the cache; a mask is filled and applied
per row; then the same extraction prompts run free and constrained in one engine, and every output is checked
against its schema, with the decode steps of both runs timed at the same batch size."""

from __future__ import annotations

import json
import statistics
import time
import uuid

import torch

from inferd.bench.schemas import extraction_prompt, is_valid, small_schemas
from inferd.engine.events import StepEvents
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.sampling import SamplingParams
from inferd.structured.grammar import apply_bitmask, fill_bitmasks
from inferd.structured.spec import Constraint

# the glossary has no entry of its own for it: its SGLang entry names it
DEFINITION = (
    'named in its SGLang entry, "engine with RadixAttention (prefix-cache reuse), strong for structured '
    'generation and high-concurrency workloads."'
)


def _schemas(count: int, max_chars: int) -> list[dict]:
    """`count` corpus schemas up to `max_chars`, spread over the corpus, of those the mask enforces whole."""
    small = small_schemas(max_chars)
    step = max(1, len(small) // count)
    return small[::step][:count]


def _timed_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _decode_steps(events: StepEvents) -> dict[int, list[float]]:
    """Durations (ms) of the steps in which every row decoded one token, by the number of rows."""
    by_rows: dict[int, list[float]] = {}
    for e in events.ring.drain():
        if e["type"] == "step" and e["reqs"] and all(r[2] == "d" for r in e["reqs"]):
            by_rows.setdefault(len(e["reqs"]), []).append(e["dur_ms"])
    return by_rows


def _generate(llm, prompts, params) -> tuple[list, dict[int, list[float]], float]:
    events = llm.engine.events = StepEvents(kv_interval=3600.0)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.events = None
    return outs, _decode_steps(events), time.perf_counter() - t0


def measure(ctx: LabContext) -> Measurement:
    llm = ctx.llm()
    grammars, vocab = llm.engine.grammars, llm.engine.vocab_size
    count, max_chars, max_tokens = ctx.size((4, 300, 64), (8, 1000, 160))
    schemas = _schemas(count, max_chars)
    grammars.compile(Constraint("regex", "[a-z]+"))  # the tokenizer's tables are built once, at start-up
    # compile: a schema never seen (a fresh title) against the same one again, from the cache
    cold, cached = [], []
    for schema in schemas:
        c = Constraint.json({**schema, "title": uuid.uuid4().hex})
        cold.append(_timed_ms(lambda c=c: grammars.compile(c), 1))
        cached.append(_timed_ms(lambda c=c: grammars.compile(c), 3))
    # one mask: fill a row's allowed tokens (the vocabulary's bits); then a greedy pick under it two ways: full
    # logits masked in memory and their argmax (what a sampled row needs), or the tiled LM head's fused argmax
    # over the allowed tokens only (what a greedy row gets), against the free argmax
    rows, model = 8, llm.engine.model
    matchers = [grammars.matcher(Constraint.json(schemas[0]))] * rows
    fill_ms = _timed_ms(lambda: fill_bitmasks(matchers, vocab), 20)
    mask = fill_bitmasks(matchers, vocab)
    hidden = torch.randn(rows, model.config.hidden_size, dtype=next(model.parameters()).dtype)

    def masked_in_memory():
        logits = model.compute_logits(hidden).float()
        apply_bitmask(logits, mask, list(range(rows)))
        return logits.argmax(dim=-1)

    with torch.inference_mode():
        pick_free_ms = _timed_ms(lambda: model.greedy_tokens(hidden), 10)
        pick_fused_ms = _timed_ms(lambda: model.greedy_tokens(hidden, mask), 10)
        pick_full_ms = _timed_ms(masked_in_memory, 10)
    # the same prompts free and constrained; outputs checked against their schemas
    prompts = [extraction_prompt(json.dumps(s)) for s in schemas]
    free_params = SamplingParams(temperature=0, max_tokens=max_tokens)
    held = [SamplingParams(temperature=0, max_tokens=max_tokens, structured=Constraint.json(s)) for s in schemas]
    free, free_steps, free_s = _generate(llm, prompts, free_params)
    constrained, held_steps, held_s = _generate(llm, prompts, held)

    def valid(outs) -> list[bool]:
        return [is_valid(s, o.outputs[0].text)[0] for s, o in zip(schemas, outs, strict=True)]

    finished = [v for v, o in zip(valid(constrained), constrained, strict=True) if o.outputs[0].finish_reason == "stop"]
    # decode steps at the largest batch size both runs had at least 3 of
    shared = [k for k in held_steps if len(held_steps[k]) >= 3 and len(free_steps.get(k, [])) >= 3]
    k = max(shared, default=0)
    step_free = statistics.median(free_steps[k]) if k else float("nan")
    step_held = statistics.median(held_steps[k]) if k else float("nan")
    tokens = lambda outs: sum(len(o.outputs[0].token_ids) for o in outs)  # noqa: E731
    numbers = dict(
        schemas=len(schemas), compile_cold_ms=statistics.median(cold), compile_cached_ms=statistics.median(cached),
        vocab=vocab, mask_rows=rows, fill_us_per_row=1000 * fill_ms / rows, pick_free_ms=pick_free_ms,
        pick_fused_ms=pick_fused_ms, pick_full_ms=pick_full_ms,
        valid_free_pct=100 * statistics.mean(valid(free)), valid_held_pct=100 * statistics.mean(valid(constrained)),
        finished_held=len(finished), valid_of_finished_pct=100 * statistics.mean(finished) if finished else 100.0,
        step_rows=k, step_free_ms=step_free, step_held_ms=step_held,
        step_overhead_pct=100 * (step_held / step_free - 1) if k else float("nan"),
        tokens_free=tokens(free), tokens_held=tokens(constrained), free_s=free_s, held_s=held_s,
    )  # fmt: skip
    settings = {"schemas": len(schemas), "max_schema_chars": max_chars, "max_tokens": max_tokens, "greedy": True}
    series = {"compile_cold_ms": cold, "compile_cached_ms": cached}
    return Measurement(numbers=numbers, series=series, settings=settings)


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "valid_of_finished_pct >= 100",
            must=True,
            yes="Under the constraint {valid_of_finished_pct}% of the outputs that finished ({finished_held} of "
            "{schemas}) are JSON their schema accepts; without it {valid_free_pct}% of the same prompts' outputs "
            "were (under the constraint {valid_held_pct}%, counting those cut off by max_tokens).",
            no="Under the constraint only {valid_of_finished_pct}% of the outputs that finished are valid JSON for "
            "their schema: the mask failed to hold them.",
        ),
        m.decide(
            "compile_cached_ms < compile_cold_ms",
            yes="Compiling a schema against the {vocab}-token vocabulary took {compile_cold_ms} ms the first time "
            "and {compile_cached_ms} ms from the cache: engines compile each grammar once and key it by its text.",
            no="Compiling took {compile_cold_ms} ms the first time and {compile_cached_ms} ms from the cache.",
        ),
        m.decide(
            "pick_fused_ms < pick_full_ms",
            yes="Picking {mask_rows} greedy rows' tokens under their masks took {pick_fused_ms} ms in the LM head's "
            "fused argmax, which compares only the allowed tokens (free: {pick_free_ms} ms), against "
            "{pick_full_ms} ms for full rows of {vocab} logits masked in memory and then compared.",
            no="Picking {mask_rows} greedy rows' tokens under their masks took {pick_fused_ms} ms in the fused "
            "argmax and {pick_full_ms} ms through full logits masked in memory (free: {pick_free_ms} ms).",
        ),
        m.decide(
            "step_overhead_pct < 10",
            yes="At {step_rows} rows a decode step took {step_held_ms} ms constrained and {step_free_ms} ms free "
            "({step_overhead_pct}% more): the masks are filled on a helper thread while the model runs, "
            "{fill_us_per_row} us a row.",
            no="At {step_rows} rows a decode step took {step_held_ms} ms constrained against {step_free_ms} ms "
            "free ({step_overhead_pct}% more); filling a row's mask takes {fill_us_per_row} us.",
        ),
    ]
    intro = [
        "A grammar compiled against the tokenizer's vocabulary says, at each point of the output, which tokens "
        "may come next; every other token's logit counts as minus infinity, so even a model that "
        "would never write valid JSON on its own writes nothing else. Tool calling rests on it: a forced or "
        "required call is a JSON schema over the tools' arguments.",
    ]
    why = [
        "Why it matters: agents and extraction pipelines parse what the model writes. Without a constraint "
        "a share of outputs fails to parse and is retried (tokens paid twice); with one, validity is a property "
        "of the server, at the cost of a compile per new schema (hence the cache) and a mask per row per step "
        "(hence computing it beside the forward pass, off the critical path)."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b, c = fig.subplots(1, 3)
    n = m.numbers
    a.bar(["first", "cached"], [n["compile_cold_ms"], n["compile_cached_ms"]])
    a.set(ylabel="ms", title="Compile a schema")
    b.bar(["free", "constrained"], [n["step_free_ms"], n["step_held_ms"]], color="C1")
    b.set(ylabel="ms", title=f"Decode step, {int(n['step_rows'])} rows")
    c.bar(["free", "constrained"], [n["valid_free_pct"], n["valid_held_pct"]], color="C2")
    c.set(ylabel="% outputs valid", title="Valid JSON for its schema", ylim=(0, 100))


LAB = Lab("structured-generation", "Structured generation", DEFINITION, measure, explain, plot)
