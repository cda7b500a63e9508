"""Prefix caching: TTFT and throughput with the cache on and off, in one script.

Workload (issue 3): 10 shared prefixes of 1024 tokens, each followed by 8 different 64-token questions,
64 output tokens, the default model. All 80 requests are submitted together, prefix by prefix, as a
burst of users sharing system prompts would. A second workload with nothing shared measures what the
hashing and bookkeeping cost when there is nothing to hit.

    .venv/bin/python -m benchmarks.prefix_cache            # writes results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.common import machine, write_result
from inferd import LLM, SamplingParams
from inferd.config import DEFAULT_MODEL


def shared_prefix_workload(num_prefixes: int, per_prefix: int, prefix_len: int, question_len: int, seed: int):
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1000, 200_000) for _ in range(n)]  # noqa: E731
    prompts = []
    for _ in range(num_prefixes):
        prefix = tokens(prefix_len)
        prompts += [prefix + tokens(question_len) for _ in range(per_prefix)]
    return prompts


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    hits0, queries0 = engine.kv.stats.hits, engine.kv.stats.queries
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    total_tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    queries = engine.kv.stats.queries - queries0
    return {
        "seconds": elapsed,
        "mean_ttft_s": statistics.mean(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "total_tokens_per_s": total_tokens / elapsed,
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "hit_rate": (engine.kv.stats.hits - hits0) / queries if queries else 0.0,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-prefixes", type=int, default=10)
    ap.add_argument("--per-prefix", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    shared = shared_prefix_workload(args.num_prefixes, args.per_prefix, args.prefix_len, args.question_len, args.seed)
    # nothing shared: the same lengths, every prompt its own
    unshared = shared_prefix_workload(
        args.num_prefixes * args.per_prefix, 1, args.prefix_len, args.question_len, args.seed + 1
    )
    settings = dict(dtype="float32", max_model_len=2048, max_num_seqs=32, kv_cache_memory=4 * 1024**3)
    result: dict = {"workload": vars(args), "machine": machine(), "settings": settings}
    for caching in (True, False):
        llm = LLM(args.model, enable_prefix_caching=caching, **settings)
        llm.generate([shared[0][:64]], SamplingParams(max_tokens=4))  # warm-up
        name = "on" if caching else "off"
        shared_runs = [run(llm, shared, args.output_len) for _ in range(args.runs)]
        unshared_runs = [run(llm, unshared, args.output_len) for _ in range(args.runs)]
        result[name] = {
            "shared": {k: median_of(shared_runs, k) for k in ("mean_ttft_s", "total_tokens_per_s", "hit_rate")},
            "unshared": {k: median_of(unshared_runs, k) for k in ("mean_ttft_s", "total_tokens_per_s", "hit_rate")},
            "runs": {
                "shared": [{k: v for k, v in r.items() if k != "outputs"} for r in shared_runs],
                "unshared": [{k: v for k, v in r.items() if k != "outputs"} for r in unshared_runs],
            },
        }
        result[name]["_outputs"] = shared_runs[0]["outputs"]
        del llm
    result["same_tokens_on_and_off"] = result["on"].pop("_outputs") == result["off"].pop("_outputs")
    on, off = result["on"], result["off"]
    result["ttft_speedup_shared"] = off["shared"]["mean_ttft_s"] / on["shared"]["mean_ttft_s"]
    result["throughput_ratio_unshared_on_over_off"] = (
        on["unshared"]["total_tokens_per_s"] / off["unshared"]["total_tokens_per_s"]
    )
    path = write_result("prefix_cache", result)
    print(
        f"shared: mean TTFT {on['shared']['mean_ttft_s']:.2f}s on vs {off['shared']['mean_ttft_s']:.2f}s off "
        f"({result['ttft_speedup_shared']:.1f}x), hit rate {on['shared']['hit_rate']:.0%}; "
        f"unshared throughput on/off {result['throughput_ratio_unshared_on_over_off']:.3f}; "
        f"same tokens: {result['same_tokens_on_and_off']}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
