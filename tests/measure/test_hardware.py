"""The hardware probes run and report what they say; only they pull in torch."""

from __future__ import annotations

import subprocess
import sys

import torch

from inferd.measure.hardware import best_time, matmul_peak, memory_bandwidth


def test_the_matmul_peak_is_the_faster_path():
    out = matmul_peak(64, torch.float32, runs=1)
    assert out["dtype"] == "float32" and out["dense_mm"] > 0
    assert out["peak"] == max(v for k, v in out.items() if k != "dtype")
    assert "onednn" not in matmul_peak(64, torch.bfloat16, runs=1)  # oneDNN's packed linear is float32's


def test_bandwidth_is_bytes_read_over_the_fastest_sum():
    assert memory_bandwidth(2**20, runs=2) > 0
    calls = []
    assert best_time(lambda: calls.append(1), runs=3, warmup=2) >= 0 and len(calls) == 5


def test_only_the_hardware_probes_import_torch():
    """The server, `inferd bench` and the autoscaler import the rest without torch (docs/architecture.md)."""
    code = (
        "import sys, inferd.measure.stats, inferd.measure.arrivals, inferd.measure.model; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
