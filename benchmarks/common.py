"""Shared helpers for the benchmark scripts: machine facts, matmul peak, FLOP counting, JSON output."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
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


def matmul_peak_gflops(n: int = 3072, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Large matmul throughput in `dtype`, with torch's dense path and (fp32) oneDNN's packed linear: the
    peak a step in that dtype is measured against (bf16 on an AMX CPU runs ~3x fp32's)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    flops = 2 * n**3
    out = {"dtype": str(dtype).removeprefix("torch."), "dense_mm": flops / median_time(lambda: a @ b) / 1e9}
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        wm = b.t().contiguous().to_mkldnn()
        out["onednn"] = (
            flops / median_time(lambda: torch.ops.mkldnn._linear_pointwise(a, wm, None, "none", [], "")) / 1e9
        )
    out["peak"] = max(v for k, v in out.items() if k != "dtype")
    return out


def memory_bandwidth_gbs(mib: int = 1024) -> float:
    """Read bandwidth from memory: summing a tensor far larger than the caches (a decode step's ceiling)."""
    x = torch.ones(mib * 1024 * 1024 // 4)
    return x.numel() * 4 / median_time(x.sum, runs=5) / 1e9


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


class FlopCounter:
    """Model FLOPs of a decoder: 2 per weight per token for the body, the LM head only where sampled,
    plus attention (QK^T and PV) over each token's visible context."""

    def __init__(self, model):
        cfg = model.config
        self.hidden = cfg.hidden_size
        self.vocab = cfg.vocab_size
        self.layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.head_dim = model.head_dim
        # count from the linear shapes: packed (oneDNN) and int8 layers no longer hold a dense weight
        self.body_params = sum(
            m.in_features * m.out_features for m in model.model.layers.modules() if hasattr(m, "out_features")
        )
        self.windows = [getattr(layer.self_attn, "window", None) for layer in model.model.layers]
        self.kv_heads = cfg.num_key_value_heads

    def seen(self, context: int) -> int:
        """Keys each token attends to, summed over the layers (sliding-window layers see at most their window)."""
        return sum(min(context, w) if w else context for w in self.windows)

    def attention(self, context: int) -> int:
        return 4 * self.seen(context) * self.heads * self.head_dim

    def token(self, context: int, sampled: bool) -> int:
        return 2 * self.body_params + self.attention(context) + (2 * self.hidden * self.vocab if sampled else 0)


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
