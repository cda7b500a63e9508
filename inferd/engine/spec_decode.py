"""Speculative decoding: several tokens per request in one step, each the token decoding without it gives.

A decode step at a small batch is bound by the bytes of the weights it reads (docs/performance.md), so
computing a few more positions of one request costs little more than one. A proposer guesses the next k
tokens cheaply; the step computes the request's last token and the k drafts as one chunk over its cached
context, with logits at every position; the runner keeps the longest prefix of drafts that equals the
model's own argmax at each position, plus the model's token after it (the bonus). So a step yields 1 to
k + 1 tokens, every one of them the token plain greedy decoding would have chosen, and rejected drafts'
K/V is simply overwritten by the next step (the request's computed length advances only past accepted
ones).

Three proposers, none with a model of its own:

- n-gram prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding, `NgramProposer`): find the latest earlier
  occurrence of the request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its
  prompt and output, and propose the k tokens that followed it. It pays off where outputs repeat their context
  (extraction, code edits, summaries quoting the source, structured records).
- suffix decoding (vLLM's `suffix`, from SuffixDecoding, arXiv 2411.04975; `SuffixProposer`): suffix trees count
  every path of up to `suffix_decoding_max_tree_depth` tokens in the request's own prompt and output and in
  the outputs of recently finished requests; the draft follows the most frequent continuation of a suffix of
  the request's text found there (of the suffix whose draft scores best), as long as its estimated probability
  holds. It also pays where outputs repeat earlier requests' outputs: agents that call the same tools with the
  same JSON shapes, the same record asked again.

- self-drafting (`self_draft`, `SelfDraftProposer`): the model drafts its own next tokens, its whole body with
  its LM head cut to the tokens most frequent in the engine's traffic (inferd/engine/draft_head.py), which
  reads a fraction of the head's bytes; the scheduler allocates slots past each drafting request's chunk and
  the runner makes the drafts after the step (`ScheduledChunk.num_lookahead`, vLLM's lookahead slots). A draft
  is exactly the model's argmax whenever that token is among the head's rows, so acceptance is the share of
  the output inside the cut vocabulary. It pays where the head is a large share of the weights and steps are
  bound by bytes (small models, large vocabularies, small batches).

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
without drafts; a seeded one draws the noise of each output position from its seed and the position, so its
tokens are the very tokens it gets without drafts.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferd.config import SpeculativeConfig
from inferd.request import Request, RequestStatus


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


class Proposer:
    """What every proposer shares: which running requests take drafts this step (`takes_drafts`, and none at all
    above `speculative_disable_by_batch_size` running requests), how many tokens fit (within the request's
    max_tokens and the context, at most `SpeculativeConfig.draft_tokens`), and the planner's cut to what pays. A
    proposer says only what to draft for one request (`draft`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, planner: DraftPlanner | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.planner = planner

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the requests that take them, within their max_tokens and the context length, cut by
        the planner to what pays in the next step."""
        c = self.config
        limit = c.draft_max_running
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
            k = min(c.draft_tokens, room - 1)
            if k <= 0:
                continue
            draft = self.draft(request, k)
            if draft:
                drafts[request.request_id] = draft
        if self.planner is None:
            return drafts
        self.planner.forget(r.request_id for r in running)
        return self.planner.plan(drafts, len(running))

    def draft(self, request: Request, k: int) -> list[int]:
        """At most k tokens the request's next tokens are guessed to be (none: no guess)."""
        raise NotImplementedError

    def finish(self, requests: Iterable[Request]) -> None:
        """Requests that ended (finished or aborted): a proposer that keeps something per request lets go of it."""

    def take_runner_drafts(self, drafts: dict[str, list[int]]) -> None:
        """The drafts the runner made after the step, by request (`RunnerOutput.draft_token_ids`): only
        self-drafting has any."""


class NgramProposer(Proposer):
    """n-gram prompt lookup over the request's own prompt and output (`ngram_propose`)."""

    def draft(self, request: Request, k: int) -> list[int]:
        c = self.config
        text = request.prompt_token_ids + request.output_token_ids
        return ngram_propose(text, k, c.prompt_lookup_min, c.prompt_lookup_max)


# -- suffix decoding ----------------------------------------------------------------------------------
class _Node:
    """A path that occurs at least twice (or did, before an eviction): how many times, what followed it, and
    which of those followed most often (`top`; None: to be found again, after an eviction lowered it)."""

    __slots__ = ("count", "children", "top")

    def __init__(self, count: int = 0):
        self.count = count
        self.children: dict[int, _Node | Tail] = {}
        self.top: int | None = None


# A path that occurs once is kept as its place in its sequence rather than as nodes: (the sequence's key, pos,
# end), whose tokens are seqs[key][pos:end] (end: the tree's depth from where the occurrence starts) as far as
# the sequence reaches, each of count 1; a growing sequence extends its tails by itself, and a second occurrence
# turns a tail's first token into a node. A tuple of ints, which Python's garbage collector stops tracking: a
# cache of many outputs holds about one per token.
Tail = tuple[Hashable, int, int]
# where a path ends: its node, or (key, j, end), its last token seqs[key][j] inside a tail
Place = _Node | Tail


def _count(child: _Node | Tail) -> int:
    return 1 if type(child) is tuple else child.count


class SuffixTree:
    """How often each path of up to `depth` tokens occurs in a set of token sequences, and what followed it.

    A trie over every suffix of every sequence, cut at `depth` tokens. A path that occurs at least twice is a
    node with its count; one that occurs once is a `Tail`, a place in its sequence, so text that repeats
    nothing costs one entry per token rather than `depth` nodes. A sequence grows token by token (`extend`): the
    tree keeps the nodes its current suffixes end at (the others run in their own tails, which grow with the
    sequence), so a token costs one step from each, at most `depth`, never a rescan of the text. `remove` takes
    a sequence's occurrences back out, and a node none is left in goes with everything below it, so a cache of
    sequences stays as large as what it holds.

    A suffix occurs at least as often as any path it ends, so if a sequence's current suffix of length L ends at
    a node, so do the shorter ones: `open` lists them longest first, the last of length 1."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.seqs: dict[Hashable, list[int]] = {}
        self.open: dict[Hashable, list[_Node]] = {}  # sequences that may grow: their current suffixes' nodes

    def extend(self, key: Hashable, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `key` (a new one if unknown), counting every path they end."""
        seq = self.seqs.setdefault(key, [])
        suffixes = self.open.setdefault(key, [])
        depth, root, seqs = self.depth, self.root, self.seqs
        for token in tokens:
            i = len(seq)
            seq.append(token)
            root.count += 1
            grown = []
            length = len(suffixes)  # of the suffix at hand: the longest first, the empty one (the root) last
            for node in (*suffixes, root):
                child = node.children.get(token)
                if child is None:  # a new path: it occurs only here, and grows with the sequence
                    node.children[token] = (key, i, i - length + depth)
                else:
                    if type(child) is tuple:  # the path's second occurrence: its token becomes a node
                        (other, pos, end), child = child, _Node(1)
                        node.children[token] = child
                        if pos + 1 < min(end, len(seqs[other])):
                            child.top = seqs[other][pos + 1]
                            child.children[child.top] = (other, pos + 1, end)
                    child.count += 1
                    top = node.top
                    if top is not None and top != token and child.count > _count(node.children[top]):
                        node.top = token
                    if length + 1 < depth:
                        grown.append(child)
                length -= 1
            suffixes = self.open[key] = grown

    def add(self, key: Hashable, tokens: Iterable[int]) -> None:
        """A whole sequence that will not grow."""
        self.extend(key, tokens)
        del self.open[key]

    def remove(self, key: Hashable) -> None:
        """Take sequence `key` out: every path it ends counts one occurrence fewer."""
        seq = self.seqs[key]
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for i in range(start, min(start + self.depth, len(seq))):
                child = node.children[seq[i]]
                if node.top == seq[i]:
                    node.top = None
                if type(child) is tuple or child.count == 1:  # this was the path's only occurrence
                    del node.children[seq[i]]
                    break
                child.count -= 1
                node = child
        del self.seqs[key]
        self.open.pop(key, None)

    def find(self, tokens: Sequence[int], start: int = 0) -> Place | None:
        """Where the path tokens[start:] ends, or None where it does not occur."""
        node, k, n = self.root, start, len(tokens)
        while k < n:
            child = node.children.get(tokens[k])
            k += 1
            if child is None:
                return None
            if type(child) is tuple:
                key, j, end = child
                seq = self.seqs[key]
                last = min(end, len(seq))
                while k < n:
                    j += 1
                    if j >= last or seq[j] != tokens[k]:
                        return None
                    k += 1
                return key, j, end
            node = child
        return node

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, Place] | None:
        """(length, place) of the longest suffix of `tokens` shorter than the depth (a longer one leaves nothing
        to draft) that occurs in the tree, or None. Every suffix of a path in the tree is one too, so whether a
        suffix occurs falls with its length once: a binary search finds the longest in a few walks."""
        n = len(tokens)
        lo, hi, found = 0, min(n, self.depth - 1), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            place = self.find(tokens, n - mid)
            if place is None:
                hi = mid - 1
            else:
                lo, found = mid, place
        return None if found is None else (lo, found)

    def continuation(
        self, place: Place, budget: int, min_prob: float, current: frozenset | set = frozenset()
    ) -> tuple[list[int], float]:
        """The most frequent continuation of the path ending at `place`: at most `budget` tokens, each the
        child with the highest count, while the draft's estimated probability, the product of count(child) /
        count(parent) along it, is at least `min_prob`. Returns the draft and its score, the sum of those
        probabilities (the tokens a verifier is expected to keep). `current`: nodes of a growing sequence's own
        current suffixes, whose count includes an occurrence that has no next token yet, so it is left out."""
        draft: list[int] = []
        score, prob = 0.0, 1.0
        node = place
        while len(draft) < budget:
            if type(node) is tuple:  # one occurrence from here: each token follows with the probability so far
                key, j, end = node
                seq = self.seqs[key]
                tokens = seq[j + 1 : min(end, len(seq), j + 1 + budget - len(draft))]
                draft += tokens
                score += prob * len(tokens)
                break
            if not node.children:
                break
            children, token = node.children, node.top
            if token is None:
                token = node.top = max(children, key=lambda t: _count(children[t]))
            child = children[token]
            prob *= _count(child) / (node.count - (node in current))
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


