"""`inferd profile`: measure one running replica with `inferd bench` runs and write a `Profile`.

- prefill: one request at a time, one output token, at several prompt lengths; the slope of the median
  TTFT against the prompt length is 1 / prefill tokens per second, and what is left at length 0 after one
  decode step is the per-request overhead (HTTP, tokenizing);
- decode: `b` requests at a time (concurrency b, fixed outputs with ignore_eos) for each batch size b;
  the decode step at that batch size is the median of the replica's decode-only steps with b requests
  (prompts of the middle length: attention, and so the step, grows with the context), or without step
  events the median TPOT (short prompts, so that others' prefills barely move it);
- mixed: the longest batch size with prompts of the middle length, so that prompts are prefilled in the
  same steps as other requests' decodes, as they are under load.

The steps also give the replica's token budget per step (`max_num_batched_tokens`), which the simulator
uses to cut prompts into chunks as the scheduler does.

Every level draws fresh prompts (its own seed): a prompt that shared its start with an earlier level's
would hit the prefix cache and make prefill look nearly free.

Where the replica offers its step events (`/dashboard/events`, an inferd server), the prefill rate is
read from the steps themselves rather than from TTFTs: every step that prefilled at least `MIN_CHUNK`
prompt tokens took `step_s(its batch)` (the decode step measured above) plus its prompt tokens / the
rate, which is exactly the simulator's model of a step, fitted over the steps the sweeps ran (prefill
alone and mixed with decodes). The TTFT fit then gives only the per-request overhead. A server without
step events (another engine, or none reachable) falls back to the TTFT slope.

Cold start cannot be seen from a running server: pass what you measured (`inferd up` reports it).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

from inferd.autoscale.profile import Profile
from inferd.bench.client import ClientConfig, normalize_base_url
from inferd.bench.datasets import RandomDataset
from inferd.bench.runner import BenchConfig, preflight, run_benchmark
from inferd.bench.tokenizers import resolve_tokenizer
from inferd.errors import InferdError

MIN_CHUNK = 32  # prompt tokens a step must prefill to count in the fit (short chunks are mostly noise)


@dataclass
class ProfileRun:
    base_url: str
    model: str | None = None
    prompt_lens: tuple[int, ...] = (64, 256, 512)
    batches: tuple[int, ...] = (1, 2, 4, 8)
    output_len: int = 32
    requests_per_point: int = 8
    max_num_seqs: int | None = None
    cold_start_s: float = 30.0
    name: str = "measured"
    api_key: str | None = None
    tokenizer_url: str | None = None  # where /tokenize is, when base_url has none (a gateway)
    events_url: str | None = None  # the replica's step events (default: /dashboard/events of tokenizer_url or base)
    mixed: bool = True  # also run the mixed level (prompts prefilled beside decodes)
    seed: int = 1_000_003  # prompts of level i come from seed + i


class StepRecorder:
    """Every step of one inferd replica, read from its dashboard event stream on a thread.

    `steps` holds `{"ts", "dur", "p", "n", "d", "budget"}` per step: end time, seconds, prompt tokens
    prefilled, in how many chunks, requests decoded, and the step's token budget. `ok` is False when the
    stream could not be opened (not an inferd server)."""

    def __init__(self, url: str, api_key: str | None = None, connect_timeout: float = 5.0):
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.steps: list[dict] = []
        self.ok = True
        self._last_at = time.monotonic()  # when the last step arrived (or the recorder started)
        self._opened = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True, name="step-recorder")
        self._thread.start()
        self._opened.wait(connect_timeout)

    def _read(self, url: str) -> None:
        try:
            with httpx.stream("GET", url, headers=self._headers, timeout=httpx.Timeout(5.0, read=None)) as r:
                self.ok = r.status_code == 200
                self._opened.set()
                if self.ok:
                    self._consume(r)
        except (httpx.HTTPError, ValueError, KeyError):
            self.ok = bool(self.steps)
        finally:
            self._opened.set()

    def _consume(self, r: httpx.Response) -> None:
        for line in r.iter_lines():
            if self._stop.is_set():
                return
            if not line.startswith("data: ") or '"events"' not in line[:40]:
                continue
            for e in json.loads(line[6:])["events"]:
                if e.get("type") == "step":
                    chunks = [n for _, n, kind, *_ in e["reqs"] if kind == "p"]
                    decode = sum(1 for _, _, kind, *_ in e["reqs"] if kind == "d")
                    step = {"ts": e["ts"], "dur": e["dur_ms"] / 1000, "p": sum(chunks), "n": len(chunks), "d": decode}
                    step["budget"] = e.get("budget")
                    self.steps.append(step)
                    self._last_at = time.monotonic()

    def settle(self, quiet: float = 0.4, timeout: float = 5.0) -> None:
        """Wait until no step has arrived for `quiet` seconds (at most `timeout`).

        The replica sends its steps in batches, one every dashboard tick (0.1 s), so the last steps of a
        level arrive after its last response; on a fast machine a whole level fits in one tick. Call this
        after a level, with the replica idle, before reading the level's steps."""
        deadline = time.monotonic() + timeout
        while self.ok and time.monotonic() < deadline:
            idle = time.monotonic() - self._last_at
            if idle >= quiet:
                return
            time.sleep(quiet - idle)

    def stop(self) -> list[dict]:
        self.settle()
        self._stop.set()
        return self.steps


def decode_step_s(steps: list[dict], batch: int, min_steps: int = 5) -> float | None:
    """The median of the decode-only steps with `batch` requests; None if fewer than `min_steps` of them."""
    durs = [s["dur"] for s in steps if s["p"] == 0 and s["d"] == batch]
    return float(np.median(durs)) if len(durs) >= min_steps else None


