"""`inferd profile`: measure one running replica with `inferd bench` runs and write a `Profile`.

- prefill: one request at a time, one output token, at several prompt lengths; the slope of the median
  TTFT against the prompt length is 1 / prefill tokens per second, and what is left at length 0 after one
  decode step is the per-request overhead (HTTP, tokenizing);
- decode: `b` requests at a time (concurrency b, short prompts, fixed outputs with ignore_eos) for each
  batch size b; the median TPOT is the decode step at that batch size.

Cold start cannot be seen from a running server: pass what you measured (`inferd up` reports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inferd.autoscale.profile import Profile
from inferd.bench.client import ClientConfig, normalize_base_url
from inferd.bench.datasets import RandomDataset
from inferd.bench.runner import BenchConfig, preflight, run_benchmark
from inferd.bench.tokenizers import resolve_tokenizer
from inferd.errors import InferdError


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


def _level(client: ClientConfig, tok, server, input_len: int, output_len: int, n: int, concurrency: int) -> dict:
    cfg = BenchConfig(client=client, num_prompts=n, max_concurrency=concurrency, show_progress=False)
    result = run_benchmark(cfg, RandomDataset(tok, input_len, output_len), tok, server)[0]
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
    ttfts = [
        _level(client, tok, server, n, 1, run.requests_per_point, 1)["median_ttft_ms"] / 1000 for n in run.prompt_lens
    ]
    steps = []
    for b in run.batches:
        s = _level(client, tok, server, 16, run.output_len, max(run.requests_per_point, 2 * b), b)
        steps.append(s["median_tpot_ms"] / 1000)
    prefill, overhead, note = _prefill_fit(list(run.prompt_lens), ttfts, steps[0])
    return Profile(
        name=run.name,
        prefill_tokens_per_s=prefill,
        request_overhead_s=overhead,
        decode_batch=list(run.batches),
        decode_step_s=steps,
        max_num_seqs=run.max_num_seqs or max(run.batches),
        cold_start_s=run.cold_start_s,
        description=f"measured: {model} at {base}",
        source=f"inferd profile: prompts {list(run.prompt_lens)} (TTFT {[round(t, 4) for t in ttfts]} s), "
        f"batches {list(run.batches)}, {run.output_len} output tokens{note}",
    )


def _prefill_fit(lens: list[int], ttfts: list[float], step_s: float) -> tuple[float, float, str]:
    """TTFT = overhead + one step + prompt / prefill rate, fitted; (rate, overhead, a note if it fell back).

    When the TTFT does not grow with the prompt (a small model, noise), the prefill is too fast to see:
    the rate is then bounded from below by the longest prompt over its whole TTFT, with no overhead."""
    if len(lens) > 1:
        slope, intercept = (float(x) for x in np.polyfit(lens, ttfts, 1))
        if slope > 0:
            return 1.0 / slope, max(0.0, intercept - step_s), ""
    return lens[-1] / ttfts[-1], 0.0, " (TTFT did not grow with the prompt: prefill rate is a lower bound)"
