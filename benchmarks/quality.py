"""Quality of each dtype / quantization mode against fp32, on the default model (Gemma 3 270M).

For every mode: greedy token agreement with fp32 over P prompts x T new tokens (default 64 x 64), and
perplexity on a fixed English text (CPython's `pydoc_data.topics`, which every Python ships: the
topics in sorted order, their first N tokens, scored in independent windows). Prompts are slices of
the same topics, so every mode sees the very same token ids.

Agreement is reported three ways: the fraction of positions with the same token (after a divergence the
continuations differ, so this counts divergence early), the mean common prefix as a fraction of T, and
the fraction of sequences identical to the end.

    .venv/bin/python -m benchmarks.quality                                # all modes, 64 x 64, 4096 ppl tokens
    .venv/bin/python -m benchmarks.quality --modes fp32,bf16 --prompts 16 --new-tokens 32 --ppl-tokens 1024
    .venv/bin/python -m benchmarks.quality --modes fp32,int8,int4 --rows 8

By default the prompts decode in one batch and each perplexity window is one prefill: every layer sees many
rows. `--rows 8` decodes 8 sequences at a time and scores in prefill chunks of 8 tokens, so the kernels that
decoding a few streams runs (int8 and int4 with their activations quantized to int8) are the ones measured.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import torch

from benchmarks.common import OUT_HELP, machine, record_run
from inferd import LLM, SamplingParams
from inferd.config import DEFAULT_MODEL
from inferd.engine.step import NewRequest, ScheduledChunk, SchedulerOutput

# mode name -> engine settings; fp32 is the reference and always runs first
MODES: dict[str, dict] = {
    "fp32": dict(dtype="float32", quantization="none"),
    "bf16": dict(dtype="bfloat16", quantization="none"),
    "default": dict(),  # `inferd serve` with no flags (--dtype auto, --quantization auto)
    "int8": dict(dtype="auto", quantization="int8"),  # int8 weights, bf16 activations where the CPU has bf16
    "int8-fp32": dict(dtype="float32", quantization="int8"),  # int8 weights, fp32 activations (the AVX2 path)
    "gguf": dict(dtype="auto", quantization="gguf"),  # the GGUF file's own blocks, activations int8 in groups of 32
    "int4": dict(dtype="auto", quantization="int4"),  # int4 weights (groups of 32), bf16 activations where native
    "int4-fp32": dict(dtype="float32", quantization="int4"),
    "int8-kv-bf16": dict(dtype="auto", quantization="int8", kv_cache_dtype="bfloat16"),  # a bf16 KV cache (under fp32)
    "int8-kv-fp8": dict(dtype="auto", quantization="int8", kv_cache_dtype="fp8"),  # and an fp8 (e4m3) KV cache
    "int8-kv-fp8_e5m2": dict(dtype="auto", quantization="int8", kv_cache_dtype="fp8_e5m2"),
    "bf16-kv-fp8": dict(dtype="bfloat16", quantization="none", kv_cache_dtype="fp8"),
}


def english_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: slices of the topics, a different topic (then a later slice) each."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(topics[keys[i % len(keys)]], add_special_tokens=False)
        start = 16 + (i // len(keys)) * length
        if len(ids) < start + length:  # a short topic: its beginning
            start = 0
        prompts.append(bos + ids[start : start + length])
    return prompts


def greedy_tokens(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    same = total = 0
    prefixes = []
    for g, r in zip(got, ref, strict=True):
        same += sum(a == b for a, b in zip(g, r, strict=True))
        total += len(r)
        common = next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), len(r))
        prefixes.append(common / len(r))
    return {
        "same_token_fraction": same / total,
        "mean_common_prefix_fraction": sum(prefixes) / len(prefixes),
        "identical_sequences_fraction": sum(p == 1.0 for p in prefixes) / len(prefixes),
        "first_token_agreement": sum(g[0] == r[0] for g, r in zip(got, ref, strict=True)) / len(ref),
    }


def window_nll(
    llm: LLM, ids: list[int], rows: int | None = None, score_from: int = 0, rows_per_slice: int = 64
) -> tuple[float, int]:
    """Sum of -log p(next token) over one window, and how many tokens it scored, through the engine's model
    and LM head: one prefill, or with `rows` a prefill in chunks of that many tokens (each layer then sees as
    few rows as a small decode batch does, so the kernels for a few rows are the ones scored). Only the
    tokens after position `score_from` are scored (each then has that much context at least)."""
    engine = llm.engine
    runner, bs = engine.runner, engine.kv.block_size
    blocks = list(range(-(-len(ids) // bs)))  # the engine is idle: any blocks will do
    size = rows or len(ids)
    targets = torch.tensor(ids[1:])
    nll = 0.0
    try:
        for start in range(0, len(ids), size):
            part = ids[start : start + size]
            first = start == 0
            chunk = ScheduledChunk("ppl", part, start, True, start + size >= len(ids), blocks if first else [])
            sched = SchedulerOutput(
                chunks=[chunk], new_requests=[NewRequest("ppl", ids, SamplingParams(), frozenset())] if first else []
            )
            runner.update_states(sched)
            step = runner.prepare(sched)
            with torch.inference_mode():
                hidden = engine.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
                # full-vocab logits a slice of rows at a time
                for lo in range(max(0, score_from - start), len(part), rows_per_slice):
                    hi = min(lo + rows_per_slice, len(part), len(ids) - 1 - start)
                    if hi <= lo:
                        break
                    logits = engine.model.compute_logits(hidden[lo:hi]).float()
                    nll -= logits.log_softmax(-1).gather(1, targets[start + lo : start + hi, None]).sum().item()
    finally:
        runner.update_states(SchedulerOutput(finished_ids=["ppl"]))
    return nll, len(ids) - 1 - score_from


def perplexity(llm: LLM, text_ids: list[int], window: int, rows: int | None = None) -> dict:
    bos = [llm.tokenizer.bos_token_id] if llm.tokenizer.bos_token_id is not None else []
    nll, count = 0.0, 0
    for lo in range(0, len(text_ids), window - len(bos)):
        part = bos + text_ids[lo : lo + window - len(bos)]
        if len(part) < 2:
            continue
        n, c = window_nll(llm, part, rows)
        nll, count = nll + n, count + c
    return {"perplexity": math.exp(nll / count), "scored_tokens": count, "window": window, "rows": rows}


def run_mode(name: str, args, prompts, text_ids, ref_tokens) -> tuple[dict, list[list[int]]]:
    settings = MODES[name]
    t = time.perf_counter()
    batch = {"max_num_seqs": args.rows} if args.rows else {}
    llm = LLM(args.model, max_model_len=max(args.window, 1024), kv_cache_memory=1024**3, **batch, **settings)
    engine = llm.engine
    tokens = greedy_tokens(llm, prompts, args.new_tokens)
    result = {
        "settings": settings,
        "dtype": engine.dtype_choice.name,
        "quantization": engine.quantization,
        **perplexity(llm, text_ids, args.window, args.rows),
    }
    if ref_tokens is not None:
        result["agreement_with_fp32"] = agreement(tokens, ref_tokens)
    result["seconds"] = time.perf_counter() - t
    engine.check_idle()
    del llm, engine
    gc.collect()
    return result, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of the English text to score")
    ap.add_argument("--window", type=int, default=512, help="perplexity window (tokens of context at most)")
    ap.add_argument(
        "--rows",
        type=int,
        help="rows per forward pass: decode at most this many sequences at once and score perplexity in prefill "
        "chunks of this many tokens (<= 12 runs the int8/int4 kernels decoding a few streams uses); default: "
        "every prompt in one batch, each window in one prefill",
    )
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    modes = ["fp32"] + [m for m in modes if m != "fp32"]

    from inferd.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_tokens)
    text_ids = tokenizer.encode(english_text(), add_special_tokens=False)[: args.ppl_tokens]
    results: dict[str, dict] = {}
    ref = None
    for name in modes:
        results[name], tokens = run_mode(name, args, prompts, text_ids, ref)
        ref = ref if ref is not None else tokens
        r = results[name]
        agree = r.get("agreement_with_fp32", {}).get("same_token_fraction", 1.0)
        print(f"{name:10s} dtype {r['dtype']:9s} ppl {r['perplexity']:.3f}  same as fp32 {agree:.1%}", flush=True)
    out = {
        "model": args.model,
        "workload": {
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "ppl_text": "pydoc_data.topics, topics in sorted order, joined by blank lines",
            "ppl_tokens": len(text_ids),
            "window": args.window,
        },
        "machine": machine(),
        "modes": results,
    }
    print(f"wrote {record_run('quality', out, sys.argv, args.out)}")


if __name__ == "__main__":
    main()
