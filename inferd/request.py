"""Request: one sequence being generated, as the scheduler sees it.

Its progress is one counter, `num_computed_tokens`, and the list of tokens it has generated; both
change in one place only, `Scheduler.update_from_output` (and a preemption resets the counter).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from inferd.outputs import RequestTimes
from inferd.prefix_hash import adapter_salt
from inferd.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def sub_request_id(parent_id: str, index: int) -> str:
    """The id of a request's index-th part: one of its n sequences, or one prompt of a prompt list."""
    return f"{parent_id}-{index}"


@dataclass(eq=False)
class Request:
    """One sequence. `n > 1` requests are fanned out into n of these by the engine."""

    request_id: str  # unique per sequence: sub_request_id(parent_id, index) when the parent has n > 1
    parent_id: str
    index: int  # which of the parent's n sequences
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)
    lora_key: str | None = None  # that adapter's identity in prefix-cache keys (LoRAAdapter.key)
    priority: int = 0  # with --scheduling-policy priority: lower runs first (vLLM's field)
    ttft_deadline: float | None = None  # with --scheduling-policy deadline: its first token is due this long (s)
    # after arrival (None: the policy's default)
    rank: tuple = ()  # its place among waiting and running requests under priority or deadline (the scheduler's)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # steps that computed part of its prompt (or its recompute after a preemption)
    num_decode_steps: int = 0  # steps that decoded it (one token, with its accepted drafts)
    num_loaded_tokens: int = 0  # tokens whose K/V a KV connector loaded (disaggregated prefill)
    kv_load_seconds: float = 0.0  # how long those loads took, scheduled to done
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    times: RequestTimes = field(default_factory=lambda: RequestTimes(arrival=time.monotonic()))

    @property
    def prefix_salt(self) -> str | None:
        """What the prefix cache salts this request's block keys with: its cache_salt, and its adapter, so a
        block computed under one adapter (or none) is never reused under another."""
        return adapter_salt(self.cache_salt, self.lora_key)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
