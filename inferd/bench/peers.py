"""The side-by-side results of `benchmarks/vs_peers.py` (benchmarks/results/vs_peers-<kind>.json), kept as runs.

One invocation of the script is one run (`inferd.bench.runs`): its date, the commit it ran, the CPU's model
and flags, its command line, the servers it started and their figures. Figures are compared only within a
run (`pair`): the CPU, the code and a shared machine's speed change from one invocation to the next, so a
ratio between two runs measures those as much as the servers.

A file written before each invocation was kept apart holds one record into which several invocations may
have merged their servers, dated by its last write. It reads as a single run marked `converted`, keeping
what the file says of itself (its date, machine and note) and leaving unknown what it does not (commit,
CPU flags, command line); the next invocation that writes the file appends its own run after it.

`targets` checks inferd's speed targets within one run. `newest_pair_file` picks the file to show a pair of
servers from; `peer_python` and `importable` find a peer's own environment and whether it runs;
`run_side_by_side` runs the script with a deadline and returns its run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from inferd import cpu, procs
from inferd.bench import runs
from inferd.bench.runs import FORMAT, empty

CONVERTED = (
    "written before each invocation was kept as its own run: its servers and levels may come from different "
    "invocations, and its date is its last write's"
)
# what a converted record keeps of the file, besides its machine and date
_LEGACY_KEYS = ("note", "workloads", "workload", "servers", "ratios_best_inferd_over_peer", "targets")


def as_runs(data: dict) -> dict:
    """A file's content in the runs format: as it is, or an older file's one record as a converted run."""
    if runs.is_runs(data):
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
    return runs.load(path, converted_run)


def append_run(path: Path, run: dict, fresh: bool = False) -> dict:
    """The file's runs with `run` after them (`fresh`: `run` alone); the caller writes the result."""
    return runs.append_run(path, run, fresh, converted_run)


def vector_flags(cpu_rec: dict) -> str | None:
    """'avx2 avx512f avx512_bf16' of a run's CPU record; None where its flags were not recorded."""
    return cpu.vector_flags(cpu_rec.get("flags"))


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


def level_figures(servers: dict, workload: str | None = None) -> dict[str, dict[int, dict]]:
    """server -> concurrency -> median figures, for a run's servers that have no error: of `workload`, or
    where None of each server's own (`workload_name`)."""
    return {
        name: {concurrency(k): v for k, v in figures(entry, workload or workload_name(entry)).items()}
        for name, entry in servers.items()
        if not entry.get("error")
    }


@dataclass(frozen=True)
class Target:
    """One of inferd's speed targets, checked within one run: output throughput over the peer's (`ratio`),
    mean TTFT over the peer's where the target bounds it."""

    name: str
    ratio: float
    goal: float
    ttft_ratio: float | None = None

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal and (self.ttft_ratio is None or self.ttft_ratio < 1.0)


def _fastest(figs: dict[str, dict[int, dict]], level: int, names) -> str | None:
    found = [n for n in names if level in figs.get(n, {})]
    return max(found, key=lambda n: figs[n][level]["output_throughput"], default=None)


def targets(figs: dict[str, dict[int, dict]]) -> list[Target]:
    """inferd's speed targets in one run (`figs`: `level_figures`), those its servers and levels allow:
    - concurrency 16 and 32: `inferd serve` with no flags (server "inferd") at 1.5x the output throughput of
      vLLM in its faster dtype of the run (bf16 where the CPU has it, fp32 on AVX2), with a lower mean TTFT;
    - concurrency 1: the same server at 1.3x llama-server's;
    - every level: inferd's fastest mode ahead of the fastest peer."""
    out = []
    levels = sorted({c for f in figs.values() for c in f})
    vllm = [n for n in figs if n.startswith("vllm")]
    for c in (16, 32):
        peer = _fastest(figs, c, vllm)
        if peer and c in figs.get("inferd", {}):
            mine, theirs = figs["inferd"][c], figs[peer][c]
            ttft = mine.get("mean_ttft_ms"), theirs.get("mean_ttft_ms")
            r = mine["output_throughput"] / theirs["output_throughput"]
            out.append(Target(f"c={c}, no flags over {peer}", r, 1.5, ttft[0] / ttft[1] if all(ttft) else None))
    if 1 in figs.get("inferd", {}) and 1 in figs.get("llama-server", {}):
        r = figs["inferd"][1]["output_throughput"] / figs["llama-server"][1]["output_throughput"]
        out.append(Target("c=1, no flags over llama-server", r, 1.3))
    for c in levels:
        mine = _fastest(figs, c, [n for n in figs if n.startswith("inferd")])
        theirs = _fastest(figs, c, [n for n in figs if not n.startswith("inferd")])
        if mine and theirs:
            r = figs[mine][c]["output_throughput"] / figs[theirs][c]["output_throughput"]
            out.append(Target(f"c={c}, fastest ({mine}) over fastest peer ({theirs})", r, 1.0))
    return out


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


