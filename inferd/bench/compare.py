"""`inferd bench compare A.json B.json ...`: runs side by side, with each run's ratio to the first.

Sweeps are compared level by level (the same concurrency or rate in every file); single runs are one level.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from inferd.bench.report import wide_console
from inferd.errors import InferdError

# (field, higher is better)
METRICS: tuple[tuple[str, bool], ...] = (
    ("completed", True),
    ("failed", False),
    ("duration", False),
    ("request_throughput", True),
    ("output_throughput", True),
    ("total_token_throughput", True),
    ("max_output_tokens_per_s", True),
    ("request_goodput", True),
    ("slo_attainment", True),
    ("mean_ttft_ms", False),
    ("median_ttft_ms", False),
    ("p99_ttft_ms", False),
    ("mean_tpot_ms", False),
    ("median_tpot_ms", False),
    ("p99_tpot_ms", False),
    ("mean_itl_ms", False),
    ("p99_itl_ms", False),
    ("mean_e2el_ms", False),
    ("p99_e2el_ms", False),
    ("cost_per_million_output_tokens", False),
    ("goodput_cost_per_million_output_tokens", False),
)


def load(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InferdError(f"cannot read benchmark result {path}: {e}") from e


def levels(result: dict) -> dict[str, dict]:
    """Level name -> flat run dict. 'run' for a single run; 'max_concurrency=4' etc. for a sweep."""
    if "runs" not in result:
        return {"run": result}
    key = result["sweep"]["level_key"]
    return {f"{key}={r.get(key)}": r for r in result["runs"]}


def ratio(a, b) -> float | None:
    """a / b where both are numbers and b is not zero."""
    if not isinstance(a, int | float) or not isinstance(b, int | float) or isinstance(a, bool) or b == 0:
        return None
    return a / b


def ratios(a: dict, b: dict, metrics: Sequence[str] | None = None) -> dict[str, float | None]:
    names = metrics or [m for m, _ in METRICS]
    return {m: ratio(a.get(m), b.get(m)) for m in names}


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def level_table(level: str, labels: Sequence[str], runs: Sequence[dict | None]) -> Table:
    t = Table(title=f"{level}", title_style="bold")
    t.add_column("metric")
    for i, label in enumerate(labels):
        t.add_column(label, justify="right")
        if i:
            t.add_column(f"{label} / {labels[0]}", justify="right")
    base = runs[0]
    for name, higher in METRICS:
        if all(r is None or r.get(name) is None for r in runs):
            continue
        cells = []
        for i, r in enumerate(runs):
            v = None if r is None else r.get(name)
            cells.append(_fmt(v))
            if i:
                q = ratio(v, None if base is None else base.get(name))
                cells.append("-" if q is None else f"{q:.2f}x")
        t.add_row(f"{name} {'↑' if higher else '↓'}", *cells)
    return t


def compare(paths: Sequence[str | Path], console: Console | None = None) -> dict[str, dict[str, dict]]:
    """Print one table per level found in more than one file; returns {level: {label: ratios to the first}}."""
    if len(paths) < 2:
        raise InferdError("compare needs at least two result files")
    console = console or wide_console()
    results = [load(p) for p in paths]
    labels = [r.get("label") or Path(p).stem for r, p in zip(results, paths, strict=True)]
    per_file = [levels(r) for r in results]
    names = list(dict.fromkeys(n for lv in per_file for n in lv))
    out: dict[str, dict[str, dict]] = {}
    for name in names:
        runs = [lv.get(name) for lv in per_file]
        if sum(r is not None for r in runs) < 2:
            continue
        console.print(level_table(name, labels, runs))
        if runs[0] is not None:
            out[name] = {lab: ratios(r, runs[0]) for lab, r in zip(labels[1:], runs[1:], strict=True) if r}
    if not out:
        console.print("the files share no level (a single run, or the same concurrency or rate in a sweep)")
    return out
