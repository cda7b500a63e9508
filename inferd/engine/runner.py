"""ModelRunner: owns the model, the KV cache tensors and the sampler; turns a step record into tokens.

It knows requests only through the step records (`inferd.engine.step`): from them it keeps its own
per-request state (block table, sampling state) and never sees the scheduler's objects. Per step it
lays the batch out flat (one-query chunks first, then multi-token prefill chunks), builds positions,
the slot mapping and block tables, runs the model, computes logits only for the chunks that sample,
and samples.

Structured requests carry a grammar matcher (`inferd.structured.grammar`): their rows' token masks are
filled on a helper thread while the forward pass runs, applied to the logits before sampling, and the
sampled token advances the matcher. Preemption keeps the matcher with the rest of the sampling state:
the recompute replays tokens the matcher has already accepted and samples only after them. A resumed
request (`SamplingParams.resume_token_ids`) starts with its delivered tokens as output: penalties count
them and its matcher has accepted them.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from inferd.config import engine_default
from inferd.engine.draft_head import DraftHead
from inferd.engine.sampler import Sampler, argmax_only, argmax_under_grammar
from inferd.engine.step import NewRequest, RunnerOutput, ScheduledChunk, SchedulerOutput
from inferd.errors import ConfigError
from inferd.measure.model import kv_bytes_per_token
from inferd.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from inferd.models.base import CausalLM
from inferd.sampling import SamplingParams
from inferd.structured.grammar import GrammarCompiler, Matcher, fill_bitmasks

logger = logging.getLogger(__name__)

# Decodes attend in padded groups: more groups waste less padding but launch more kernels.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8


@dataclass(eq=False)
class CachedRequest:
    """The runner's own state of one request, built from its `NewRequest` and chunks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)  # what this runner sampled (penalties read it)
    block_ids: list[int] = field(default_factory=list)
    matcher: Matcher | None = None  # a structured request's place in its grammar
    lora_name: str | None = None  # the LoRA adapter its rows run under


