"""Shared helpers for the benchmark scripts: timing, machine facts, JSON output. The machine's ceilings
(matmul peak, memory bandwidth) and a model's bytes and FLOPs come from the measuring library
(`inferd.measure.hardware`, `inferd.measure.model`), as the labs' do."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from inferd import cpu
from inferd.bench import runs

RESULTS = Path(__file__).parent / "results"
OUT_HELP = "results file (default: benchmarks/results/<benchmark>-<this CPU's kind>.json): a name there, or a path"
REPO_ROOT = Path(__file__).resolve().parent.parent
# what a run of repeated prompts records it did with inferd's prefix cache; the report reads a run without it as
# one whose runs after the first were served their prompts' KV from the cache
PREFIX_CACHE_RESET = "reset before each timed run"


def median_time(fn: Callable[[], object], runs: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alternated(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each function, called in turn `repeats` times after one warm-up each: a drift of
    the machine's speed over the run is shared by all of them rather than read as a difference."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def kernel_args(doc: str, lengths: list[int]):
    """The flags the kernel benchmarks share: --lengths, --repeats, --quantization, --out (`results_path`)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=lengths)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quantization", default="int8", choices=["int8", "int4", "none"])
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    args.quantization = None if args.quantization == "none" else args.quantization
    return args


def machine() -> dict:
    return {
        "cpu": cpu.cpu_identity()["model"] or platform.processor(),
        "isa": [f for f in cpu.VECTOR_FLAGS if f in cpu.cpu_flags()],
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_at_start": os.getloadavg(),
    }


def portable(value):
    """`value` (JSON data) with this machine's paths replaced, so committed results hold none:
    the converted model folder becomes `<converted model folder>`, the interpreter `python`,
    paths in the repository become relative and the home folder `~`."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    if not isinstance(value, str):
        return value
    home = str(Path.home())
    value = re.sub(re.escape(home) + r"/\.cache/inferd/converted/[^\s\"',]+", "<converted model folder>", value)
    value = value.replace(sys.executable, "python")
    value = value.replace(str(REPO_ROOT) + "/", "").replace(str(REPO_ROOT), ".")
    return value.replace(home, "~")


def write_json(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable(result), indent=2) + "\n")
    return path


def bench_serve(cmd: list[str], keys: tuple[str, ...], quiet: bool = True) -> dict:
    """Run one `inferd bench serve` command line that saves its result (`--result-dir`, `--result-filename`);
    rewrite that file without this machine's paths and return its `keys` (of its one level). `quiet`: keep
    its output unless it fails."""
    done = subprocess.run(cmd, check=False, capture_output=quiet, text=True)
    if done.returncode != 0:
        tail = f"\n{done.stderr[-2000:]}" if quiet else ""
        raise RuntimeError(f"inferd bench exited with {done.returncode}: {shlex.join(cmd)}{tail}")
    raw = bench_result_file(cmd)
    result = json.loads(raw.read_text())
    write_json(raw, result)  # the same, without this machine's paths
    return bench_summary(result, keys)


def bench_result_file(cmd: list[str]) -> Path:
    """Where an `inferd bench serve` command line saves its result."""
    return Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]


def bench_summary(result: dict, keys: tuple[str, ...]) -> dict:
    """The `keys` of a saved one-level bench result."""
    run = result["runs"][0] if "runs" in result else result  # one level: the summary is the file itself
    return {k: run.get(k) for k in keys}


def write_result(name: str, result: dict) -> Path:
    """A one-result file, `benchmarks/results/<name>.json` (the platform benchmarks, whose figures do not
    follow the CPU kind); the CPU-bound ones keep runs per kind (`record_run`)."""
    return write_json(RESULTS / f"{name}.json", result)


def results_path(benchmark: str, out: str | None = None) -> Path:
    """Where a benchmark's runs go: `benchmarks/results/<benchmark>-<this CPU's kind>.json` by default;
    `out`, a name in benchmarks/results/ or a path ending in .json (a lab's or a scratch run)."""
    if out is None:
        return RESULTS / runs.file_name(benchmark)
    return Path(out) if out.endswith(".json") else RESULTS / f"{out}.json"


def record_run(
    benchmark: str, result: dict, argv: list[str], out: str | None = None, fresh: bool = False, started=None
) -> Path:
    """Append this invocation, as one run (date, commit, CPU, command, then `result`), to the benchmark's
    results file for this CPU kind (`results_path`); `fresh`: the file holds this run alone."""
    path = results_path(benchmark, out)
    run = runs.header(runs.command_line(argv, f"-m benchmarks.{benchmark}"), REPO_ROOT, started) | result
    run["finished"] = time.strftime(runs.DATE_FORMAT, time.gmtime())
    return write_json(path, runs.append_run(path, run, fresh))
