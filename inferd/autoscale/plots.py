"""PNG plots of simulated runs: load, replicas and TTFT over time (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402


def plot_runs(runs: dict[str, dict[str, list[float]]], path: Path, ttft_slo_s: float | None = None) -> Path:
    """One column of three panels shared in time, one line per run: arrival rate, replicas, TTFT p95."""
    fig, (load, reps, lat) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    hours = max((max(tl["t"], default=0) for tl in runs.values()), default=0) > 3 * 3600
    for i, (name, tl) in enumerate(runs.items()):
        t = np.asarray(tl["t"], dtype=float)
        x = t / 3600 if hours else t
        if i == 0:  # the same arrivals for every run
            load.plot(x, tl["arrival_rate"], color="tab:gray", lw=0.8)
        reps.step(x, tl["replicas"], where="post", label=f"{name}: replicas")
        lat.plot(x, np.asarray(tl["ttft_p95_s"], dtype=float) * 1000, lw=0.6, alpha=0.7, label=name)
    load.set_ylabel("arrivals / s")
    reps.set_ylabel("replicas")
    reps.legend(loc="upper left")
    lat.set_ylabel("TTFT p95 per interval (ms)")
    lat.set_yscale("log")
    if ttft_slo_s is not None:
        lat.axhline(ttft_slo_s * 1000, color="k", ls="--", lw=0.8, label="SLO")
    lat.legend(loc="upper left")
    lat.set_xlabel("hours" if hours else "seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
