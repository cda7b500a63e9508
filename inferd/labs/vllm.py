"""vLLM: inferd against vLLM's CPU build on the same workload. vLLM installs into its own environment and
takes minutes to start, so this lab reads the stored side-by-side result (benchmarks/results/vs_peers.json:
same prompts, same machine, one run) and says how to measure it on this machine."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from inferd.errors import InferdError
from inferd.labs.base import Explanation, Lab, Measurement, decide
from inferd.labs.context import LabContext

DEFINITION = (
    "open-source, PagedAttention plus continuous batching, OpenAI-compatible server. The fast path to a running "
    "endpoint and the default starting point."
)
REPO = Path(__file__).resolve().parents[2]
STORED = REPO / "benchmarks" / "results" / "vs_peers.json"
PEER_PYTHON = Path.home() / ".cache" / "inferd-peers" / "vllm" / "bin" / "python"
HOW_TO_RUN = (
    "python benchmarks/vs_peers.py --setup model && python benchmarks/vs_peers.py --setup vllm && "
    "python benchmarks/vs_peers.py --servers inferd,vllm"
)


def _level(key: str) -> int:
    return int(re.sub(r"\D", "", key))


def _workload_name(entry: dict) -> str | None:
    """The workload a summary holds for a server ("mixed" first), or None for the older one-workload format."""
    names = list(entry.get("workloads", {}))
    return "mixed" if "mixed" in names else (names[0] if names else None)


def _figures(entry: dict) -> dict[str, dict]:
    """level -> figures for one server, in either summary format (medians of runs in the newer one)."""
    name = _workload_name(entry)
    if name is None:
        return entry["levels"]
    return {level: v["median"] for level, v in entry["workloads"][name].items()}


def _workload_text(data: dict, entry: dict) -> str:
    name = _workload_name(entry)
    if name is None:
        w = data["workload"]
        return f"{w['input_len']}-token prompts and {w['output_len']} tokens out"
    return f"the same prompts (the {name} workload: {data['workloads'][name]})"


def _stored_date(path: Path) -> str:
    """The run's date, from the vLLM result file beside the summary (20261129-143303 -> 2026-11-29 14:33)."""
    detail = path.parent / "vs_peers" / "vllm.json"
    try:
        d = json.loads(detail.read_text())["date"]
        return f"{d[0:4]}-{d[4:6]}-{d[6:8]} {d[9:11]}:{d[11:13]}"
    except (OSError, KeyError, ValueError, IndexError):
        return "unknown date"


def measure(ctx: LabContext, stored: Path = STORED) -> Measurement:
    m = Measurement(settings={"stored": str(stored.relative_to(REPO)) if stored.is_relative_to(REPO) else str(stored)})
    m.settings["vllm_installed"] = PEER_PYTHON.exists() or importlib.util.find_spec("vllm") is not None
    m.settings["how_to_run"] = HOW_TO_RUN
    if not stored.exists():
        raise InferdError(f"no stored vLLM result at {stored}; measure one with: {HOW_TO_RUN}")
    data = json.loads(stored.read_text())
    servers = data["servers"]
    by_level = {name: _figures(servers[name]) for name in ("inferd", "vllm")}
    levels = sorted(set(by_level["vllm"]) & set(by_level["inferd"]), key=_level)  # a level one of them lacks: skip
    if not levels:
        raise InferdError(f"{stored} has no concurrency level measured for both inferd and vLLM; run: {HOW_TO_RUN}")
    m.settings.update(machine=data["machine"], workload=_workload_text(data, servers["vllm"]))
    m.settings["date"] = data.get("date") or _stored_date(stored)
    m.series = {"concurrency": [_level(k) for k in levels]}
    for name in ("inferd", "vllm"):
        m.series[name] = [by_level[name][k]["output_throughput"] for k in levels]
        m.series[name + "_ttft_ms"] = [by_level[name][k]["mean_ttft_ms"] for k in levels]
    lo, hi = levels[0], levels[-1]
    for side, key in (("lo", lo), ("hi", hi)):
        m.numbers[f"c_{side}"] = _level(key)
        for name in ("inferd", "vllm"):
            m.numbers[f"{name}_tok_s_{side}"] = by_level[name][key]["output_throughput"]
    m.numbers["ratio_hi"] = m.numbers["inferd_tok_s_hi"] / m.numbers["vllm_tok_s_hi"]
    m.numbers["vllm_gain"] = m.numbers["vllm_tok_s_hi"] / m.numbers["vllm_tok_s_lo"]
    return m


def explain(m: Measurement) -> Explanation:
    n, s = m.numbers, m.settings
    machine = s["machine"]
    cpu = machine.get("cpu_model") or machine.get("processor")
    claims = [
        decide(
            n,
            "vllm_tok_s_hi > vllm_tok_s_lo",
            yes="vLLM's output throughput rose from {vllm_tok_s_lo} tokens/s at concurrency {c_lo} to {vllm_tok_s_hi} "
            "at {c_hi}: continuous batching over PagedAttention, as in inferd.",
            no="vLLM's output throughput did not rise with concurrency: {vllm_tok_s_lo} at {c_lo}, {vllm_tok_s_hi} "
            "at {c_hi}.",
        ),
        decide(
            n,
            "inferd_tok_s_hi >= vllm_tok_s_hi",
            textbook=False,
            yes="At concurrency {c_hi} inferd reached {inferd_tok_s_hi} tokens/s against vLLM's {vllm_tok_s_hi}.",
            no="At concurrency {c_hi} inferd reached {inferd_tok_s_hi} tokens/s against vLLM's {vllm_tok_s_hi} "
            "({ratio_hi} of it): vLLM is ahead there.",
        ),
    ]
    installed = (
        "vLLM is installed here, so you can measure it on this machine"
        if s["vllm_installed"]
        else "vLLM is not installed here; to measure it on this machine (a download and 3-5 minutes of start-up)"
    )
    intro = [
        f"vLLM, in the glossary's words: {DEFINITION}",
        f"These numbers are stored, not measured now: {s['stored']}, run on {cpu} with "
        f"{machine.get('cpu_count')} cores on {s['date']}, serving Gemma 3 270M to both servers with "
        f"{s['workload']}. Compare only "
        "figures from one run: the CPU generation changes from machine to machine.",
        f"{installed}: {s['how_to_run']}",
    ]
    why = [
        "Why it matters: vLLM is the reference point a platform is measured against: the OpenAI API, "
        "PagedAttention, continuous batching and prefix caching are what users expect of any engine behind it."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots(1, 1)
    s = m.series
    xs = range(len(s["concurrency"]))
    ax.bar([x - 0.2 for x in xs], s["inferd"], width=0.4, label="inferd")
    ax.bar([x + 0.2 for x in xs], s["vllm"], width=0.4, label="vLLM CPU")
    ax.set_xticks(list(xs), [str(c) for c in s["concurrency"]])
    ax.set(xlabel="concurrency", ylabel="output tokens/s", title=f"Stored result ({m.settings['date']})")
    ax.legend()


LAB = Lab("vllm", "vLLM", DEFINITION, measure, explain, plot, measured_here=False)
