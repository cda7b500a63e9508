"""A benchmark's results file: one per benchmark and CPU kind, each invocation one run inside it.

`benchmarks/results/<benchmark>-<kind>.json` (`vs_peers-zen5.json`, `quality-xeon-amx.json`; the kinds are
`inferd.cpu.KINDS`) holds `{"format": "runs", "runs": [...]}`. Each run says when it ran (`date`, UTC), on
what code (`commit`, `uncommitted_changes`), on what CPU (`cpu`: model and flags; `cpu_kind`) and how it was
invoked (`command`), then holds the benchmark's own figures. An invocation appends its run and leaves the
earlier ones as they are, so one file carries a benchmark's measurements on one kind of CPU over time, and
`benchmarks/report.py` renders the documents' figures from the newest of them.

A run converted from a file of the earlier layout (one result per file, named after when it was taken)
says so in `converted`, and keeps what that file knew: where it did not record a date, `date` is the day the
file was committed (`date_source` says which); commit, flags and command stay unknown (None) rather than
guessed.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from inferd.cpu import MAX_ISA_ENV, cpu_flags, cpu_identity, cpu_kind, isa_cap

FORMAT = "runs"
DATE_FORMAT = "%Y-%m-%d %H:%M UTC"


def file_name(benchmark: str, kind: str | None = None) -> str:
    """`vs_peers-zen5.json`: the results file of `benchmark` for a kind of CPU (this one's by default; not
    while `INFERD_MAX_CPU_ISA` caps it, since a capped CPU is not the kind it stands in for)."""
    if kind is None and isa_cap():
        raise RuntimeError(
            f"{MAX_ISA_ENV}={isa_cap()} runs this CPU below its own kind; results files are kept per real kind, "
            "so name another file for this run (--out)"
        )
    return f"{benchmark}-{kind or cpu_kind()}.json"


def empty() -> dict:
    return {"format": FORMAT, "runs": []}


def is_runs(data: dict) -> bool:
    return data.get("format") == FORMAT and isinstance(data.get("runs"), list)


def load(path: Path, convert: Callable[[dict], dict] | None = None) -> dict:
    """The runs a results file holds (none if it does not exist); a file of the earlier layout reads as the
    one run `convert` makes of it."""
    if not path.exists():
        return empty()
    data = json.loads(path.read_text())
    if is_runs(data):
        return data
    if not data:
        return empty()
    if convert is None:
        raise ValueError(f"{path} is not a runs file (no 'format': 'runs')")
    return {"format": FORMAT, "runs": [convert(data)]}


def append_run(path: Path, run: dict, fresh: bool = False, convert: Callable[[dict], dict] | None = None) -> dict:
    """The file's runs with `run` after them (`fresh`: `run` alone); the caller writes the result."""
    data = empty() if fresh else load(path, convert)
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

    info = machine_info()
    return {"model": info.get("cpu_model") or info.get("processor"), "flags": sorted(cpu_flags())}


def command_line(argv: list[str], script: str) -> str:
    """How the run was invoked, without this machine's interpreter path: `script` is what follows `python`
    ("benchmarks/vs_peers.py", or "-m benchmarks.quality")."""
    return shlex.join(["python", *script.split(), *argv[1:]])


def header(command: str, repo: Path, started: float | None = None) -> dict:
    """What every run records before its figures: date, commit, CPU, machine, command."""
    from inferd.bench.results import machine_info

    sha, dirty = commit(repo)
    return {
        "date": time.strftime(DATE_FORMAT, time.gmtime(started if started is not None else time.time())),
        "commit": sha,
        "uncommitted_changes": dirty,
        "cpu": cpu_record() | {"vendor": cpu_identity()["vendor"], "family": cpu_identity()["family"]},
        "cpu_kind": cpu_kind(),
        **({"max_cpu_isa": isa_cap()} if isa_cap() else {}),
        "machine": machine_info(),
        "command": command,
    }


def run_kind(run: dict) -> str | None:
    """The CPU kind a run was measured on: as it recorded it, else from its CPU flags (None: not known)."""
    if run.get("cpu_kind"):
        return run["cpu_kind"]
    cpu = run.get("cpu") or {}
    if cpu.get("flags") is None:
        return None
    return cpu_kind(cpu["flags"], cpu.get("vendor"), cpu.get("family"))
