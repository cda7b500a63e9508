"""Speculative decoding: several tokens per request in one step, each the token decoding without it gives.

A decode step at a small batch is bound by the bytes of the weights it reads (docs/performance.md), so
computing a few more positions of one request costs little more than one. A proposer guesses the next k
tokens cheaply; the step computes the request's last token and the k drafts as one chunk over its cached
context, with logits at every position; the runner keeps the longest prefix of drafts that equals the
model's own argmax at each position, plus the model's token after it (the bonus). So a step yields 1 to
k + 1 tokens, every one of them the token plain greedy decoding would have chosen, and rejected drafts'
K/V is simply overwritten by the next step (the request's computed length advances only past accepted
ones).

The proposer here is n-gram prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): find the latest
earlier occurrence of the request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
in its prompt and output, and propose the k tokens that followed it. It costs no model and pays off where
outputs repeat their context (extraction, code edits, summaries quoting the source, structured records).

Who takes it: requests without logprobs, penalties, logit biases or a grammar, past `min_tokens` (and, if
set, only in steps with at most `speculative_disable_by_batch_size` running requests: vLLM's rule).

How many drafts each one carries is planned per step (`DraftPlanner`), up to `num_speculative_tokens`: a
draft is worth its row only while the step's tokens per second grow with it. The planner knows two measured
things: what a step of T rows costs on this machine, t(T) (`StepCost`, learned from the engine's own decode
steps), and how likely each request's next draft is to be kept, p (its recent acceptance, starting from the
engine-wide rate). The i-th draft of a request adds p^i expected tokens; drafts are added best first while
(tokens + p^i) / t(T + 1) beats tokens / t(T). At batch 1, where a step of ten rows costs about what one does,
every draft the lookup finds goes in; in a large batch, bound by compute, only drafts very likely to be kept
do, and none once their rows cost more than they give. A sampled request (temperature > 0, top-k/p,
min-p) keeps each draft by rejection sampling (`Sampler.verify_drafts`), so its tokens are distributed as
without drafts; a seeded one is reproducible, though its random draws differ from a run without drafts.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferd.config import SpeculativeConfig
from inferd.request import Request


def ngram_propose(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the last n tokens (longest n first), or none.

    Where that occurrence is so recent that fewer than k tokens follow it before the text ends, the text is
    read as repeating with the period the match shows (the distance it is back): the draft continues the
    repetition, so a run or a short cycle drafts k tokens rather than one or two."""
    length = len(token_ids)
    if length < n_min + 1 or k <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: every occurrence that ends before the suffix itself starts
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            period = length - n - int(hits[-1])  # the suffix again, this many tokens later
            known = tokens.tolist()
            draft: list[int] = []
            for i in range(k):
                j = length + i - period
                draft.append(known[j] if j < length else draft[j - length])
            return draft
    return []


def takes_drafts(request: Request) -> bool:
    """Whether drafts can be verified for the request's next token: it is decoding, its distribution is the
    model's own (temperature, top-k/p, min-p; no penalties, biases or grammar) and no logprobs are asked."""
    p = request.params
    return (
        p.logprobs is None
        and not p.edits_logits
        and len(request.output_token_ids) >= p.min_tokens
        and request.num_computed_tokens == request.num_tokens - 1  # decoding, nothing left to prefill
    )


@dataclass
class SpecStats:
    """Drafts proposed and accepted since start (vLLM's spec_decode num_draft_tokens / num_accepted_tokens)."""

    num_drafts: int = 0  # steps in which a request carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at draft position i

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


class StepCost:
    """t(T): the seconds a decode step of T rows (decode tokens plus drafts) takes here, learned from the
    engine's own steps (a moving average per row count). Between learned counts it interpolates; beyond the
    largest it extends the slope of the last two (flat with one: untried sizes look cheap until tried, so the
    planner tries them and learns)."""

    ALPHA = 0.2  # weight of a new step in its row count's average

    def __init__(self):
        self.rows: list[int] = []  # sorted row counts seen
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self.seconds:
            bisect.insort(self.rows, rows)
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] += self.ALPHA * (seconds - self.seconds[rows])

    def __call__(self, rows: int) -> float | None:
        """The expected seconds of a step of `rows` rows; None before any step was seen."""
        if not self.rows:
            return None
        if rows in self.seconds:
            return self.seconds[rows]
        i = bisect.bisect_left(self.rows, rows)
        if i == 0:
            return self.seconds[self.rows[0]]
        if i < len(self.rows):
            a, b = self.rows[i - 1], self.rows[i]
            return self.seconds[a] + (self.seconds[b] - self.seconds[a]) * (rows - a) / (b - a)
        last = self.rows[-1]
        if len(self.rows) == 1:
            return self.seconds[last]
        prev = self.rows[-2]
        slope = max(0.0, (self.seconds[last] - self.seconds[prev]) / (last - prev))
        return self.seconds[last] + slope * (rows - last)


