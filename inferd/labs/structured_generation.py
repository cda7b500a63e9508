"""Structured generation: JSON schemas compiled cold and cached, then one engine's outputs free and constrained,
checked against their schemas, with both runs' decode steps timed at the same batch size."""

from __future__ import annotations

import json
import statistics
import uuid

import torch

from inferd.bench.drive import Job, serve
from inferd.bench.schemas import extraction_prompt, is_valid, small_schemas
from inferd.labs.base import Explanation, Lab, Measurement, bars, glossary
from inferd.labs.context import LabContext
from inferd.measure.hardware import best_time
from inferd.sampling import SamplingParams
from inferd.structured.grammar import apply_bitmask, fill_bitmasks
from inferd.structured.spec import Constraint

DEFINITION = f'named in its SGLang entry, "{glossary("SGLang")}"'


def measure(ctx: LabContext) -> Measurement:
    llm = ctx.llm()
    grammars, vocab = llm.engine.grammars, llm.engine.vocab_size
    count, max_chars, max_tokens = ctx.size((4, 300, 64), (8, 1000, 160))
    schemas = small_schemas(max_chars)[:: max(1, len(small_schemas(max_chars)) // count)][:count]
    grammars.compile(Constraint("regex", "[a-z]+"))  # the tokenizer's tables are built once, at start-up
    cold, cached = [], []  # a schema never seen (a fresh title), then the same one again, from the cache
    for schema in schemas:
        c = Constraint.json({**schema, "title": uuid.uuid4().hex})
        cold.append(1000 * best_time(lambda c=c: grammars.compile(c), runs=1, warmup=0))
        cached.append(1000 * best_time(lambda c=c: grammars.compile(c), runs=3, warmup=0))
    # 8 rows' masks, filled; then a greedy pick under them two ways: full logits masked in memory and their argmax
    # (what a sampled row needs), or the tiled LM head's fused argmax over the allowed tokens only (a greedy row's)
    rows, model, matchers = 8, llm.engine.model, [grammars.matcher(Constraint.json(schemas[0]))] * 8
    n = dict(schemas=len(schemas), vocab=vocab, mask_rows=rows)
    n["fill_us_per_row"] = 1e6 * best_time(lambda: fill_bitmasks(matchers, vocab), runs=20) / rows
    mask = fill_bitmasks(matchers, vocab)
    hidden = torch.randn(rows, model.config.hidden_size, dtype=next(model.parameters()).dtype)

    def masked_in_memory():
        logits = model.compute_logits(hidden).float()
        apply_bitmask(logits, mask, list(range(rows)))
        return logits.argmax(dim=-1)

    with torch.inference_mode():
        n["pick_fused_ms"] = 1000 * best_time(lambda: model.greedy_tokens(hidden, mask), runs=10)
        n["pick_full_ms"] = 1000 * best_time(masked_in_memory, runs=10)
    prompts = [extraction_prompt(json.dumps(s)) for s in schemas]
    job = lambda p, **more: Job(p, max_tokens, params=SamplingParams(temperature=0, max_tokens=max_tokens, **more))
    free = serve(llm, [job(p) for p in prompts])
    held = serve(llm, [job(p, structured=Constraint.json(s)) for p, s in zip(prompts, schemas, strict=True)])
    valid = lambda run: [is_valid(s, o.text)[0] for s, o in zip(schemas, run.served, strict=True)]
    ok_free, ok_held = valid(free), valid(held)
    finished = [ok for ok, o in zip(ok_held, held.served, strict=True) if o.finish_reason == "stop"]
    free_steps, held_steps = free.decode_steps(), held.decode_steps()
    # decode steps (s) at the largest batch size both runs had at least 3 of
    rows_both = max(k for k in held_steps if len(held_steps[k]) >= 3 and len(free_steps.get(k, [])) >= 3)
    n |= dict(compile_cold_ms=statistics.median(cold), compile_cached_ms=statistics.median(cached))
    n |= dict(valid_free_pct=100 * statistics.mean(ok_free), valid_held_pct=100 * statistics.mean(ok_held))
    n |= dict(finished_held=len(finished), valid_of_finished_pct=100 * statistics.mean(finished or [True]))
    n |= dict(step_rows=rows_both, step_free_ms=1000 * statistics.median(free_steps[rows_both]))
    n["step_held_ms"] = 1000 * statistics.median(held_steps[rows_both])
    n["step_overhead_pct"] = 100 * (n["step_held_ms"] / n["step_free_ms"] - 1)
    return Measurement(n, settings={"max_schema_chars": max_chars, "max_tokens": max_tokens, "greedy": True})


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "valid_of_finished_pct >= 100",
            yes="Under the constraint {valid_of_finished_pct}% of the outputs that finished ({finished_held} of "
            "{schemas}) are JSON their schema accepts; free, {valid_free_pct}% of the same prompts' outputs were.",
            no="Under the constraint only {valid_of_finished_pct}% of the finished outputs are valid for their "
            "schema: the mask failed to hold them.",
        ),
        m.decide(
            "compile_cached_ms < compile_cold_ms",
            yes="Compiling a schema against the {vocab}-token vocabulary took {compile_cold_ms} ms the first time and "
            "{compile_cached_ms} ms from the cache, which engines key by the grammar's text.",
            no="Compiling took {compile_cold_ms} ms the first time and {compile_cached_ms} ms from the cache.",
        ),
        m.decide(
            "pick_fused_ms < pick_full_ms",
            yes="A greedy pick for {mask_rows} masked rows took {pick_fused_ms} ms in the LM head's fused argmax over "
            "the allowed tokens, against {pick_full_ms} ms masking {vocab} logits a row in memory.",
            no="A greedy pick for {mask_rows} masked rows took {pick_fused_ms} ms fused, {pick_full_ms} ms in memory.",
        ),
        m.decide(
            "step_overhead_pct < 10",
            yes="At {step_rows} rows a decode step took {step_held_ms} ms constrained and {step_free_ms} ms free "
            "({step_overhead_pct}% more): masks ({fill_us_per_row} us a row) are filled while the model runs.",
            no="At {step_rows} rows a decode step took {step_held_ms} ms constrained and {step_free_ms} ms free "
            "({step_overhead_pct}% more); a row's mask takes {fill_us_per_row} us to fill.",
        ),
    ]
    intro = "A grammar compiled against the vocabulary says which tokens may come next; every other token's logit "
    intro += "counts as minus infinity, so even a model that would never write valid JSON writes nothing else."
    why = "Why it matters: agents and tool calls parse what the model writes; the constraint makes it parse."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    valid = {"free": m.numbers["valid_free_pct"], "constrained": m.numbers["valid_held_pct"]}
    bars(fig, valid, ylabel="% outputs valid for their schema", title="Valid JSON, same prompts", ylim=(0, 100))


LAB = Lab("structured-generation", "Structured generation", measure, explain, plot, definition=DEFINITION)
