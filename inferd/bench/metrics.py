"""Pure functions on request timings, with vLLM's serving-benchmark definitions (as in vLLM's benchmarks/serve.py).

Percentiles are `inferd.measure.stats.percentile`'s, numpy's linear interpolation as vLLM reports them.

TTFT: send -> first token chunk. TPOT: (E2EL - TTFT) / (output tokens - 1), so the first token is excluded.
ITL: every gap between consecutive token chunks. E2EL: send -> end of stream. Goodput: requests per second
that meet every SLO given. All times are seconds in; the summaries are milliseconds out, as vLLM reports.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from inferd.measure.stats import percentile

DEFAULT_PERCENTILES = (90.0, 95.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTiming:
    """What one request measured; `chunk_times` are the arrival times of chunks that carried text."""

    send_time: float
    end_time: float
    chunk_times: list[float] = field(default_factory=list)
    success: bool = True
    error: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0


def ttft(t: RequestTiming) -> float | None:
    return t.chunk_times[0] - t.send_time if t.chunk_times else None


def itls(t: RequestTiming) -> list[float]:
    """One gap per pair of consecutive token chunks (a chunk with several tokens is still one gap)."""
    return [b - a for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)]


def e2el(t: RequestTiming) -> float:
    return t.end_time - t.send_time


def tpot(t: RequestTiming) -> float | None:
    """Time per output token after the first; undefined for fewer than two tokens."""
    first = ttft(t)
    if first is None or t.output_tokens < 2:
        return None
    return (e2el(t) - first) / (t.output_tokens - 1)


@dataclass(frozen=True)
class Summary:
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    def as_fields(self, name: str) -> dict[str, float]:
        """vLLM's field names: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms ..."""
        out = {f"mean_{name}_ms": self.mean, f"median_{name}_ms": self.median, f"std_{name}_ms": self.std}
        for p, v in self.percentiles.items():
            out[f"p{_pct_label(p)}_{name}_ms"] = v
        return out


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize_ms(values_s: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Summary:
    """Seconds in, milliseconds out; an empty list summarizes to zeros, as vLLM does, so JSON stays numeric."""
    if len(values_s) == 0:
        return Summary(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return Summary(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles={p: percentile(ms, p) for p in percentiles},
    )


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO {spec!r} must be NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        ms = float(value)
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"SLO {spec!r}: the limit must be a positive number of milliseconds")
        slos[name] = ms
    return slos


def meets_slos(t: RequestTiming, slos: dict[str, float]) -> bool:
    """A successful request meets the SLOs when every given metric is at or under its limit.

    As in vLLM, a request with a single output token has no TPOT and counts as TPOT 0.
    """
    if not t.success:
        return False
    values = {"ttft": ttft(t), "tpot": tpot(t) or 0.0, "e2el": e2el(t)}
    for name, limit_ms in slos.items():
        v = values[name]
        if v is None or v * 1000.0 > limit_ms:
            return False
    return True


def peak_output_throughput(timings: Sequence[RequestTiming], start: float) -> float:
    """Most output tokens in any one-second bucket since `start` (vLLM's max_output_tokens_per_s).

    Each chunk carries output_tokens / chunks tokens, so servers that batch tokens into chunks count right.
    """
    counts: Counter[int] = Counter()
    for t in timings:
        if not t.success or not t.chunk_times:
            continue
        per_chunk = t.output_tokens / len(t.chunk_times)
        for c in t.chunk_times:
            counts[int(c - start)] += per_chunk
    return float(max(counts.values(), default=0.0))


def peak_concurrency(timings: Sequence[RequestTiming]) -> int:
    """Most requests in flight at once, from exact send and end times."""
    # at equal times, ends (-1) sort before sends (+1): a request that ends as another starts does not overlap
    events = sorted([(t.send_time, 1) for t in timings] + [(t.end_time, -1) for t in timings])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


@dataclass
class RunMetrics:
    """The aggregate of one run, in vLLM's field names (`as_dict`) plus ours."""

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary
    errors: dict[str, int]
    slos: dict[str, float]
    good_completed: int
    request_goodput: float | None
    output_goodput: float | None
    total_token_goodput: float | None

    def as_dict(self) -> dict:
        d = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            d.update(getattr(self, name).as_fields(name))
        d.update(
            errors_by_type=self.errors,
            slo_ms=self.slos or None,
            good_completed=self.good_completed,
            slo_attainment=(self.good_completed / (self.completed + self.failed)) if self.slos else None,
            output_goodput=self.output_goodput,
            total_token_goodput=self.total_token_goodput,
        )
        return d


def error_kind(error: str | None) -> str:
    """'HTTP 404: model x not found' -> 'HTTP 404'; the part before the first colon names the kind."""
    return (error or "unknown error").split(":", 1)[0].strip()


def compute_run_metrics(
    timings: Sequence[RequestTiming],
    start: float,
    end: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> RunMetrics:
    """Aggregate one run. Duration is `end - start` (first send to last completion); failures count as sent."""
    slos = slos or {}
    ok = [t for t in timings if t.success]
    duration = max(end - start, 1e-9)
    total_in = sum(t.input_tokens for t in ok)
    total_out = sum(t.output_tokens for t in ok)
    good = [t for t in ok if meets_slos(t, slos)] if slos else []
    good_out = sum(t.output_tokens for t in good)
    good_in = sum(t.input_tokens for t in good)
    return RunMetrics(
        duration=duration,
        completed=len(ok),
        failed=len(timings) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=peak_output_throughput(ok, start),
        max_concurrent_requests=peak_concurrency(timings),
        ttft=summarize_ms([v for t in ok if (v := ttft(t)) is not None], percentiles),
        tpot=summarize_ms([v for t in ok if (v := tpot(t)) is not None], percentiles),
        itl=summarize_ms([g for t in ok for g in itls(t)], percentiles),
        e2el=summarize_ms([e2el(t) for t in ok], percentiles),
        errors=dict(Counter(error_kind(t.error) for t in timings if not t.success)),
        slos=dict(slos),
        good_completed=len(good),
        request_goodput=len(good) / duration if slos else None,
        output_goodput=good_out / duration if slos else None,
        total_token_goodput=(good_in + good_out) / duration if slos else None,
    )