class SuffixProposer(Proposer):
    """Suffix decoding (vLLM's `suffix`; SuffixDecoding, arXiv 2411.04975): drafts from suffix trees over each
    running request's own prompt and output (its local tree, grown as its tokens arrive and dropped when it
    ends) and over the outputs of the last `suffix_decoding_max_cached_requests` finished requests (the global
    tree, oldest out first). Aborted requests' outputs are not kept, nor prompts: each request's local tree
    holds its own, and the paper's cache keeps outputs only.

    Every suffix of the request's text found in a tree is a candidate: its draft is the most frequent
    continuation (`SuffixTree.continuation`) of at most min(k, ceil(suffix_decoding_max_spec_factor x its
    length)) tokens, since a longer match predicts better, and the tree's depth bounds match and draft
    together. The draft with the highest score (expected tokens kept) across both trees and every match length
    wins, so a shorter match with room for a longer draft can beat the longest. Candidates are tried best bound
    first (a draft scores at most its length), until none left can win or `TRIES` drafts were built, which
    bounds a step's cost: a later one rarely wins. A single path, which the verifier takes; the planner then
    cuts it to what pays, as any proposer's."""

    LOCAL = 0  # the key of the request's text in its local tree
    TRIES = 4  # the most candidate drafts built for a request in a step

    def __init__(self, config: SpeculativeConfig, max_model_len: int, planner: DraftPlanner | None = None):
        super().__init__(config, max_model_len, planner)
        self.depth = config.suffix_decoding_max_tree_depth
        self.local: dict[str, tuple[Request, SuffixTree]] = {}
        self.cache = SuffixTree(self.depth)  # the global tree
        self._cached: deque[int] = deque()  # its sequences' keys, oldest first
        self._keys = itertools.count()

    def local_tree(self, request: Request) -> SuffixTree:
        """The request's local tree, caught up with its tokens: only those that arrived since the last step."""
        entry = self.local.get(request.request_id)
        if entry is None or entry[0] is not request:
            entry = self.local[request.request_id] = (request, SuffixTree(self.depth))
        tree = entry[1]
        have = len(tree.seqs.get(self.LOCAL, ()))
        if have < request.num_tokens:
            tree.extend(self.LOCAL, request.token_ids_slice(have, request.num_tokens))
        return tree

    def draft(self, request: Request, k: int) -> list[int]:
        c = self.config
        depth, factor = self.depth, c.suffix_decoding_max_spec_factor

        def bound(length: int) -> int:  # the most a draft after a match of this length can score
            return min(k, math.ceil(factor * length), depth - length)

        tree = self.local_tree(request)
        text, suffixes = tree.seqs[self.LOCAL], tree.open[self.LOCAL]
        # (bound, match length, tree, place): the local tree's current suffixes that occurred before (whose node
        # has children), and the global tree's matches, all of them as long as its longest
        candidates: list[tuple[int, int, SuffixTree, Place | None]] = [
            (bound(len(suffixes) - i), len(suffixes) - i, tree, node)
            for i, node in enumerate(suffixes)
            if node.children
        ]
        context = text[max(0, len(text) - depth + 1) :]
        if self.cache.seqs and (match := self.cache.longest_match(context)):
            longest, place = match
            candidates += [(bound(m), m, self.cache, place if m == longest else None) for m in range(longest, 0, -1)]
        candidates.sort(key=lambda x: (-x[0], -x[1]))  # best bound first; of equal ones, the longer match
        current = set(suffixes)
        best: list[int] = []
        best_score = 0.0
        for most, length, where, place in candidates[: self.TRIES]:
            if most <= best_score:
                break
            if where is tree:
                draft, score = tree.continuation(place, most, c.suffix_decoding_min_token_prob, current)
            else:
                if place is None:  # every suffix shorter than the longest match occurs too
                    place = self.cache.find(context, len(context) - length)
                draft, score = self.cache.continuation(place, most, c.suffix_decoding_min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best

    def finish(self, requests: Iterable[Request]) -> None:
        """Drop each ended request's local tree; a finished (not aborted) one's output joins the global tree."""
        for request in requests:
            self.local.pop(request.request_id, None)
            if request.status != RequestStatus.FINISHED_ABORTED and request.output_token_ids:
                self.remember(request.output_token_ids)

    def remember(self, output: Sequence[int]) -> None:
        """Add a finished request's output to the global tree, evicting the oldest beyond the bound."""
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0:
            return
        key = next(self._keys)
        self.cache.add(key, output)
        self._cached.append(key)
        while len(self._cached) > limit:
            self.cache.remove(self._cached.popleft())


class SelfDraftProposer(Proposer):
    """The drafts the runner made after the last step with the model's own body and a cut LM head
    (inferd/engine/draft_head.py; `ModelRunner._self_draft`), handed over by the engine each step."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, planner: DraftPlanner | None = None):
        super().__init__(config, max_model_len, planner)
        self.made: dict[str, list[int]] = {}

    def take_runner_drafts(self, drafts: dict[str, list[int]]) -> None:
        self.made = drafts

    def draft(self, request: Request, k: int) -> list[int]:
        return self.made.get(request.request_id, [])[:k]


PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
    "self_draft": SelfDraftProposer,
}