class DraftPlanner:
    """How many of its proposed drafts each request carries into the next step (module docstring)."""

    DECAY = 0.8  # weight of a request's earlier steps against its latest in its acceptance rate
    PRIOR = 2.0  # how many drafts' worth the engine-wide rate counts for in a request's own

    def __init__(self, stats: SpecStats):
        self.stats = stats
        self.cost = StepCost()
        self._kept: dict[str, tuple[float, float]] = {}  # request -> (drafts kept, drafts rejected), decayed

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of only decode rows (and drafts) and what it took."""
        self.cost.observe(rows, seconds)

    def observe_drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        kept, rejected = self._kept.get(request_id, (0.0, 0.0))
        self._kept[request_id] = (kept * self.DECAY + accepted, rejected * self.DECAY + (accepted < drafted))

    def acceptance(self, request_id: str) -> float:
        """p: the chance the request's next draft is kept given the one before it was (each step keeps a run
        of drafts, then rejects at most one), its own record weighed with the engine's."""
        s = self.stats
        overall = (s.num_accepted_tokens + 1) / (s.num_accepted_tokens + s.num_drafts + 2)  # a rejection a step
        kept, rejected = self._kept.get(request_id, (0.0, 0.0))
        return (kept + self.PRIOR * overall) / (kept + rejected + self.PRIOR)

    def plan(self, drafts: dict[str, list[int]], decode_rows: int) -> dict[str, list[int]]:
        """The drafts cut to what pays: `decode_rows` is the step's decoding requests, one row each."""
        base = self.cost(decode_rows)
        if base is None or not drafts:
            return drafts
        tokens, rows, seconds = float(decode_rows), decode_rows, base
        chosen = dict.fromkeys(drafts, 0)
        p = {rid: self.acceptance(rid) for rid in drafts}
        heap = [(-p[rid], rid, 1) for rid in drafts]  # (-gain of the request's next draft, request, its index)
        heapq.heapify(heap)
        while heap:
            neg_gain, rid, i = heapq.heappop(heap)
            t = self.cost(rows + 1)
            if (tokens - neg_gain) / t <= tokens / seconds:
                break  # gains only fall from here and each row costs at least as much
            tokens, rows, seconds = tokens - neg_gain, rows + 1, t
            chosen[rid] = i
            if i < len(drafts[rid]):
                heapq.heappush(heap, (neg_gain * p[rid], rid, i + 1))
        return {rid: drafts[rid][:k] for rid, k in chosen.items() if k}

    def forget(self, running: Iterable[str]) -> None:
        """Drop the records of requests no longer running."""
        keep = set(running)
        for rid in [r for r in self._kept if r not in keep]:
            del self._kept[rid]


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, planner: DraftPlanner | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.planner = planner

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the requests that take them, within their max_tokens and the context length, cut by
        the planner to what pays in the next step."""
        c = self.config
        limit = c.speculative_disable_by_batch_size
        if limit is not None and len(running) > limit:
            return {}
        drafts = {}
        for request in running:
            if not takes_drafts(request):
                continue
            # the step appends the accepted drafts and one more token: keep all of them within the limits
            room = min(
                request.params.max_tokens - len(request.output_token_ids), self.max_model_len - request.num_tokens
            )
            k = min(c.num_speculative_tokens, room - 1)
            if k <= 0:
                continue
            prompt, output = request.prompt_token_ids, request.output_token_ids
            draft = ngram_propose(prompt + output, k, c.prompt_lookup_min, c.prompt_lookup_max)
            if draft:
                drafts[request.request_id] = draft
        if self.planner is None:
            return drafts
        self.planner.forget(r.request_id for r in running)
        return self.planner.plan(drafts, len(running))