def newest_pair_file(results: Path, kind: str, a: str, others: tuple[str, ...]) -> Path:
    """The summary file to show a pair from: this CPU kind's where it holds a run in which `a` and one of
    `others` share a level, else the file whose newest such run is the newest (this kind's file, missing,
    where no file has one)."""
    own = results / runs.file_name("vs_peers", kind)
    newest: tuple[str, Path] | None = None
    for path in [own, *sorted(p for p in results.glob("vs_peers-*.json") if p != own)]:
        data = load(path)
        found = latest_pair(data, a, others)
        if found is None:
            continue
        if path == own:
            return own
        date = data["runs"][found[0]].get("date") or ""
        if newest is None or date > newest[0]:
            newest = (date, path)
    return newest[1] if newest else own


def peers_dir() -> Path:
    """Where `benchmarks/vs_peers.py --setup <peer>` gives each peer its own virtual environment:
    ~/.cache/inferd-peers, or $INFERD_PEERS_DIR."""
    return Path(os.environ.get("INFERD_PEERS_DIR", Path.home() / ".cache" / "inferd-peers"))


def peer_python(peer: str) -> Path:
    """The interpreter of a peer's own virtual environment."""
    return peers_dir() / peer / "bin" / "python"


def llama_cpp_build_dir() -> Path:
    """Where `vs_peers.py --setup llama-server` builds llama.cpp: `build`, or `build-<cap>` under
    `INFERD_MAX_CPU_ISA`, whose build takes only the CPU features below the cap (a Zen 3's or a Zen 4's
    llama.cpp on a bigger CPU, beside the capped inferd)."""
    cap = cpu.isa_cap()
    return peers_dir() / "llama.cpp" / (f"build-{cap}" if cap else "build")


def llama_cpp_bin(tool: str) -> Path:
    """A llama.cpp program (llama-server, llama-perplexity, llama-tokenize) as `vs_peers.py --setup
    llama-server` builds it."""
    return llama_cpp_build_dir() / "bin" / tool


def importable(python: Path, module: str, name: str, timeout_s: float) -> str | None:
    """None when `python` imports `module` (`name` in the text); else why not, in a sentence."""
    try:
        done = subprocess.run(
            [str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"importing {name} with {home_path(python)} took over {timeout_s:.0f} s"
    except OSError as e:
        return f"{home_path(python)} does not run ({e})"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return f"{home_path(python)} cannot import {name} ({last})"


def home_path(path: Path) -> str:
    """A path as text shows it: the home folder as ~, so a page written from the text names no user."""
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


class RunFailed(Exception):
    """A side-by-side run that left no run with figures: why, and where its log is."""


def run_side_by_side(
    script: Path, servers: list[str], args: list[str], out: Path, log: Path, timeout_s: float, grace_s: float
) -> dict:
    """`script` (benchmarks/vs_peers.py) with `servers` up at once, its runs file at `out`: the run it added.
    It runs under `inferd.procs.run_bounded` (interrupted past `timeout_s`, killed `grace_s` later: never left
    running); `RunFailed` when it failed, timed out, wrote no run, or a server of that run has an error."""
    cmd = [sys.executable, str(script), "--servers", ",".join(servers), *args, "--out", str(out)]
    name = f"{script.parent.name}/{script.name}"
    try:
        rc = procs.run_bounded(cmd, log, timeout_s, grace_s, cwd=script.parents[1])
    except subprocess.TimeoutExpired:
        raise RunFailed(f"no result after {timeout_s:.0f} s (log: {log})") from None
    if rc:
        written = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        raise RunFailed(f"{name} exited with {rc}: {(written or ['no output'])[-1]} (log: {log})")
    if not (found := load(out)["runs"]):
        raise RunFailed(f"{name} wrote no run to {out} (log: {log})")
    if errors := [f"{server}: {e['error']}" for server, e in found[-1]["servers"].items() if e.get("error")]:
        raise RunFailed("; ".join(errors))
    return found[-1]
