"""The step record: what the scheduler hands the runner for one step, and what comes back.

Plain data only (ids, token ids, block ids, sampling settings), never a live `Request` or a block
object, so whatever consumes a step -- the model runner, a runner in another process or on another
device, a KV connector, a dashboard -- reads it without reaching into the scheduler. The runner keeps
its own per-request state (block table, sampling state) and updates it from these records alone:

- a request entering the batch for the first time arrives once as a `NewRequest`;
- every scheduled request has one `ScheduledChunk` per step: the tokens to compute, where they
  start, whether a token is sampled at the end, and the blocks added to its table this step (a new
  or resumed request's whole table); a decoding request may carry draft tokens to verify, and slots
  for the drafts the runner makes itself after the step (`num_lookahead`);
- `preempted_ids` lose their blocks (the runner keeps their sampling state: they come back with a
  fresh table and are recomputed); `finished_ids` are gone for good.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.outputs import TokenLogprobs
from inferd.sampling import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen: what sampling needs besides the tokens of each chunk."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    lora_name: str | None = None  # the LoRA adapter its rows run under


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    start: int  # position of token_ids[0] (= tokens already in the KV cache)
    is_prefill: bool  # still inside the prompt (or recomputing after preemption), not a decode
    samples: bool  # the chunk reaches the last known token, so a new token is sampled after it
    new_block_ids: list[int]  # appended to the request's block table before the step runs
    # speculative decoding: the last num_drafts of token_ids are drafts, not yet the request's tokens; the
    # runner computes logits at every position from the last known token on and keeps what the model agrees to
    num_drafts: int = 0
    # self-drafting (`self_draft`): after the step the runner drafts this many tokens past the one it samples, into
    # slots allocated with this chunk's; the next step verifies them
    num_lookahead: int = 0
    # the last num_recompute tokens (before any drafts) are output tokens computed again, after a preemption or
    # a resumed stream's delivered ones: the runner computes them as one-query rows, as decoding first did, so
    # their K/V and the token after them are the ones decoding gave (a prefill's attention rounds differently,
    # and int8 activations magnify it)
    num_recompute: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step, in the order the scheduler picked the requests (running ones first)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step
    kv_connector_metadata: Any = None  # what a KV connector loads before this step (inferd.engine.kv_connector)

    @property
    def empty(self) -> bool:
        """Nothing to compute (there may still be state to drop)."""
        return not self.chunks


@dataclass
class RunnerOutput:
    """The tokens sampled this step, one per chunk that samples, in the order of `request_ids`. A chunk with
    drafts may yield more: `accepted_drafts` holds, by request, the drafts the model agreed to, which come
    before that request's token in `token_ids`."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    # self-drafting: the drafts the runner made after this step's token, for chunks with num_lookahead
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # requests whose K/V the KV connector loaded (or failed to load) before this step
    finished_loading: list[str] = field(default_factory=list)
    failed_loading: list[str] = field(default_factory=list)
