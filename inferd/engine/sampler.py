"""Turn the logits of one step into next tokens, vectorised over the batch.

Order: penalties -> logit_bias -> min_tokens mask -> the grammar's mask (structured outputs: the
forbidden tokens' logits become -inf, in place) -> greedy rows take the argmax; the other rows scale by
temperature, cut by top-k / top-p / min-p and draw with the exponential-race trick: the token is argmax(p / E), E a
vector of Exp(1) noise.

Seeded requests draw counter-based noise: the noise of output position i is drawn from the request's
generator re-seeded with `position_seed(seed, i)`, so a seeded request's tokens depend only on its seed,
the position and the logits -- not on the batch, not on speculative drafts (their verification draws the
same noise per position, below), not on where a stream resumed (`resume`: docs/server.md). Re-seeding costs
a few microseconds per seeded row and step. Unseeded rows draw from the sampler's one generator.
Logprobs are those of the model's raw distribution, as vLLM and OpenAI report them.

The grammar has the last word: if min_tokens forbids stopping where the grammar allows nothing else
(the output is complete), the row keeps the grammar's mask alone and stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from inferd.outputs import TokenLogprobs
from inferd.sampling import SamplingParams
from inferd.structured.grammar import Matcher, apply_bitmask, fill_bitmasks


class SamplingState(Protocol):
    """What the sampler reads of a request: the runner keeps one of these per request."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None  # a seeded request's own (re-seeded per position); None: the sampler's
    matcher: Matcher | None  # a structured request's place in its grammar (inferd.structured.grammar)


def _in_min_tokens(state: SamplingState) -> bool:
    """Whether min_tokens still holds the request's stop tokens back this step."""
    return len(state.output_token_ids) < state.params.min_tokens


def argmax_only(state: SamplingState) -> bool:
    """Whether the next token is the plain argmax of the logits: greedy, no logprobs, nothing that edits
    the logits (penalties, biases, a grammar, the min_tokens mask). Such rows skip full logits
    (`CausalLM.greedy_tokens`)."""
    p = state.params
    return p.greedy and p.logprobs is None and not p.edits_logits and len(state.output_token_ids) >= p.min_tokens


