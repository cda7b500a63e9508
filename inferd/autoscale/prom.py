"""A Prometheus server for a local fleet: its config, the replica lists it scrapes, and the process.

Replicas are found through `file_sd_configs`: one JSON file per pool in `targets_dir`, rewritten as
replicas come and go, each target labelled `pool="<name>"` (the label the autoscaler's queries select
on). Prometheus watches the files, so a new replica is scraped within a scrape interval.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from inferd.procs import die_with_parent

DEFAULT_BINARY = "prometheus"


def prometheus_config(targets_dir: Path, scrape_interval_s: float, extra_targets: list[str] = ()) -> dict:
    """Scrape every replica listed in `targets_dir/*.json` (and `extra_targets`, e.g. the autoscaler)."""
    interval = f"{max(1, round(scrape_interval_s * 1000))}ms"
    jobs = [
        {
            "job_name": "inferd-replicas",
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "file_sd_configs": [{"files": [str(targets_dir / "*.json")], "refresh_interval": "5s"}],
        }
    ]
    if extra_targets:
        jobs.append(
            {"job_name": "inferd-fleet", "scrape_interval": interval, "static_configs": [{"targets": extra_targets}]}
        )
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


def write_targets(targets_dir: Path, pool: str, urls: list[str]) -> None:
    """The pool's replicas for Prometheus (host:port each), written atomically."""
    targets = [u.split("://", 1)[-1].rstrip("/") for u in urls]
    path = targets_dir / f"{pool}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": targets, "labels": {"pool": pool}}]))
    os.replace(tmp, path)


@dataclass
class PrometheusProcess:
    popen: subprocess.Popen
    url: str
    workdir: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_prometheus(
    workdir: Path, port: int, scrape_interval_s: float, extra_targets: list[str] = (), timeout_s: float = 30.0
) -> PrometheusProcess:
    """Start `prometheus` on 127.0.0.1:`port`, storing in `workdir`, and wait until it is ready. It ends when
    the thread that started it does (`die_with_parent`), however the process ends."""
    binary = shutil.which(DEFAULT_BINARY)
    if binary is None:
        raise FileNotFoundError("no `prometheus` on PATH (Debian: apt-get install prometheus)")
    targets = workdir / "targets"
    targets.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets, scrape_interval_s, list(extra_targets))))
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
    ]
    log = (workdir / "prometheus.log").open("wb")
    popen = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent()
    )
    log.close()
    proc = PrometheusProcess(popen, f"http://127.0.0.1:{port}", workdir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            if httpx.get(proc.url + "/-/ready", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"prometheus not ready after {timeout_s:g}s")
