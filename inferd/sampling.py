"""SamplingParams: how a request picks its tokens and when it stops, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.errors import InvalidRequestError
from inferd.structured.spec import Constraint

_EPS = 1e-5
# on the HTTP answer to a request that continued a stream (`resume_token_ids`): how many sent tokens it went on
# after; the gateway reads it to know a replica honoured the resume (inferd/gateway/resume.py)
RESUMED_HEADER = "x-inferd-resumed"
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """The OpenAI sampling fields plus vLLM's extra ones.

    temperature 0 means greedy. `max_tokens=None` means "until the context is full".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = field(default_factory=list)  # one string or several; kept as a list
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: sampled token plus top-k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # disaggregated prefill/decode (docs/disaggregation.md): {"do_remote_decode": true} on a prefill
    # instance, the prefill's signed lease on a decode instance; checked by the engine's KV connector
    kv_transfer_params: dict | None = None
    # structured outputs (docs/structured.md): the grammar the output must follow, compiled by the engine
    structured: Constraint | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's range)
    # a resumed stream (the server's `resume`, docs/server.md): the tokens already delivered, which become the
    # output's first tokens (they count toward max_tokens, min_tokens, stops and penalties) and are not sent again
    resume_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # the one place `stop` is normalised: a string, a list or None becomes a list
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2 <= self.presence_penalty <= 2,
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0,
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs",
                f"logprobs must be between 0 and 20, got {self.logprobs}",
            ),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "stop_token_ids must be non-negative integers",
            ),
            (
                # what torch's generator takes; the server keeps to int64 (as vLLM does), so its n copies
                # (seed, seed + 1, ...) stay in range
                self.seed is None or (isinstance(self.seed, int) and _SEED_MIN <= self.seed <= _SEED_MAX),
                "seed",
                f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}",
            ),
            (
                self.resume_token_ids is None
                or all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.resume_token_ids),
                "resume",
                "resume token ids must be non-negative integers",
            ),
            (
                not self.resume_token_ids or self.n == 1,
                "resume",
                f"resume continues one sequence: it needs n=1, got n={self.n}",
            ),
            (
                not self.resume_token_ids or self.max_tokens is None or len(self.resume_token_ids) < self.max_tokens,
                "resume",
                f"resume holds {len(self.resume_token_ids or ())} tokens, as many as max_tokens ({self.max_tokens}) "
                "allows: nothing is left to generate (max_tokens counts the resumed tokens)",
            ),
            (
                not (self.structured and self.ignore_eos),
                "ignore_eos",
                "ignore_eos cannot be combined with a structured output: the grammar ends the output",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def edits_logits(self) -> bool:
        """Whether sampling changes the model's logits before choosing (penalties, biases, a grammar)."""
        return self.uses_penalties or bool(self.logit_bias) or self.structured is not None

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _token_biases(bias: dict) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON string keys, biases in [-100, 100]) with int keys."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if token < 0:
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise InvalidRequestError(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}", param="logit_bias"
            )
        out[token] = float(value)
    return out
