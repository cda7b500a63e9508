"""Speculative decoding: output tok/s and ITL with and without n-gram prompt lookup and suffix decoding, inferd
against vLLM CPU's own n-gram speculation (and llama-server without it), on outputs that quote their prompt, on
open ones, and on outputs that repeat earlier requests' outputs.

Servers (`--servers`, default: those of DEFAULT_SERVERS whose setup is done), all started at once and given
each run in turn (this VM's speed drifts by up to a third over minutes); the five together outgrow 24 GiB
under load (vLLM's worker is OOM-killed), so plain `vllm` is left out unless asked for:
  inferd         `inferd serve`, defaults (no speculation)
  inferd-ngram   the same with SPEC (vLLM's spelling, vLLM's values; inferd's default draft policy, `cost`)
  inferd-ngram8  the same with up to 8 drafts a request (SPEC8): the cost policy decides how many pay
  inferd-suffix  the same with suffix decoding (SUFFIX: vLLM's spelling and defaults; not in the default set)
  inferd-self    the same with self-drafting (SELF: the model drafts 3 tokens with its LM head cut to its
                 traffic's most frequent tokens)
  vllm           vLLM CPU, bf16 (vs_peers' `vllm`, with a 2 GiB KV cache like inferd's), no speculation
  vllm-ngram     the same with SPEC
  llama-server   Q4_K_M (vs_peers' `llama-server`), no speculation
Workloads, `inferd bench serve` on /v1/completions, greedy, streaming, `--ignore-eos`:
  quote   `--dataset quote`: copy a passage of random words (~`--input-len` tokens); outputs repeat the prompt
  open    `--dataset random`: continue random words; outputs repeat little
  repeat  `--dataset random` sent twice with the same seed: the first pass (not counted) finishes every request
          once, the second is measured, so each output repeats an earlier request's (suffix decoding's global
          tree drafts it; every server gets both passes, so prefix caching helps all alike). Not in the default
          --workloads
Each level (`--concurrency`, default 1,4,16,32) sends max(8, 2 x concurrency) requests of `--output-len`
(default 128) tokens per run, `--runs` runs (default 2), a seed of its own per run and workload, the same for
every server; medians. Reported per server, workload and level: output tok/s, mean TPOT, ITL (between stream
chunks, which carry several tokens under speculation) and TTFT, and where the server counts them, draft
tokens and their acceptance; then ratios in the same run:
ngram over off (each engine), inferd-ngram over vllm-ngram and over llama-server, inferd-suffix over off and
over inferd-ngram.

    python benchmarks/speculative.py                          # the default servers set up, c=1,4,16,32, 2 runs
    python benchmarks/speculative.py --servers inferd,inferd-ngram --concurrency 1 --runs 1
    python benchmarks/speculative.py --servers inferd,inferd-ngram,inferd-suffix --workloads repeat,open

Results: one run appended to benchmarks/results/speculative-<CPU kind>.json (`--out NAME`; `--fresh`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # run as a script: make `benchmarks.*` importable
from benchmarks.common import bench_serve, record_run  # noqa: E402
from benchmarks.vs_peers import (  # noqa: E402
    LOG_DIR,
    Server,
    chosen_servers,
    default_model,
    median_of_runs,
    running,
    server_entry,
    servers,
)
from inferd.procs import free_port  # noqa: E402

RAW_DIR = ROOT / "results" / "speculative" / "raw"  # each bench run's JSON (not committed)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPEC8 = SPEC | {"num_speculative_tokens": 8}
SUFFIX = {"method": "suffix"}  # vLLM's defaults: depth 24, up to 24 drafts, 10000 cached outputs
SELF = {"method": "self_draft", "num_speculative_tokens": 3}  # inferd's own: the model drafts with a cut LM head
SPECS = {
    "inferd-ngram": SPEC,
    "inferd-ngram8": SPEC8,
    "inferd-suffix": SUFFIX,
    "inferd-self": SELF,
    "vllm-ngram": SPEC,
}
WORKLOADS = {"quote": "quote", "open": "random", "repeat": "random"}  # name -> `inferd bench serve --dataset`
DEFAULT_WORKLOADS = ("quote", "open")
TWICE = {"repeat"}  # workloads whose prompts are sent once uncounted, then measured
SERVERS = (
    "inferd",
    "inferd-ngram",
    "inferd-ngram8",
    "inferd-suffix",
    "inferd-self",
    "vllm",
    "vllm-ngram",
    "llama-server",
)
DEFAULT_SERVERS = ("inferd", "inferd-ngram", "inferd-ngram8", "inferd-self", "vllm-ngram", "llama-server")
KEYS = (
    "completed",
    "failed",
    "output_throughput",
    "mean_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "mean_tpot_ms",
    "total_output_tokens",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_acceptance_rate",
    "spec_decode_mean_acceptance_length",
)


def num_prompts(concurrency: int) -> int:
    return max(8, 2 * concurrency)


def server_table(model) -> tuple[dict[str, Server], dict[str, int]]:
    """Every server of SERVERS on a port of its own; those of SPECS are their base with that config added."""
    ports, table = {}, {}
    for name in SERVERS:
        ports[name] = free_port()
        base = servers(model, ports[name])[name.rsplit("-", 1)[0] if name in SPECS else name]
        if name in SPECS:
            flags = ["--speculative-config", json.dumps(SPECS[name])]
            base = dataclasses.replace(base, name=name, command=[*base.command, *flags])
        if name.startswith("vllm"):  # two vLLMs beside three servers on 24 GiB: its 4 GiB default left one OOM-killed
            base = dataclasses.replace(base, env=base.env | {"VLLM_CPU_KVCACHE_SPACE": "2"})
        table[name] = base
    return table, ports


def bench_run(
    server: Server, port: int, hf_folder: Path, workload: str, level: int, seed: int, args: argparse.Namespace
) -> dict:
    """One measured run; a TWICE workload first sends the same requests (the same seed) once, uncounted."""
    passes = ("prime", "") if workload in TWICE else ("",)
    for label in passes:
        name = f"{server.name}-{label}" if label else server.name
        cmd = [
            sys.executable, "-m", "inferd.cli", "bench", "serve",
            "--base-url", f"http://127.0.0.1:{port}", "--model", server.model_name,
            "--dataset", WORKLOADS[workload], "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(num_prompts(level)), "--max-concurrency", str(level), "--num-warmups", "1",
            "--seed", str(seed), "--tokenizer-source", "local", "--tokenizer", str(hf_folder),
            "--label", name, "--save-result", "--no-progress", "--result-dir", str(RAW_DIR),
            "--result-filename", f"{name}.{workload}.c{level}.s{seed}.json",
        ]  # fmt: skip
        result = bench_serve(cmd, KEYS)
    return result


def ratios(entries: dict) -> dict:
    """Per workload and level, in the same run: each engine's ngram over its off, and inferd-ngram over vllm-ngram
    and llama-server: output tok/s, and TPOT (the time per output token after the first) as b's over a's, so
    above 1 is better either way. TPOT, not ITL: a stream chunk carries every token a step accepted, so the
    gaps between chunks (ITL) grow while the time per token falls."""
    pairs = {
        "inferd_ngram_over_off": ("inferd-ngram", "inferd"),
        "vllm_ngram_over_off": ("vllm-ngram", "vllm"),
        "inferd_ngram_over_vllm_ngram": ("inferd-ngram", "vllm-ngram"),
        "inferd_ngram_over_llama_server": ("inferd-ngram", "llama-server"),
        "inferd_ngram8_over_off": ("inferd-ngram8", "inferd"),
        "inferd_ngram8_over_vllm_ngram": ("inferd-ngram8", "vllm-ngram"),
        "inferd_ngram8_over_llama_server": ("inferd-ngram8", "llama-server"),
        "inferd_suffix_over_off": ("inferd-suffix", "inferd"),
        "inferd_suffix_over_ngram": ("inferd-suffix", "inferd-ngram"),
        "inferd_self_over_off": ("inferd-self", "inferd"),
        "inferd_self_over_llama_server": ("inferd-self", "llama-server"),
        "inferd_over_vllm": ("inferd", "vllm"),
    }
    out: dict = {}
    for label, (a, b) in pairs.items():
        if a not in entries or b not in entries:
            continue
        for workload, levels in entries[a]["workloads"].items():
            for level, fig in levels.items():
                x, y = fig["median"], entries[b]["workloads"].get(workload, {}).get(level, {}).get("median", {})
                if not x.get("output_throughput") or not y.get("output_throughput"):
                    continue
                row = {"output_throughput": x["output_throughput"] / y["output_throughput"]}
                if x.get("mean_tpot_ms") and y.get("mean_tpot_ms"):
                    row["tpot_speedup"] = y["mean_tpot_ms"] / x["mean_tpot_ms"]
                out.setdefault(label, {}).setdefault(workload, {})[level] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None, help=f"comma-separated of {', '.join(SERVERS)}")
    p.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}"
    )
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default=None, help="results file name (default: speculative-<CPU kind>)")
    p.add_argument("--fresh", action="store_true", help="the results file holds this run alone")
    args = p.parse_args()
    started = time.time()
    model = default_model(convert=False)
    table, ports = server_table(model)
    chosen = chosen_servers(args.servers, table, DEFAULT_SERVERS)
    workloads = args.workloads.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    entries = {n: server_entry(table[n], workloads={}) for n in chosen}
    with running([(table[n], ports[n], entries[n]) for n in chosen]):
        for level in levels:
            runs: dict[tuple[str, str], list[dict]] = {}
            for run in range(args.runs):
                for w, workload in enumerate(workloads):
                    seed = w * 1_000_000 + level * 1000 + run  # the same prompts for every server
                    for name in chosen:
                        result = bench_run(table[name], ports[name], model.hf_folder, workload, level, seed, args)
                        runs.setdefault((name, workload), []).append(result)
                        print(f"[{name}] {workload} c={level} run {run}: {result}", flush=True)
            for (name, workload), got in runs.items():
                fig = {"num_prompts": num_prompts(level), "runs": got, "median": median_of_runs(got, KEYS)}
                entries[name]["workloads"].setdefault(workload, {})[f"concurrency={level}"] = fig
    result = {
        "benchmark": "speculative",
        "workload": {"endpoint": "/v1/completions", "datasets": {w: WORKLOADS[w] for w in workloads},
                     "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                     "temperature": 0, "levels": levels, "runs": args.runs, "speculative_config": SPEC,
                     "speculative_config_8": SPEC8, "speculative_config_suffix": SUFFIX,
                     "speculative_config_self": SELF,
                     "sent_twice": sorted(TWICE & set(workloads))},
        "servers": entries,
        "ratios": ratios(entries),
    }  # fmt: skip
    path = record_run("speculative", result, sys.argv, args.out, args.fresh, started)
    print(json.dumps(result["ratios"], indent=1))
    print(f"wrote {path} (server logs in {LOG_DIR})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
