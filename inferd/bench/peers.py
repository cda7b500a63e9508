"""The side-by-side results of `benchmarks/vs_peers.py` (benchmarks/results/vs_peers*.json), kept as runs.

One invocation of the script is one run: its date, the commit it ran, the CPU's model and flags, its command
line, the servers it started and their figures. Figures are compared only within a run (`pair`): the CPU,
the code and a shared machine's speed change from one invocation to the next, so a ratio between two runs
measures those as much as the servers.

A file written before each invocation was kept apart holds one record into which several invocations may
have merged their servers, dated by its last write. It reads as a single run marked `converted`, keeping
what the file says of itself (its date, machine and note) and leaving unknown what it does not (commit,
CPU flags, command line); the next invocation that writes the file appends its own run after it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

FORMAT = "runs"
CONVERTED = (
    "written before each invocation was kept as its own run: its servers and levels may come from different "
    "invocations, and its date is its last write's"
)
# the vector features that decide a CPU's speed here, as /proc/cpuinfo names them
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# what a converted record keeps of the file, besides its machine and date
_LEGACY_KEYS = ("note", "workloads", "workload", "servers", "ratios_best_inferd_over_peer", "targets")


def empty() -> dict:
    return {"format": FORMAT, "runs": []}


def as_runs(data: dict) -> dict:
    """A file's content in the runs format: as it is, or an older file's one record as a converted run."""
    if data.get("format") == FORMAT and isinstance(data.get("runs"), list):
        return data
    if not data:
        return empty()
    return {"format": FORMAT, "runs": [converted_run(data)]}


def converted_run(data: dict) -> dict:
    """An older file's merged record as one run, marked so, with what is known of it."""
    machine = data.get("machine", {})
    run = {
        "date": data.get("date"),
        "commit": None,
        "uncommitted_changes": None,
        "cpu": {"model": machine.get("cpu_model") or machine.get("processor"), "flags": None},
        "machine": machine,
        "command": None,
        "converted": CONVERTED,
    }
    run.update({key: data[key] for key in _LEGACY_KEYS if key in data})
    run.setdefault("servers", {})
    return run


def load(path: Path) -> dict:
    """The runs a summary file holds (none if it does not exist)."""
    if not path.exists():
        return empty()
    return as_runs(json.loads(path.read_text()))


def append_run(path: Path, run: dict, fresh: bool = False) -> dict:
    """The file's runs with `run` after them (`fresh`: `run` alone); the caller writes the result."""
    data = empty() if fresh else load(path)
    data["runs"].append(run)
    return data


def commit(repo: Path) -> tuple[str | None, bool | None]:
    """The commit checked out in `repo` and whether tracked files differ from it (None, None: not known)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return sha, (bool(status) if status is not None else None)


def cpu_record() -> dict:
    """This CPU's model and feature flags, as a run records them."""
    from inferd.bench.results import machine_info
    from inferd.models.dtypes import cpu_flags

    info = machine_info()
    return {"model": info.get("cpu_model") or info.get("processor"), "flags": sorted(cpu_flags())}


def command_line(argv: list[str], script: str = "benchmarks/vs_peers.py") -> str:
    """How the run was invoked, without this machine's interpreter path."""
    return shlex.join(["python", script, *argv[1:]])


def vector_flags(cpu: dict) -> str | None:
    """'avx2 avx512f avx512_bf16' of a run's CPU record; None where its flags were not recorded."""
    flags = cpu.get("flags")
    if flags is None:
        return None
    have = set(flags)
    return " ".join(f for f in VECTOR_FLAGS if f in have) or "none of " + " ".join(VECTOR_FLAGS)


def concurrency(key: str) -> int:
    """4 for "concurrency=4"."""
    return int(re.sub(r"\D", "", key))


def workload_name(entry: dict) -> str | None:
    """The workload a server's entry holds ("mixed" first), or None for the one-workload format."""
    names = list(entry.get("workloads", {}))
    return "mixed" if "mixed" in names else (names[0] if names else None)


def figures(entry: dict, workload: str | None) -> dict[str, dict]:
    """level -> figures of one server (the medians of its runs where it has several)."""
    if workload is None:
        return entry.get("levels", {})
    return {level: v["median"] for level, v in entry.get("workloads", {}).get(workload, {}).items()}


def pair(run: dict, a: str, b: str) -> tuple[str | None, list[str]]:
    """The workload and the levels (sorted) at which servers `a` and `b` both have figures in this one run."""
    servers = run.get("servers", {})
    if a not in servers or b not in servers:
        return None, []
    workload = workload_name(servers[b])
    levels = set(figures(servers[a], workload)) & set(figures(servers[b], workload))
    return workload, sorted(levels, key=concurrency)


def latest_pair(data: dict, a: str, others: tuple[str, ...]) -> tuple[int, str, str | None, list[str]] | None:
    """The newest run of a file in which `a` and one of `others` (the first that does) share a level: (the
    run's index, that server, the workload, the levels)."""
    for i in range(len(data["runs"]) - 1, -1, -1):
        for b in others:
            workload, levels = pair(data["runs"][i], a, b)
            if levels:
                return i, b, workload, levels
    return None
