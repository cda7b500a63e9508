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

Who takes it: requests without logprobs, penalties, logit biases or a grammar, past `min_tokens`, and only in
steps with at most `speculative_disable_by_batch_size` running requests: a larger batch is bound by compute,
where verifying drafts that are then rejected costs real time. A sampled request (temperature > 0, top-k/p,
min-p) keeps each draft by rejection sampling (`Sampler.verify_drafts`), so its tokens are distributed as
without drafts; a seeded one is reproducible, though its random draws differ from a run without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the requests that take them, within their max_tokens and the context length."""
        c = self.config
        if len(running) > c.speculative_disable_by_batch_size:
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
        return drafts
