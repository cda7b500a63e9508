"""Structured outputs: what a JSON-schema constraint costs per token and per request, and how often outputs are
valid with and without it; inferd against vLLM CPU on the same schemas, in the same run.

Servers (`--servers`, default: inferd, and vllm where `python benchmarks/vs_peers.py --setup vllm` is done), all
started at once and given each run in turn (this VM's speed drifts by up to a third over minutes):
  inferd   `inferd serve` with its defaults
  vllm     vLLM CPU (bf16, vs_peers' `vllm`); xgrammar is its default structured-output backend too
Workload: `inferd bench serve --dataset json-schema` on /v1/completions (the packaged model has no chat
template), greedy, `--max-tokens` (default 256), real schemas of `inferd.bench.schemas` up to 1,500 characters,
each request asking for one JSON object with its schema in the prompt. Two modes on the same prompts:
  constrained   every request also sends the schema as `response_format` (`--structured-output-ratio 1`)
  free          the prompt alone (ratio 0), each output as long as the constrained run's mean on that server
                (`--ignore-eos`): constrained outputs end where their JSON does, and a run whose outputs end
                sooner spends more of its steps on the next requests' prefills, which would be counted as the
                constraint's cost; equal output lengths leave only the grammar's own cost (compile, masks)
The two modes' prompts differ in their leading tag only (`--prompt-salt`), so the second never hits the
prefix cache the first filled. Each level (`--concurrency`, default 1,16) sends max(8, 3 x concurrency)
requests per run, `--runs` runs (default 3), a seed of its own per run; medians. Reported per server and
level: output tok/s, mean TPOT and TTFT, the share of outputs valid against their schema, and constrained
over free (the constraint's cost).
Compile latency (`--probes`, default 5): a schema no server has seen (a corpus schema given a fresh `title`),
one token, non-streaming, timed; then the same request again, its grammar cached; medians per server.

    python benchmarks/structured.py                       # inferd and vLLM (if set up), c=1 and 16, 3 runs
    python benchmarks/structured.py --servers inferd --runs 1 --concurrency 4

Results: one run appended to benchmarks/results/structured-<CPU kind>.json (`--out NAME`; `--fresh`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

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

RAW_DIR = ROOT / "results" / "structured" / "raw"  # each bench run's JSON (not committed)
MODES = {"constrained": 1.0, "free": 0.0}
KEYS = (
    "completed",
    "failed",
    "output_throughput",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "total_output_tokens",
    "schema_valid_rate",
)


def num_prompts(concurrency: int) -> int:
    return max(8, 3 * concurrency)


def bench_command(
    server: Server, port: int, hf_folder: Path, mode: str, level: int, seed: int, output_len: int, exact: bool
) -> list[str]:
    """Outputs up to `output_len` tokens, ending where the output does; `exact`: exactly that many."""
    fixed = ["--ignore-eos"] if exact else []
    return [
        sys.executable, "-m", "inferd.cli", "bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}", "--model", server.model_name,
        "--dataset", "json-schema", "--structured-output-ratio", str(MODES[mode]), *fixed,
        f"--prompt-salt=-{mode}",  # same schemas in both modes, but free prompts never hit the constrained ones' cache
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts(level)),
        "--max-concurrency", str(level), "--num-warmups", "1", "--seed", str(seed),
        "--tokenizer-source", "local", "--tokenizer", str(hf_folder),
        "--label", server.name, "--save-result", "--no-progress", "--result-dir", str(RAW_DIR),
        "--result-filename", f"{server.name}.{mode}.c{level}.s{seed}.json",
    ]  # fmt: skip


def bench_run(
    server: Server, port: int, hf_folder: Path, mode: str, level: int, seed: int, output_len: int, exact: bool
) -> dict:
    return bench_serve(bench_command(server, port, hf_folder, mode, level, seed, output_len, exact), KEYS)


def probe_schemas(count: int) -> list[dict]:
    """`count` corpus schemas, each given a title no server has seen, so its grammar is compiled anew."""
    from inferd.bench.schemas import small_schemas

    small = small_schemas(1500)
    return [{**small[(i * 7) % len(small)], "title": f"probe-{uuid.uuid4().hex}"} for i in range(count)]


def compile_latency(server: Server, port: int, schemas: list[dict]) -> dict:
    """Seconds to one token for a never-seen schema, then for the same request again (grammar cached)."""
    first, cached = [], []
    for schema in schemas:
        body = {
            "model": server.model_name,
            "prompt": "Write one JSON object.\nJSON:",
            "max_tokens": 1,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}},
        }
        for into in (first, cached):
            t0 = time.perf_counter()
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
            if r.status_code != 200:
                raise RuntimeError(f"{server.name}: probe answered {r.status_code}: {r.text[:300]}")
            into.append(time.perf_counter() - t0)
    return {
        "first_s": statistics.median(first),
        "cached_s": statistics.median(cached),
        "first_minus_cached_s": statistics.median(a - b for a, b in zip(first, cached, strict=True)),
        "probes": len(schemas),
    }


def ratios(entry: dict) -> dict:
    """Per level: constrained over free (TPOT: the constraint's cost per token; throughput)."""
    out = {}
    for level, modes in entry["levels"].items():
        c, f = modes.get("constrained", {}).get("median", {}), modes.get("free", {}).get("median", {})
        if c.get("mean_tpot_ms") and f.get("mean_tpot_ms"):
            out[level] = {
                "tpot_constrained_over_free": c["mean_tpot_ms"] / f["mean_tpot_ms"],
                "throughput_constrained_over_free": c["output_throughput"] / f["output_throughput"],
            }
    return out


def versus(entries: dict) -> dict:
    """inferd over vLLM, both constrained, per level: output tok/s and mean TPOT (lower is better)."""
    a, b = entries.get("inferd"), entries.get("vllm")
    if not a or not b:
        return {}
    out = {}
    for level, modes in a["levels"].items():
        x = modes.get("constrained", {}).get("median", {})
        y = b["levels"].get(level, {}).get("constrained", {}).get("median", {})
        if x.get("output_throughput") and y.get("output_throughput"):
            out[level] = {
                "output_throughput": x["output_throughput"] / y["output_throughput"],
                "mean_tpot_ms": x["mean_tpot_ms"] / y["mean_tpot_ms"],
                "valid_inferd": x.get("schema_valid_rate"),
                "valid_vllm": y.get("schema_valid_rate"),
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None, help="comma-separated of inferd, vllm (default: those set up)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--probes", type=int, default=5, help="never-seen schemas timed for the compile latency")
    p.add_argument("--out", default=None, help="results file name (default: structured-<CPU kind>)")
    p.add_argument("--fresh", action="store_true", help="the results file holds this run alone")
    args = p.parse_args()
    started = time.time()
    model = default_model(convert=False)
    ports = {}
    table = {}
    for name in ("inferd", "vllm"):
        ports[name] = free_port()
        table[name] = servers(model, ports[name])[name]
    chosen = chosen_servers(args.servers, table, table)
    levels = [int(c) for c in args.concurrency.split(",")]
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    entries = {n: server_entry(table[n], levels={}) for n in chosen}
    with running([(table[n], ports[n], entries[n]) for n in chosen]):
        probes = probe_schemas(args.probes)
        for name in chosen:  # before any bench run has compiled these schemas
            entries[name]["compile"] = compile_latency(table[name], ports[name], probes)
            print(f"[{name}] compile: {entries[name]['compile']}", flush=True)
        for level in levels:
            runs: dict[tuple[str, str], list[dict]] = {}
            for run in range(args.runs):
                seed = level * 1000 + run  # the same prompts for every server and mode within a run
                lengths = {}
                for mode in MODES:  # constrained first: the free run's outputs are as long as its mean
                    for name in chosen:
                        exact = mode == "free"
                        length = lengths[name] if exact else args.max_tokens
                        result = bench_run(table[name], ports[name], model.hf_folder, mode, level, seed, length, exact)
                        result["output_len"] = length if exact else None
                        if mode == "constrained":
                            lengths[name] = max(1, round(result["total_output_tokens"] / result["completed"]))
                        runs.setdefault((name, mode), []).append(result)
                        print(f"[{name}] c={level} {mode} run {run}: {result}", flush=True)
            for (name, mode), got in runs.items():
                fig = {"num_prompts": num_prompts(level), "runs": got, "median": median_of_runs(got, KEYS)}
                entries[name]["levels"].setdefault(f"concurrency={level}", {})[mode] = fig
    for entry in entries.values():
        entry["constrained_over_free"] = ratios(entry)
    result = {
        "benchmark": "structured",
        "workload": {"dataset": "json-schema", "endpoint": "/v1/completions", "max_tokens": args.max_tokens,
                     "max_schema_chars": 1500, "temperature": 0, "levels": levels, "runs": args.runs,
                     "free_output_len": "the constrained run's mean output tokens, ignore_eos"},
        "servers": entries,
        "inferd_over_vllm_constrained": versus(entries),
    }  # fmt: skip
    path = record_run("structured", result, sys.argv, args.out, args.fresh, started)
    print(json.dumps({"servers": {n: e["constrained_over_free"] for n, e in entries.items()},
                      "inferd_over_vllm": result["inferd_over_vllm_constrained"]}, indent=1))  # fmt: skip
    print(f"wrote {path} (server logs in {LOG_DIR})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
