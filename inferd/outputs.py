"""What the engine hands back each step, per request, and the record types it is built from.

This module sits at the bottom of the package: it imports nothing of inferd, so the sampler, the
scheduler, the server and the benchmark can all share its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top alternatives at one position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]


@dataclass
class RequestTimes:
    """Engine-side timestamps (time.monotonic) of one sequence, or of a request's n sequences merged."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    #: gap before each output token after the first (seconds)
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token_latencies.append(now - self.last_token)
        self.last_token = now

    @staticmethod
    def merge(times: list[RequestTimes]) -> RequestTimes:
        """A request's times from its sequences': the earliest start, the latest end, every gap."""

        def first(values):
            return min((v for v in values if v is not None), default=None)

        def last(values):
            return max((v for v in values if v is not None), default=None)

        return RequestTimes(
            arrival=min(t.arrival for t in times),
            first_scheduled=first(t.first_scheduled for t in times),
            first_token=first(t.first_token for t in times),
            last_token=last(t.last_token for t in times),
            finished=last(t.finished for t in times),
            inter_token_latencies=[x for t in times for x in t.inter_token_latencies],
        )


@dataclass
class CompletionOutput:
    """One of a request's n sequences: its text so far and what is new since the last step."""

    index: int
    text: str
    token_ids: list[int]
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A finished request's timestamps and counters."""

    times: RequestTimes
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_prefill_chunks: int = 0
    num_decode_steps: int = 0
    num_loaded_tokens: int = 0  # K/V pulled through a KV connector (disaggregated prefill)
    kv_load_seconds: float = 0.0

    @staticmethod
    def merge(metrics: list[RequestMetrics]) -> RequestMetrics:
        """Several requests' (a completion's prompts) as one: the earliest start, the latest end, counts summed."""
        return RequestMetrics(
            times=RequestTimes.merge([m.times for m in metrics]),
            **{f: sum(getattr(m, f) for m in metrics) for f in (
                "num_prompt_tokens", "num_generation_tokens", "num_cached_tokens", "num_preemptions",
                "num_prefill_chunks", "num_decode_steps", "num_loaded_tokens", "kv_load_seconds")},
        )  # fmt: skip

    def timing(self) -> RequestTiming:
        """Where the request's time went (`RequestTiming`)."""
        t = self.times
        ms = lambda a, b: None if a is None or b is None else round((b - a) * 1000, 3)
        return RequestTiming(
            queue_ms=ms(t.arrival, t.first_scheduled),
            prefill_ms=ms(t.first_scheduled, t.first_token),
            ttft_ms=ms(t.arrival, t.first_token),
            decode_ms=ms(t.first_token, t.last_token),
            total_ms=ms(t.arrival, t.finished),
            prefill_chunks=self.num_prefill_chunks,
            decode_steps=self.num_decode_steps,
            preemptions=self.num_preemptions,
            cached_prompt_tokens=self.num_cached_tokens,
            kv_loaded_tokens=self.num_loaded_tokens,
            kv_load_ms=round(self.kv_load_seconds * 1000, 3),
        )


@dataclass
class RequestTiming:
    """Where a request's time went (the server's `return_timing`), from the engine's own timestamps:
    milliseconds from its arrival (None: did not happen), and the steps and KV behind them."""

    queue_ms: float | None = None  # arrival to first scheduled
    prefill_ms: float | None = None  # first scheduled to first token
    ttft_ms: float | None = None
    decode_ms: float | None = None  # first to last token
    total_ms: float | None = None
    prefill_chunks: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    cached_prompt_tokens: int = 0
    kv_loaded_tokens: int = 0  # K/V pulled through a KV connector (disaggregated prefill)
    kv_load_ms: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the sequences that changed this step (all of them once finished)
    finished: bool
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = None  # a prefill instance's lease on the prompt's KV blocks