@dataclass
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: list[CachedRequest]  # in the order of logits_indices
    # speculative decoding: each sampling request's drafts ([] for most), and the positions whose argmax
    # verifies them: per request with drafts, its last known token's and every draft's, in order
    drafts: list[list[int]] = field(default_factory=list)
    verify_indices: list[int] = field(default_factory=list)
    row_adapters: list[str | None] = field(default_factory=list)  # per row of input_ids: its LoRA adapter


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = engine_default("attention_backend"),
        seed: int = engine_default("seed"),
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the cache's storage: the model's dtype, or fp8 (--kv-cache-dtype)
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        kv = self.kv_dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv, device=device), torch.zeros(shape, dtype=kv, device=device))
            for _ in range(model.num_layers)
        ]
        self.decode_kernel = self._pick_decode_kernel(attention_backend)
        self.prefill_kernel = self._pick_prefill_kernel(attention_backend)
        self.sampler = Sampler(device, seed)
        self.requests: dict[str, CachedRequest] = {}
        self.kv_connector = None  # loads K/V from outside before a step (Engine.attach_kv_connector)
        self.grammars: GrammarCompiler | None = None  # structured outputs' compiled grammars (the engine's)
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.lora = None  # LoRA adapters' slots in the model (inferd.engine.lora.LoRAManager), when served
        self.draft_head: DraftHead | None = None  # self-drafting's head (inferd/engine/draft_head.py), when on

    def _pick_decode_kernel(self, backend: str):
        if backend == "torch" or self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return None
        from inferd.models.cpu_kernels import paged_decode_kernel

        kernel = paged_decode_kernel()
        if kernel is None and backend == "cpu-kernel":
            raise ConfigError("--attention-backend cpu-kernel: the native kernel failed to build (see the log)")
        logger.info("decode attention: %s", "native CPU kernel" if kernel else "PyTorch reference")
        return kernel

    def _pick_prefill_kernel(self, backend: str):
        """The native prefill kernel (AMX-BF16 or AVX512_BF16) for bf16 on a CPU that has either; SDPA elsewhere."""
        if backend == "torch" or self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return None
        from inferd.models.cpu_kernels import prefill_attention_isa, prefill_attention_kernel

        kernel = prefill_attention_kernel()
        how = f"native CPU kernel ({prefill_attention_isa()})" if kernel else "PyTorch SDPA"
        logger.info("prefill attention: %s", how)
        return kernel

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        return block_size * kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype.itemsize)

    # -- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Apply the step record to the runner's state, load K/V from outside, run one forward pass, sample."""
        self.update_states(sched)
        finished, failed = self._load_kv(sched)
        out = self._compute(sched)
        out.finished_loading, out.failed_loading = finished, failed
        if self.draft_head is not None and any(c.num_lookahead for c in sched.chunks):
            out.draft_token_ids = self._self_draft(sched.chunks, out)
        return out

    def _self_draft(self, chunks: list[ScheduledChunk], out: RunnerOutput) -> dict[str, list[int]]:
        """Self-drafting: after the step, each chunk with `num_lookahead` drafts that many tokens past the one
        it sampled, one decode pass over all of them per draft position, the model's body with the draft head
        (`DraftHead.argmax`). Each pass writes K/V into the slots allocated for them; verification rewrites
        those positions in the next step, so nothing a draft wrote is ever read as a computed token."""
        if not self.draft_head.ready:
            return {}
        sampled = dict(zip(out.request_ids, out.token_ids, strict=True))
        live: dict[str, list[int]] = {}  # request -> [position of its last token, that token, drafts wanted]
        for c in chunks:
            token = sampled.get(c.request_id)
            if c.num_lookahead and token is not None and token not in self.requests[c.request_id].eos_token_ids:
                position = c.start + c.num_tokens - c.num_drafts + len(out.accepted_drafts.get(c.request_id, ()))
                live[c.request_id] = [position, token, c.num_lookahead]
        drafts: dict[str, list[int]] = {rid: [] for rid in live}
        while live:
            passes = [ScheduledChunk(rid, [token], pos, False, True, []) for rid, (pos, token, _) in live.items()]
            step = self.prepare(SchedulerOutput(passes))
            picked = self.draft_head.argmax(self._forward(step)[step.logits_indices])
            for state, token in zip(step.sampling, picked, strict=True):
                mine, entry = drafts[state.request_id], live[state.request_id]
                mine.append(token)
                entry[0], entry[1] = entry[0] + 1, token
                if len(mine) == entry[2] or token in state.eos_token_ids:
                    del live[state.request_id]
        return drafts

    def _load_kv(self, sched: SchedulerOutput) -> tuple[list[str], list[str]]:
        """The connector's loads of this step (requests not computed before their next step)."""
        if self.kv_connector is None or sched.kv_connector_metadata is None:
            return [], []
        result = self.kv_connector.start_load_kv(sched.kv_connector_metadata)
        return result.finished, result.failed

    def _compute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.empty:
            return RunnerOutput()
        step = self.prepare(sched)
        if any(step.drafts):
            return self._compute_with_drafts(step)
        masks = self._fill_masks(step.sampling)
        hidden = self._forward(step)
        if not step.sampling:
            return RunnerOutput()
        token_ids, logprobs = self.sample(hidden[step.logits_indices], step.sampling, masks and masks.result())
        self._append(step.sampling, [[t] for t in token_ids])
        return RunnerOutput([s.request_id for s in step.sampling], token_ids, logprobs)

    def _compute_with_drafts(self, step: StepInput) -> RunnerOutput:
        """A step where some requests carry drafts (inferd/engine/spec_decode.py): the others sample as usual.
        A greedy drafting request keeps its drafts up to the first the model's argmax disagrees with and takes
        the argmax there (or after the last draft); one LM-head pass covers every greedy request's positions.
        A sampled one keeps each draft by rejection sampling (`Sampler.verify_drafts`)."""
        plain = [i for i, d in enumerate(step.drafts) if not d]
        masks = self._fill_masks([step.sampling[i] for i in plain])
        hidden = self._forward(step)
        token_ids: list[int] = [0] * len(step.sampling)
        logprobs: list = [None] * len(step.sampling)
        if plain:
            rows = hidden[step.logits_indices[self._tensor(plain)]]
            sampled, lps = self.sample(rows, [step.sampling[i] for i in plain], masks and masks.result())
            for i, t, lp in zip(plain, sampled, lps, strict=True):
                token_ids[i], logprobs[i] = t, lp
        spans: dict[int, list[int]] = {}  # drafting request -> its rows of verify_indices
        at = 0
        for i, draft in enumerate(step.drafts):
            if draft:
                spans[i] = step.verify_indices[at : at + len(draft) + 1]
                at += len(draft) + 1
        accepted: dict[str, list[int]] = {}
        greedy = [i for i in spans if step.sampling[i].params.greedy]
        if greedy:
            picked = self.model.greedy_tokens(hidden[self._tensor([r for i in greedy for r in spans[i]])]).tolist()
            for i in greedy:
                agree, picked = picked[: len(spans[i])], picked[len(spans[i]) :]
                draft, n = step.drafts[i], 0
                while n < len(draft) and agree[n] == draft[n]:
                    n += 1
                accepted[step.sampling[i].request_id], token_ids[i] = draft[:n], agree[n]
        sampled = [i for i in spans if not step.sampling[i].params.greedy]
        if sampled:
            logits = self.model.compute_logits(hidden[self._tensor([r for i in sampled for r in spans[i]])])
            at = 0
            for i in sampled:
                rows, at = logits[at : at + len(spans[i])], at + len(spans[i])
                kept, token_ids[i] = self.sampler.verify_drafts(rows, step.sampling[i], step.drafts[i])
                accepted[step.sampling[i].request_id] = kept
        new = [[*accepted.get(s.request_id, ()), t] for s, t in zip(step.sampling, token_ids, strict=True)]
        self._append(step.sampling, new)
        return RunnerOutput([s.request_id for s in step.sampling], token_ids, logprobs, accepted)

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The model over the flat batch, each row under its request's LoRA adapter (if any)."""
        if self.lora is None:
            return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        self.lora.activate(step.row_adapters)
        try:
            return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        finally:
            self.lora.deactivate()

    def _append(self, states: list[CachedRequest], tokens: list[list[int]]) -> None:
        """The runner's copy of each request's output grows by its tokens of this step (and the draft head, if
        any, counts them)."""
        for state, new in zip(states, tokens, strict=True):
            if self.draft_head is not None:
                self.draft_head.observe(new)
            for token_id in new:
                state.output_token_ids.append(token_id)
                if state.matcher is not None and not state.matcher.accept(token_id):
                    logger.warning("request %s: token %d is outside its grammar", state.request_id, token_id)

    def _fill_masks(self, states: list[CachedRequest]) -> Future | None:
        """The grammar masks of this step's sampled rows, filled on the helper thread (xgrammar releases the
        GIL) while the forward pass runs; None when no row is constrained."""
        if not any(s.matcher is not None for s in states):
            return None
        return self._masks.submit(fill_bitmasks, [s.matcher for s in states], self.grammars.vocab_size)

    def sample(
        self, hidden: torch.Tensor, states: list[CachedRequest], bitmask: torch.Tensor | None = None
    ) -> tuple[list[int], list]:
        """Next tokens for the sampled rows: the argmax-only rows (greedy rows under a grammar too, given its
        mask) through the tiled LM head's fused argmax, the rest (sampling, logprobs, penalties) through full
        logits and the sampler. `bitmask` has a row per state (`_fill_masks`)."""
        fast = [i for i, s in enumerate(states) if argmax_only(s) or (bitmask is not None and argmax_under_grammar(s))]
        masked = bitmask is not None and any(states[i].matcher is not None for i in fast)
        if len(fast) == len(states):
            return self.model.greedy_tokens(hidden, bitmask if masked else None).tolist(), [None] * len(states)
        token_ids: list[int] = [0] * len(states)
        logprobs: list = [None] * len(states)
        if fast:
            index = self._tensor(fast)
            picked = self.model.greedy_tokens(hidden[index], bitmask[index] if masked else None)
            for i, t in zip(fast, picked.tolist(), strict=True):
                token_ids[i] = t
        slow = sorted(set(range(len(states))) - set(fast))
        rows = hidden[self._tensor(slow)] if fast else hidden
        masks = bitmask[self._tensor(slow)] if bitmask is not None and fast else bitmask
        sampled = self.sampler(self.model.compute_logits(rows), [states[i] for i in slow], masks)
        for i, t, lp in zip(slow, sampled.token_ids, sampled.logprobs, strict=True):
            token_ids[i], logprobs[i] = t, lp
        return token_ids, logprobs

    def update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_ids:
            self.requests.pop(request_id, None)
        for request_id in sched.preempted_ids:  # recomputed later into new blocks; sampling state stays
            self.requests[request_id].block_ids = []
        for new in sched.new_requests:
            self.requests[new.request_id] = self._cached_request(new)
            if self.draft_head is not None:
                self.draft_head.observe(new.prompt_token_ids)
        for chunk in sched.chunks:
            self.requests[chunk.request_id].block_ids.extend(chunk.new_block_ids)

    def _cached_request(self, new: NewRequest) -> CachedRequest:
        generator = None
        if new.params.seed is not None:  # its own, re-seeded per output position (inferd/engine/sampler.py)
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.params.seed)
        matcher = None
        if new.params.structured is not None:
            if self.grammars is None:
                raise ConfigError("a structured request reached a runner without a grammar compiler")
            matcher = self.grammars.matcher(new.params.structured)
        resumed = list(new.params.resume_token_ids or ())  # a resumed stream's output so far
        for token_id in resumed if matcher is not None else ():  # the grammar's place after them
            matcher.accept(token_id)  # the engine checked each is allowed
        return CachedRequest(
            new.request_id,
            new.prompt_token_ids,
            new.params,
            new.eos_token_ids,
            generator,
            output_token_ids=resumed,
            matcher=matcher,
            lora_name=new.lora_name,
        )

    def prepare(self, sched: SchedulerOutput) -> StepInput:
        """The flat batch. One-query chunks (decodes, and one-token prefill chunks, which attend the same
        way) take the decode attention path, sorted by length so its padded groups waste little. A decode
        carrying drafts is spread into one query per position, each attending to the cache up to itself (its
        own and the earlier drafts' K/V are written before attention reads, within each layer): verifying
        k drafts is then k + 1 decode rows, not a small prefill. Output tokens computed again (`num_recompute`)
        are rows too, where the native kernel reads K/V in place (the PyTorch path would gather every row's
        context); the prompt tokens of their chunk before them stay a prefill, in the same step."""
        rows: list[tuple[ScheduledChunk, int]] = []  # (chunk, its token) for every one-query row
        multis: list[tuple[ScheduledChunk, int]] = []  # (chunk, its first tokens computed as a prefill)
        for c in sched.chunks:
            if c.num_tokens == 1 or c.num_drafts:
                rows.extend((c, j) for j in range(c.num_tokens))
                continue
            k = c.num_tokens - c.num_recompute if self.decode_kernel is not None else c.num_tokens
            rows.extend((c, j) for j in range(k, c.num_tokens))
            if k:
                multis.append((c, k))
        rows.sort(key=lambda r: r[0].start + r[1])
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling: list[CachedRequest] = []
        drafts: list[list[int]] = []
        at: dict[str, list[int]] = {}  # request -> its rows in `ids`
        chunks: list[PrefillChunk] = []
        block_tables: list[list[int]] = []
        seq_lens: list[int] = []
        adapters: list[str | None] = []
        for c, j in rows:
            table, p = self.requests[c.request_id].block_ids, c.start + j
            adapters.append(self.requests[c.request_id].lora_name)
            at.setdefault(c.request_id, []).append(len(ids))
            ids.append(c.token_ids[j])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            block_tables.append(table)
            seq_lens.append(p + 1)
        for c, n in multis:
            table, start = self.requests[c.request_id].block_ids, c.start
            at[c.request_id] = [*range(len(ids), len(ids) + n), *at.get(c.request_id, ())]  # in position order
            adapters.extend([self.requests[c.request_id].lora_name] * n)
            chunks.append(PrefillChunk(len(ids), n, start, self._tensor(table[: -(-(start + n) // bs)])))
            ids.extend(c.token_ids[:n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        verify: list[int] = []
        # the order of the old flat batch: the chunks whose last token is a row, then the others
        ordered = [c for c, j in rows if j == c.num_tokens - 1] + [c for c, n in multis if n == c.num_tokens]
        for c in ordered:
            if c.samples:
                logits_indices.append(at[c.request_id][-1])
                sampling.append(self.requests[c.request_id])
                drafts.append(c.token_ids[c.num_tokens - c.num_drafts :] if c.num_drafts else [])
                if c.num_drafts:
                    verify.extend(at[c.request_id])
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_size=bs,
            prefills=chunks,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )
        meta.decode_groups = self._decode_groups(block_tables, seq_lens)
        return StepInput(
            self._tensor(ids),
            self._tensor(positions),
            meta,
            self._tensor(logits_indices),
            sampling,
            drafts,
            verify,
            adapters,
        )

    def _decode_groups(self, tables: list[list[int]], seq_lens: list[int]) -> list[DecodeGroup]:
        """Split the length-sorted one-query rows into up to MAX_DECODE_GROUPS groups of equal size."""
        if self.decode_kernel is not None:  # it reads every request's blocks in place: no padding to avoid
            num_groups = 1 if tables else 0
        else:
            num_groups = min(MAX_DECODE_GROUPS, -(-len(tables) // MIN_DECODE_GROUP))
        groups = []
        for g in range(num_groups):
            lo, hi = len(tables) * g // num_groups, len(tables) * (g + 1) // num_groups
            width = max(len(t) for t in tables[lo:hi])
            groups.append(
                DecodeGroup(
                    start=lo,
                    count=hi - lo,
                    block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables[lo:hi]]),
                    seq_lens=self._tensor(seq_lens[lo:hi]),
                    block_size=self.block_size,
                )
            )
        return groups

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
