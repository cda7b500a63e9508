"""ModelRunner: owns the model and the KV cache tensors, turns a scheduled step into one forward pass.

It lays the batch out flat (decodes first, then prefill chunks), builds positions, the slot mapping
and block tables, runs the model, and computes logits only for the requests that sample this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.scheduler import SchedulerOutput
from inferd.errors import ConfigError
from inferd.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from inferd.models.base import CausalLM
from inferd.request import Request

logger = logging.getLogger(__name__)

# Decodes attend in padded groups: more groups waste less padding but launch more kernels.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8


@dataclass
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_requests: list[Request]  # in the order of logits_indices


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCacheManager,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
    ):
        self.model = model
        self.kv = kv
        self.device = device
        self.dtype = dtype
        shape = (kv.num_blocks, kv.block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]
        self.decode_kernel = self._pick_decode_kernel(attention_backend)

    def _pick_decode_kernel(self, backend: str):
        if backend == "torch" or self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        from inferd.models.cpu_kernels import paged_decode_kernel

        kernel = paged_decode_kernel()
        if kernel is None and backend == "cpu-kernel":
            raise ConfigError("--attention-backend cpu-kernel: the native kernel failed to build (see the log)")
        logger.info("decode attention: %s", "native CPU kernel" if kernel else "PyTorch reference")
        return kernel

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[Request]]:
        """One forward pass. Returns logits [num_sampling, vocab] and the requests they belong to."""
        step = self.prepare(sched)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        if not step.sampling_requests:
            return None, []
        return self.model.compute_logits(hidden[step.logits_indices]), step.sampling_requests

    def prepare(self, sched: SchedulerOutput) -> StepInput:
        n_of = sched.num_scheduled_tokens
        # decodes sorted by length, so the padded groups attention gathers them in waste little
        decodes = sorted((r for r in sched.requests if n_of[r.request_id] == 1), key=lambda r: r.num_tokens)
        prefills = [r for r in sched.requests if n_of[r.request_id] > 1]
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Request] = []
        chunks: list[PrefillChunk] = []
        block_tables: list[list[int]] = []
        for r in decodes + prefills:
            start, n = r.num_computed_tokens, n_of[r.request_id]
            table = self.kv.block_ids(r.request_id)
            first = len(ids)
            ids.extend(r.token_ids_slice(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                block_tables.append(table)
            else:
                chunks.append(PrefillChunk(first, n, start, self._tensor(table[: -(-(start + n) // bs)])))
            if start + n == r.num_tokens:  # the chunk reaches the end: a new token is sampled
                logits_indices.append(len(ids) - 1)
                sampling.append(r)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), block_size=bs, prefills=chunks, decode_kernel=self.decode_kernel
        )
        meta.decode_groups = self._decode_groups(decodes, block_tables)
        return StepInput(self._tensor(ids), self._tensor(positions), meta, self._tensor(logits_indices), sampling)

    def _decode_groups(self, decodes: list[Request], tables: list[list[int]]) -> list[DecodeGroup]:
        """Split the length-sorted decodes into up to MAX_DECODE_GROUPS groups of equal size."""
        if self.decode_kernel is not None:  # it reads every request's blocks in place: no padding to avoid
            num_groups = 1 if decodes else 0
        else:
            num_groups = min(MAX_DECODE_GROUPS, -(-len(decodes) // MIN_DECODE_GROUP))
        groups = []
        for g in range(num_groups):
            lo, hi = len(decodes) * g // num_groups, len(decodes) * (g + 1) // num_groups
            width = max(len(t) for t in tables[lo:hi])
            groups.append(
                DecodeGroup(
                    start=lo,
                    count=hi - lo,
                    block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables[lo:hi]]),
                    seq_lens=self._tensor([r.num_computed_tokens + 1 for r in decodes[lo:hi]]),
                    block_size=self.kv.block_size,
                )
            )
        return groups

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
