"""This machine's ceilings, measured rather than looked up: the matmul peak and the memory read bandwidth.

A roofline needs both, and a step is judged against them (a decode step's share of the bandwidth, a
prefill's share of the peak), so the labs and the benchmarks take them from here, measured one way:

- the matmul peak: FLOP/s of a large square matmul in the dtype asked for, the faster of torch's dense
  path and, for float32 on a CPU, oneDNN's packed linear (what the engine's fp32 layers run on);
- the memory bandwidth: bytes/s read by summing a tensor far larger than the caches, a decode step's
  ceiling (a step reads its weights and KV cache and writes little); a copy would count the writes too,
  and on a CPU its write-allocate reads go uncounted.

Each probe keeps the fastest of its timed runs: a ceiling is what the least disturbed run reached.
`measure_hardware` takes both at once (`Hardware`, with the ridge point where the roofs meet).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device | str = "cpu", runs: int = 5, warmup: int = 1) -> float:
    """Seconds of the fastest of `runs` timed calls after `warmup` untimed ones (the device synchronized)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(
    n: int = 2048, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", runs: int = 5
) -> dict[str, float | str]:
    """FLOP/s of an n x n matmul in `dtype`: `dense_mm` (torch's `a @ b`), `onednn` (float32 on a CPU with
    oneDNN: the packed linear the engine's fp32 layers use) and `peak`, the faster of them."""
    device = torch.device(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    flops = 2 * n**3
    out: dict[str, float | str] = {"dtype": str(dtype).removeprefix("torch.")}
    out["dense_mm"] = flops / best_time(lambda: a @ b, device, runs)
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = b.t().contiguous().to_mkldnn()
        linear = torch.ops.mkldnn._linear_pointwise
        out["onednn"] = flops / best_time(lambda: linear(a, packed, None, "none", [], ""), device, runs)
    out["peak"] = max(v for k, v in out.items() if k != "dtype")
    return out


def memory_bandwidth(nbytes: int = 512 * 2**20, device: torch.device | str = "cpu", runs: int = 5) -> float:
    """Bytes/s read from memory: a float32 tensor of `nbytes` (far past the last-level cache) summed."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=torch.device(device))
    return x.numel() * 4 / best_time(x.sum, device, runs)


@dataclass(frozen=True)
class Hardware:
    """This machine's two roofs, measured: the matmul peak and the memory bandwidth, and where they meet."""

    device: str
    dtype: str
    matmul_flops: float  # FLOP/s of a large square matmul in the dtype
    matmul_n: int
    memory_bandwidth: float  # bytes/s read from memory
    probe_bytes: int  # of the tensor the bandwidth was read from

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the two roofs meet: below it a kernel is bandwidth-bound, above compute-bound."""
        return self.matmul_flops / self.memory_bandwidth


def measure_hardware(device: torch.device, dtype: torch.dtype, n: int, nbytes: int, runs: int) -> Hardware:
    """Both roofs on `device`: an n x n matmul in `dtype`, a read of `nbytes`, each the fastest of `runs`."""
    flops = float(matmul_peak(n, dtype, device, runs)["peak"])
    return Hardware(
        device.type, str(dtype).removeprefix("torch."), flops, n, memory_bandwidth(nbytes, device, runs), nbytes
    )
