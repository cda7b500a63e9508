"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from inferd.bench.metrics import itls, ttft  # noqa: E402
from inferd.bench.runner import LevelResult  # noqa: E402
from inferd.measure.stats import percentile  # noqa: E402


def _hist(ax, values_ms: Sequence[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    if not len(values_ms):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)), color="tab:blue", alpha=0.8)
    for p, style in ((50, "--"), (99, ":")):
        v = percentile(values_ms, p)
        ax.axvline(v, color="k", linestyle=style, label=f"p{p} {v:.1f} ms")
    ax.legend()


def plot_latency(res: LevelResult, path: Path) -> Path:
    ok = [t for t in res.timings if t.success]
    ttfts = [v * 1000 for t in ok if (v := ttft(t)) is not None]
    gaps = [g * 1000 for t in ok for g in itls(t)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    _hist(a, ttfts, f"TTFT ({len(ttfts)} requests)")
    _hist(b, gaps, f"ITL ({len(gaps)} gaps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(res: LevelResult, path: Path) -> Path:
    """One line per request: waiting for the first token, then streaming; failures in red."""
    fig, ax = plt.subplots(figsize=(11, max(3, min(12, len(res.timings) * 0.08))))
    order = sorted(range(len(res.timings)), key=lambda i: res.timings[i].send_time)
    for row, i in enumerate(order):
        t = res.timings[i]
        s, e = t.send_time - res.start, t.end_time - res.start
        if not t.success:
            ax.hlines(row, s, e, color="tab:red", linewidth=2)
            continue
        first = t.chunk_times[0] - res.start if t.chunk_times else e
        ax.hlines(row, s, first, color="tab:orange", linewidth=2)
        ax.hlines(row, first, e, color="tab:blue", linewidth=2)
    ax.plot([], [], color="tab:orange", label="send -> first token")
    ax.plot([], [], color="tab:blue", label="streaming")
    ax.plot([], [], color="tab:red", label="failed")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("request (by send time)")
    ax.set_title("Request timeline")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(runs: Sequence[dict], level_key: str, slos: dict[str, float] | None, path: Path) -> Path:
    """Latency against output throughput, one point per level, with the SLO as a horizontal line."""
    x = [r["output_throughput"] for r in runs]
    panels = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, label) in zip(axes, panels, strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [r[f"{stat}_{name}_ms"] for r in runs], style, label=f"{stat} {label}")
        for xi, r in zip(x, runs, strict=True):
            ax.annotate(f"{r.get(level_key)}", (xi, r[f"p99_{name}_ms"]), textcoords="offset points", xytext=(4, 4))
        if slos and name in slos:
            ax.axhline(slos[name], color="tab:red", linestyle=":", label=f"SLO {slos[name]:g} ms")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(f"{label} vs throughput (labels: {level_key})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _level_tag(res: LevelResult, multi: bool) -> str:
    if not multi:
        return ""
    rate = "inf" if res.level.request_rate == float("inf") else f"{res.level.request_rate:g}"
    return f"_rate{rate}_c{res.level.max_concurrency or 'max'}"


def write_plots(results: Sequence[LevelResult], result: dict, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    multi = len(results) > 1
    paths = []
    for res in results:
        tag = _level_tag(res, multi)
        paths.append(plot_latency(res, out_dir / f"{stem}{tag}_ttft_itl.png"))
        paths.append(plot_timeline(res, out_dir / f"{stem}{tag}_timeline.png"))
    if "runs" in result:
        key = result["sweep"]["level_key"]
        paths.append(plot_sweep(result["runs"], key, result.get("slo_ms"), out_dir / f"{stem}_sweep.png"))
    return paths