def fit_prefill_rate(steps: list[dict], step_s) -> float | None:
    """Prompt tokens per second over the steps that prefilled at least MIN_CHUNK tokens, each step's
    decode part (`step_s` of its batch: decodes + the prompts in it, as the simulator counts it) taken
    away; None if too few."""
    chunks = [s for s in steps if s["p"] >= MIN_CHUNK]
    if len(chunks) < 3:
        return None
    extra = sum(s["dur"] - step_s(max(1, s["d"] + s["n"])) for s in chunks)
    tokens = sum(s["p"] for s in chunks)
    return tokens / extra if extra > 0 else None


def _level(client, tok, server, input_len: int, output_len: int, n: int, concurrency: int, seed: int) -> dict:
    cfg = BenchConfig(client=client, num_prompts=n, max_concurrency=concurrency, show_progress=False)
    result = run_benchmark(cfg, RandomDataset(tok, input_len, output_len, seed=seed), tok, server)[0]
    if not result.summary.get("completed"):
        raise InferdError(f"no request completed at prompt {input_len}, concurrency {concurrency}")
    return result.summary


def measure_profile(run: ProfileRun) -> Profile:
    base = normalize_base_url(run.base_url)
    server = preflight(base, run.api_key)
    model = run.model or next((m.get("id") for m in server.models if isinstance(m, dict) and m.get("id")), None)
    if model is None:
        raise InferdError("the server lists no models; pass --model")
    tok = resolve_tokenizer("auto", normalize_base_url(run.tokenizer_url or base), model, None, run.api_key)
    client = ClientConfig(base_url=base, model=model, ignore_eos=True, api_key=run.api_key)
    seeds = iter(range(run.seed, run.seed + 1000))
    events = run.events_url or normalize_base_url(run.tokenizer_url or base) + "/dashboard/events"
    recorder = StepRecorder(events, run.api_key)
    try:
        ttfts = [
            _level(client, tok, server, n, 1, run.requests_per_point, 1, next(seeds))["median_ttft_ms"] / 1000
            for n in run.prompt_lens
        ]
        mid = sorted(run.prompt_lens)[len(run.prompt_lens) // 2]
        # with step events the decode steps are read from the steps, so the decode levels can run at the
        # workload's context length (attention grows with it); from TPOTs they need short prompts, whose
        # prefills barely touch the other requests' inter-token times
        decode_len = mid if recorder.ok else 16
        steps, note = [], ""
        recorder.settle()
        for b in run.batches:
            first = len(recorder.steps)
            n = max(run.requests_per_point, 2 * b)
            s = _level(client, tok, server, decode_len, run.output_len, n, b, next(seeds))
            recorder.settle()
            from_steps = decode_step_s(recorder.steps[first:], b) if recorder.ok else None
            if from_steps is not None:
                steps.append(from_steps)
            else:
                steps.append(s["median_tpot_ms"] / 1000)
                note = f"; decode steps from TPOTs at {decode_len}-token prompts"
        if recorder.ok and not note:
            note = f"; decode steps from the replica's decode-only steps at {decode_len}-token prompts"
        if run.mixed:
            b = max(run.batches)
            _level(client, tok, server, mid, run.output_len, 3 * b, b, next(seeds))
    finally:
        recorded = recorder.stop()
    prefill, overhead, fit_note = _prefill_fit(list(run.prompt_lens), ttfts, steps[0])
    note = fit_note + note
    decode = Profile("fit", 1.0, list(run.batches), steps, max(run.batches))
    from_steps = fit_prefill_rate(recorded, decode.step_s) if recorder.ok else None
    if from_steps is not None:
        chunks = sum(1 for s in recorded if s["p"] >= MIN_CHUNK)
        note += f"; prefill rate from {chunks} steps' times (TTFT slope gave {prefill:.0f} tok/s)"
        overhead = _overhead(list(run.prompt_lens), ttfts, steps[0], from_steps)
        prefill = from_steps
    else:
        note += "; prefill rate from the TTFT slope (no step events)"
    budgets = [s["budget"] for s in recorded if s.get("budget")]
    return Profile(
        name=run.name,
        prefill_tokens_per_s=prefill,
        request_overhead_s=overhead,
        decode_batch=list(run.batches),
        decode_step_s=steps,
        max_num_seqs=run.max_num_seqs or max(run.batches),
        max_num_batched_tokens=max(budgets) if budgets else None,  # the replica's own, from its steps
        cold_start_s=run.cold_start_s,
        description=f"measured: {model} at {base}",
        source=f"inferd profile: prompts {list(run.prompt_lens)} (TTFT {[round(t, 4) for t in ttfts]} s), "
        f"batches {list(run.batches)}, {run.output_len} output tokens{note}",
    )


def _overhead(lens: list[int], ttfts: list[float], step_s: float, rate: float) -> float:
    """The median of TTFT - one step - prompt / rate over the lone-request levels (at least 0)."""
    return max(0.0, float(np.median([t - step_s - n / rate for n, t in zip(lens, ttfts, strict=True)])))


def _prefill_fit(lens: list[int], ttfts: list[float], step_s: float) -> tuple[float, float, str]:
    """TTFT = overhead + one step + prompt / prefill rate, fitted; (rate, overhead, a note if it fell back).

    When the TTFT does not grow with the prompt (a small model, noise), the prefill is too fast to see:
    the rate is then bounded from below by the longest prompt over its whole TTFT, with no overhead."""
    if len(lens) > 1:
        slope, intercept = (float(x) for x in np.polyfit(lens, ttfts, 1))
        if slope > 0:
            return 1.0 / slope, max(0.0, intercept - step_s), ""
    return lens[-1] / ttfts[-1], 0.0, " (TTFT did not grow with the prompt: prefill rate is a lower bound)"