def argmax_under_grammar(state: SamplingState) -> bool:
    """Whether the next token is the argmax of the logits among the tokens a grammar allows and nothing else
    edits them: the tiled LM head picks it under the grammar's bitmask (`CausalLM.greedy_tokens`)."""
    p = state.params
    return (
        p.greedy
        and p.logprobs is None
        and state.matcher is not None
        and not p.uses_penalties
        and not p.logit_bias
        and len(state.output_token_ids) >= p.min_tokens
    )


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output position: splitmix64 of the seed stepped `position + 1`
    times, so nearby seeds and positions get unrelated noise (torch's CPU generator reads only 32 bits of a
    seed; these mix all 64 of the request's seed into them)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _position_noise(row: torch.Tensor, state: SamplingState, position: int) -> torch.Tensor:
    """Fill `row` (one vocabulary's worth) with the Exp(1) noise of a seeded request's output position."""
    state.generator.manual_seed(position_seed(state.params.seed, position))
    return row.exponential_(generator=state.generator)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, requests: Sequence[SamplingState], bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """`bitmask` row i is the grammar's mask of request i (rows without a matcher are ignored)."""
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, requests)
        if any(r.params.uses_penalties for r in requests):
            logits = self._apply_penalties(logits.clone(), requests)
        logits = self._apply_bias(logits, requests)
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        # only a row whose stop tokens min_tokens masks can be left with nothing the grammar allows
        held_back = [i for i in constrained if _in_min_tokens(requests[i])]
        before_min_tokens = logits[held_back].clone() if held_back else None
        logits = self._mask_min_tokens(logits, requests)
        if constrained:
            logits = self._apply_grammar(logits, requests, constrained, held_back, before_min_tokens, bitmask)
        token_ids = self._pick(logits, requests)
        return SamplerOutput(token_ids.tolist(), self._gather_logprobs(raw_logprobs, token_ids, requests))

    # -- logits processors ------------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(requests):
            p = r.params
            if not p.uses_penalties:
                continue
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=logits.device)
                seen[prompt[prompt < vocab]] = True
                row = logits[i]
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(seen, penalised, row)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _apply_bias(logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        for i, r in enumerate(requests):
            bias = r.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        return logits

    @staticmethod
    def _apply_grammar(
        logits: torch.Tensor,
        requests: Sequence[SamplingState],
        rows: list[int],
        held_back: list[int],
        before_min_tokens: torch.Tensor | None,
        bitmask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`held_back`: the rows of `rows` whose stop tokens min_tokens masked (`before_min_tokens`: theirs
        before it did); the only rows a grammar's mask can leave with no token (a full pass each to find)."""
        if bitmask is None:  # the runner fills masks while the model runs; a caller without one fills here
            bitmask = fill_bitmasks([r.matcher for r in requests], logits.shape[1])
        apply_bitmask(logits, bitmask, rows)
        stuck = [i for i in held_back if not torch.isfinite(logits[i]).any()]
        if stuck:  # min_tokens forbade the only tokens the grammar allows (its stop tokens): the grammar wins
            for i in stuck:
                logits[i] = before_min_tokens[held_back.index(i)]
            apply_bitmask(logits, bitmask, stuck)
        return logits

    def _mask_min_tokens(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        for i, r in enumerate(requests):
            if _in_min_tokens(r):
                stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                ids = [t for t in stops if t < logits.shape[1]]
                if ids:
                    logits[i, ids] = float("-inf")
        return logits

    # -- choosing tokens --------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = self._sample(logits[rows], [requests[i] for i in random_rows])
            token_ids[rows] = chosen
        return token_ids

    @staticmethod
    def _probs(logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, then top-k, top-p and min-p (not renormalised after
        min-p: a draw does not need it)."""
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=device)
        logits = logits / temps[:, None]
        top_ks = [r.params.top_k for r in requests]
        if any(top_ks):
            logits = _apply_top_k(logits, top_ks)
        top_ps = [r.params.top_p for r in requests]
        if any(p < 1.0 for p in top_ps):
            logits = _apply_top_p(logits, torch.tensor(top_ps, device=device))
        probs = torch.softmax(logits, dim=-1)
        min_ps = [r.params.min_p for r in requests]
        if any(min_ps):
            threshold = torch.tensor(min_ps, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def verify_drafts(self, logits: torch.Tensor, state: SamplingState, draft: list[int]) -> tuple[list[int], int]:
        """Speculative decoding's verification for a sampled request (inferd/engine/spec_decode.py): `logits` has
        a row per position, its last known token's and each draft's. Each position draws its token as plain
        sampling would (the exponential race, with a seeded request's noise of that output position); a draft is
        kept while it equals the token drawn at its position, and the first token drawn that differs (or the one
        after the last draft) follows. This is rejection sampling for a draft proposed with certainty: a draft d
        is kept with probability p(d), and a rejected position's token is drawn from p with d removed, so every
        output token is distributed as p -- and a seeded request's tokens are those it draws without drafts.
        Returns (the drafts kept, the token after them)."""
        probs = self._probs(logits.float(), [state] * logits.shape[0])
        noise = torch.empty_like(probs)
        if state.generator is None:
            noise.exponential_(generator=self.generator)
        else:
            first = len(state.output_token_ids)
            for j in range(noise.shape[0]):
                _position_noise(noise[j], state, first + j)
        drawn = (probs / noise).argmax(dim=-1).tolist()
        n = 0
        while n < len(draft) and drawn[n] == draft[n]:
            n += 1
        return draft[:n], drawn[n]

    def _sample(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        probs = self._probs(logits, requests)
        device = probs.device
        # exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(
                generator=self.generator
            )
        for i, r in enumerate(requests):
            if r.generator is not None:
                _position_noise(noise[i], r, len(r.output_token_ids))
        return (probs / noise).argmax(dim=-1)

    # -- logprobs ---------------------------------------------------------------------------------
    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor | None:
        if all(r.params.logprobs is None for r in requests):
            return None
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor | None, token_ids: torch.Tensor, requests: Sequence[SamplingState]
    ) -> list[TokenLogprobs | None]:
        if logprobs is None:
            return [None] * len(requests)
        k = max(r.params.logprobs or 0 for r in requests)
        top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
        sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(requests):
            if r.params.logprobs is None:
                out.append(None)
                continue
            n = r.params.logprobs
            top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True))
            out.append(TokenLogprobs(int(token_ids[i]), float(sampled[i]), int(ranks[i]), top))
        return out


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    kmax = int(ks.max())
    top_vals = logits.topk(kmax, dim=-1).values
    threshold = top_vals.gather(1, (ks - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # drop a token when the tokens ranked above it already reach top_p; the first always stays
    drop = (cum - sorted_logits.softmax(dim=-1)) >= top_ps[:, None]
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))
