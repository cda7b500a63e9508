"""Workloads for the simulator and the planner: when requests arrive and how long they are.

Arrivals are generated (`poisson`, `gamma` with a burstiness as `inferd bench` and vLLM use, `diurnal`: a
day's sine of the rate with optional bursts, `constant`: evenly spaced) or read from a trace file: CSV with
a header naming a time column (`timestamp`, `time`, `t` or `arrival`, seconds or ISO dates) and token
columns (`prompt_tokens`/`input_tokens`/`ContextTokens`, `output_tokens`/`GeneratedTokens`, as in the
Azure LLM inference traces), or JSON lines with the same keys. Lengths are `fixed:N`, `uniform:A:B`,
`exponential:MEAN` (geometric, at least 1) or `lognormal:MEAN:SIGMA`.

A spec string names a generator and its parameters: `poisson:rate=5,duration=600`,
`gamma:rate=5,burstiness=0.3,duration=600`, `diurnal:mean=4,peak_to_trough=4,duration=86400,bursts=6,
burst_x=3,burst_s=600`, `constant:rate=2,duration=60`. The random processes are `inferd.measure.arrivals`'s,
the ones `inferd bench`, the labs and the benchmarks draw.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from inferd.errors import ConfigError
from inferd.measure.arrivals import arrivals_within, thinned_arrivals


@dataclass
class Workload:
    arrivals: np.ndarray  # seconds from the start, sorted
    prompt_tokens: np.ndarray  # int per request
    output_tokens: np.ndarray
    prefix_ids: np.ndarray | None = None  # per request: the shared prefix its prompt starts with (-1: none)
    prefix_tokens: np.ndarray | None = None  # per request: that prefix's length, within prompt_tokens

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1]) if len(self.arrivals) else 0.0


def parse_lengths(spec: str, n: int, rng: np.random.Generator) -> np.ndarray:
    kind, _, rest = spec.partition(":")
    try:
        args = [float(a) for a in rest.split(":")] if rest else []
        if kind == "fixed" and len(args) == 1:
            out = np.full(n, args[0])
        elif kind == "uniform" and len(args) == 2:
            out = rng.integers(int(args[0]), int(args[1]) + 1, n)
        elif kind == "exponential" and len(args) == 1:
            out = rng.geometric(1.0 / max(1.0, args[0]), n)
        elif kind == "lognormal" and len(args) == 2:
            mean, sigma = args
            out = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)  # so the mean is `mean`
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"length distribution {spec!r}: use fixed:N, uniform:A:B, exponential:MEAN or lognormal:MEAN:SIGMA"
        ) from None
    return np.maximum(1, np.rint(out)).astype(np.int64)


def with_shared_prefixes(w: Workload, prefixes: int, tokens: int, zipf: float = 1.2, seed: int = 0) -> Workload:
    """The same arrivals, each prompt now starting with one of `prefixes` shared prefixes of `tokens` tokens (a
    system prompt, few-shot examples, a document asked about), drawn Zipf-popular (weight 1 / rank^zipf) and
    added to the request's own prompt."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, prefixes + 1) ** zipf
    ids = rng.choice(prefixes, size=len(w), p=weights / weights.sum())
    return Workload(w.arrivals, w.prompt_tokens + tokens, w.output_tokens, ids, np.full(len(w), tokens))


def _params(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, text.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"workload parameter {part!r}: use key=value")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"workload parameter {part!r}: {value!r} is not a number") from None
    return out


def diurnal_rate(t: np.ndarray, mean: float, peak_to_trough: float, period: float = 86400.0) -> np.ndarray:
    """A sine over the period, lowest at t=0 (midnight), highest at half the period, averaging `mean`."""
    amp = (peak_to_trough - 1) / (peak_to_trough + 1)
    return mean * (1 - amp * np.cos(2 * np.pi * t / period))


def generate_arrivals(spec: str, rng: np.random.Generator) -> np.ndarray:
    kind, _, rest = spec.partition(":")
    p = _params(rest)
    duration = p.get("duration", 600.0)
    if kind in ("poisson", "gamma", "constant"):
        rate = p.get("rate", 1.0)
        if rate <= 0:
            raise ConfigError("rate must be > 0")
        if kind == "constant":
            return np.arange(0.0, duration, 1.0 / rate)
        shape = p.get("burstiness", 1.0) if kind == "gamma" else 1.0
        if shape <= 0:
            raise ConfigError("burstiness must be > 0")
        return arrivals_within(duration, rate, shape, rng)
    if kind == "diurnal":
        mean, ratio = p.get("mean", 1.0), p.get("peak_to_trough", 4.0)
        period = p.get("period", 86400.0)
        bursts, burst_x, burst_s = int(p.get("bursts", 0)), p.get("burst_x", 3.0), p.get("burst_s", 600.0)
        starts = np.sort(rng.uniform(0, max(0.0, duration - burst_s), bursts))

        def rate(t: np.ndarray) -> np.ndarray:
            r = diurnal_rate(t, mean, ratio, period)
            for s in starts:
                r = np.where((t >= s) & (t < s + burst_s), r * burst_x, r)
            return r

        peak = mean * 2 * ratio / (ratio + 1) * (burst_x if bursts else 1.0)
        return thinned_arrivals(rate, peak, duration, rng)
    raise ConfigError(f"arrivals {spec!r}: use poisson:, gamma:, diurnal:, constant: or a trace file")


def make_workload(arrivals: str, prompt_len: str, output_len: str, seed: int = 0) -> Workload:
    """A generated workload, or a trace file's (its own lengths win; missing ones are drawn)."""
    rng = np.random.default_rng(seed)
    path = Path(arrivals)
    if path.suffix in (".csv", ".jsonl", ".json") or path.exists():
        t, prompt, output = read_trace(path)
        n = len(t)
        prompt = prompt if prompt is not None else parse_lengths(prompt_len, n, rng)
        output = output if output is not None else parse_lengths(output_len, n, rng)
        return Workload(t, prompt, output)
    t = generate_arrivals(arrivals, rng)
    return Workload(t, parse_lengths(prompt_len, len(t), rng), parse_lengths(output_len, len(t), rng))


_TIME = ("timestamp", "time", "t", "arrival", "arrival_time")
_PROMPT = ("prompt_tokens", "input_tokens", "contexttokens", "prompt_len", "input_len")
_OUTPUT = ("output_tokens", "generatedtokens", "completion_tokens", "output_len")


def _pick(row: dict, names: tuple[str, ...]) -> str | None:
    low = {k.strip().lower(): v for k, v in row.items() if k is not None}
    return next((low[n] for n in names if n in low and low[n] not in (None, "")), None)


def _seconds(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return datetime.fromisoformat(str(value).strip().replace(" ", "T")[:26]).timestamp()


def read_trace(path: Path) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Arrival seconds (from the first) and, when the file has them, prompt and output tokens."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read trace {path}: {e}") from None
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ConfigError(f"trace {path} has no requests")
    try:
        times = np.array([_seconds(_pick(r, _TIME)) for r in rows])
    except (TypeError, ValueError):
        raise ConfigError(f"trace {path}: every row needs a time column ({', '.join(_TIME)})") from None
    order = np.argsort(times, kind="stable")
    times = times[order] - times[order][0]

    def column(names: tuple[str, ...]) -> np.ndarray | None:
        values = [_pick(r, names) for r in rows]
        if any(v is None for v in values):
            return None
        return np.maximum(1, np.array([int(float(v)) for v in values]))[order]

    return times, column(_PROMPT), column(_OUTPUT)
