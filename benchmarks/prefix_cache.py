"""Prefix caching: TTFT and throughput with the cache on and off, in one script.

Workload: 10 shared prefixes of 1024 tokens, each followed by 8 different 64-token questions,
64 output tokens, the default model. Requests go prefix by prefix with 8 in flight (a closed loop, as
`inferd bench --max-concurrency 8` would send them), so TTFT measures prefill, not a queue. A second
workload with nothing shared, submitted all at once, measures what the hashing and bookkeeping cost
when there is nothing to hit.

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


def warm_prefixes(llm: LLM, prompts: list[list[int]], prefix_len: int) -> None:
    """One uncounted single-token request per distinct prefix: the cache as a running server has it."""
    prefixes = {tuple(p[:prefix_len]) for p in prompts}
    llm.generate([list(p) + [7] for p in prefixes], SamplingParams(max_tokens=1))


def run(llm: LLM, prompts: list[list[int]], output_len: int, concurrency: int, warm_prefix: int = 0) -> dict:
    """Closed loop: keep `concurrency` requests in flight, submitting the next as one finishes.

    TTFT counts from submission, so it is the prefill a user waits for, not a queue the benchmark
    built by submitting everything at once (concurrency 0 does that, for raw throughput).
    """
    engine = llm.engine
    llm.reset_prefix_cache()
    if warm_prefix:
        warm_prefixes(llm, prompts, warm_prefix)
    hits0, queries0 = engine.kv.stats.hits, engine.kv.stats.queries
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    limit = concurrency or len(prompts)
    pending = list(enumerate(prompts))[::-1]
    finished: dict[int, object] = {}
    in_flight = 0
    t = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < limit:
            i, prompt = pending.pop()
            engine.add_request(f"pc-{i}", prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id.split("-")[1])] = out
                in_flight -= 1
    elapsed = time.perf_counter() - t
    outs = [finished[i] for i in range(len(prompts))]
    ttfts = [o.metrics.times.first_token - o.metrics.times.arrival for o in outs]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    queries = engine.kv.stats.queries - queries0
    return {
        "seconds": elapsed,
        "mean_ttft_s": statistics.mean(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "total_tokens_per_s": (sum(len(p) for p in prompts) + generated) / elapsed,
        "output_tokens_per_s": generated / elapsed,
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
    ap.add_argument("--runs", type=int, default=1, help="runs of each shared workload (median reported)")
    ap.add_argument("--unshared-runs", type=int, default=3)
    ap.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight for the TTFT runs (one prefix's questions)"
    )
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
        runs = {
            # cold: each prefix's 8 questions arrive together and the first computes the prefix
            "shared": [run(llm, shared, args.output_len, args.concurrency) for _ in range(args.runs)],
            # warm: the prefixes were seen before (system prompts of a running service)
            "shared_warm": [
                run(llm, shared, args.output_len, args.concurrency, args.prefix_len) for _ in range(args.runs)
            ],
            # nothing shared, everything submitted at once: what the bookkeeping costs at full batch
            "unshared": [run(llm, unshared, args.output_len, 0) for _ in range(args.unshared_runs)],
        }
        keys = ("mean_ttft_s", "median_ttft_s", "total_tokens_per_s", "hit_rate")
        result[name] = {w: {k: median_of(rs, k) for k in keys} for w, rs in runs.items()}
        result[name]["runs"] = {
            w: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for w, rs in runs.items()
        }
        result[name]["_outputs"] = runs["shared"][0]["outputs"]
        del llm
    result["same_tokens_on_and_off"] = result["on"].pop("_outputs") == result["off"].pop("_outputs")
    on, off = result["on"], result["off"]
    result["ttft_speedup_shared_cold"] = off["shared"]["mean_ttft_s"] / on["shared"]["mean_ttft_s"]
    result["ttft_speedup_shared_warm"] = off["shared_warm"]["mean_ttft_s"] / on["shared_warm"]["mean_ttft_s"]
    result["throughput_ratio_shared_on_over_off"] = (
        on["shared"]["total_tokens_per_s"] / off["shared"]["total_tokens_per_s"]
    )
    result["throughput_ratio_unshared_on_over_off"] = (
        on["unshared"]["total_tokens_per_s"] / off["unshared"]["total_tokens_per_s"]
    )
    path = write_result("prefix_cache", result)
    print(
        f"shared cold: mean TTFT {on['shared']['mean_ttft_s']:.2f}s on vs {off['shared']['mean_ttft_s']:.2f}s off "
        f"({result['ttft_speedup_shared_cold']:.1f}x), hit rate {on['shared']['hit_rate']:.0%}; "
        f"warm: {on['shared_warm']['mean_ttft_s']:.2f}s vs {off['shared_warm']['mean_ttft_s']:.2f}s "
        f"({result['ttft_speedup_shared_warm']:.1f}x); "
        f"unshared throughput on/off {result['throughput_ratio_unshared_on_over_off']:.3f}; "
        f"same tokens: {result['same_tokens_on_and_off']}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
