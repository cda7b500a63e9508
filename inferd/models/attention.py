"""Paged attention, PyTorch reference backend (CPU and CUDA).

Per layer, K and V live in [num_blocks, block_size, num_kv_heads, head_dim] tensors. Each step writes
the new tokens' K/V into their slots, then attends: decode tokens (one query each) in a few padded
groups of similar length, prefill chunks one request at a time with a causal mask offset by what was
computed before. Sliding-window layers only gather and attend over the blocks inside their window.

The decode path gathers each request's blocks into a padded batch before SDPA: that copy is the price
of doing paged attention without a custom kernel, so the runner sorts decodes by length and splits
them into groups to keep the padding (copied and attended for nothing) small.

Native CPU kernels take over where they are built (the runner puts them in the metadata): decodes in fp32 or
bf16 (`kernels/paged_decode_cpu.cpp`), and prefill chunks in bf16 on CPUs with AMX-BF16 or AVX512_BF16
(`kernels/prefill_attention_cpu.cpp`); both read K/V from the block tables in place.

The cache may be fp8 (`--kv-cache-dtype`): new K/V are rounded into it as they are written, and every path
(kernels, gathers, a first chunk's own fresh K/V) attends over those rounded values, widened to q's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inferd.models.cpu_kernels import named_in_profiles
from inferd.models.dtypes import KV_CACHE_DTYPES


@dataclass
class PrefillChunk:
    start: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_len: int  # tokens of this request computed in earlier steps (or found in the prefix cache)
    block_table: torch.Tensor  # [num_blocks] block ids covering context_len + num_tokens


@dataclass
class DecodeGroup:
    """Decode tokens [start, start + count) of the flat batch, one per request, padded to a common width."""

    start: int
    count: int
    block_tables: torch.Tensor  # [count, max_blocks], padded with block 0
    seq_lens: torch.Tensor  # [count], including the token being decoded
    block_size: int
    _views: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def view(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, [count, 1, 1, keys] bool mask) for a layer with this window, built once per step."""
        if window not in self._views:
            self._views[window] = self._build(window)
        return self._views[window]

    def _build(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        bs, seq_lens, tables = self.block_size, self.seq_lens, self.block_tables
        num_blocks = (seq_lens + bs - 1) // bs
        first = torch.zeros_like(seq_lens) if window is None else (seq_lens - window).clamp(min=0) // bs
        width = int((num_blocks - first).max())
        cols = first[:, None] + torch.arange(width, device=tables.device)[None, :]
        tables = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
        pos = (cols[:, :, None] * bs + torch.arange(bs, device=tables.device)).flatten(1)
        mask = pos < seq_lens[:, None]
        if window is not None:
            mask &= pos > (seq_lens[:, None] - 1 - window)
        return tables, mask[:, None, None, :]


@dataclass
class AttentionMetadata:
    """Where every token of the flat batch lives and what it may attend to. Decodes come first."""

    slot_mapping: torch.Tensor  # [num_tokens]
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    #: the native kernel reading K/V in place (CPU, fp32 or bf16), or None for the PyTorch reference
    decode_kernel: Callable | None = None
    #: the native prefill kernel (CPU, bf16, AMX-BF16 or AVX512_BF16; reads K/V in place, writes its output), or
    #: None for SDPA
    prefill_kernel: Callable | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    _prefill_masks: dict[tuple[int, int | None], tuple[int, torch.Tensor | None]] = field(default_factory=dict)

    def prefill_view(self, index: int, window: int | None) -> tuple[int, torch.Tensor | None]:
        """(first key position, [q, keys] bool mask) for one prefill chunk, built once per step.

        A sliding-window layer starts at the block holding the earliest key any query of the chunk can
        see; the mask is None where plain causal SDPA over the chunk's own keys does the job.
        """
        key = (index, window)
        if key not in self._prefill_masks:
            chunk = self.prefills[index]
            ctx, total = chunk.context_len, chunk.context_len + chunk.num_tokens
            first = 0 if window is None else max(0, ctx - window + 1) // self.block_size * self.block_size
            if ctx == 0 and (window is None or window >= total):
                self._prefill_masks[key] = (0, None)
            else:
                device = chunk.block_table.device
                q_pos = torch.arange(ctx, total, device=device)[:, None]
                k_pos = torch.arange(first, total, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                self._prefill_masks[key] = (first, mask)
        return self._prefill_masks[key]


FP8 = frozenset(d for d in KV_CACHE_DTYPES.values() if d.itemsize == 1)  # the one-byte cache dtypes


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K or V in the cache's dtype, rounded to nearest: fp8 clamped to the format's finite range first (a
    cast alone turns e4m3's overflow into NaN); float32 K/V into a bf16 cache (`--kv-cache-dtype bfloat16`)."""
    if dtype in FP8:
        top = torch.finfo(dtype).max
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)  # x itself where it is in the cache's dtype already


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as attention sees it once cached: rounded through a cache of another dtype and back."""
    return x if cache_dtype == x.dtype else to_cache(x, cache_dtype).to(x.dtype)


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes where torch's CPU indexing ops have no kernel for its dtype (fp8)."""
    return t.view(torch.uint8) if t.dtype in FP8 else t


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = _indexable(to_cache(new, cache.dtype))
        _indexable(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, rows)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, kv_heads, head_dim] in dtype."""
    return _indexable(cache)[block_table].view(cache.dtype).flatten(-4, -3).to(dtype)


def _sdpa(q, k, v, mask, scale, softcap, is_causal=False):
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D]; GQA by head grouping."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal and mask is None, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    # the scores in float32, as flash attention keeps them: a bf16 product rounds each score before the tanh
    # and the softmax (twice the error of SDPA without a softcap, on CPUs where no native kernel runs)
    scores = torch.tanh((q.float() @ k.float().transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None and is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(q.dtype) @ v


def _native_decode(q, k_cache, v_cache, meta: AttentionMetadata, group: DecodeGroup, scale, window, softcap):
    """One decode group through the native kernel, which reads K/V in place: [count, H, D]."""
    return named_in_profiles(
        "inferd::paged_decode_cpu",
        meta.decode_kernel,
        q.contiguous(), k_cache, v_cache, group.block_tables, group.seq_lens, scale, window or 0, softcap or 0.0,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> attention output [T, H * D]. `kv_written`: k and v
    are in the cache already (the native q/k kernel wrote them)."""
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    groups = meta.decode_groups
    native = meta.decode_kernel is not None
    if native and not meta.prefills and len(groups) == 1 and groups[0].count == q.shape[0]:
        # decodes only (the runner gives the native kernel one group): its output is the answer, with no copy
        return _native_decode(q, k_cache, v_cache, meta, groups[0], scale, window, softcap).flatten(1)
    out = torch.empty_like(q)
    for group in groups:
        s, e = group.start, group.start + group.count
        if native:
            out[s:e] = _native_decode(q[s:e], k_cache, v_cache, meta, group, scale, window, softcap)
            continue
        tables, mask = group.view(window)
        keys = _gather(k_cache, tables, q.dtype).transpose(1, 2)
        values = _gather(v_cache, tables, q.dtype).transpose(1, 2)
        out[s:e] = _sdpa(q[s:e].unsqueeze(2), keys, values, mask, scale, softcap).squeeze(2)
    native_prefill = (
        meta.prefill_kernel is not None
        and q.dtype == torch.bfloat16
        and (k_cache.dtype == torch.bfloat16 or k_cache.dtype in FP8)
        and q.shape[-1] % 32 == 0
    )
    for i, chunk in enumerate(meta.prefills):
        s, e = chunk.start, chunk.start + chunk.num_tokens
        if native_prefill:
            named_in_profiles(
                "inferd::prefill_attention_cpu",
                meta.prefill_kernel,
                q[s:e].contiguous(), k_cache, v_cache, chunk.block_table, chunk.context_len, scale,
                window or 0, softcap or 0.0, out[s:e],
            )  # fmt: skip
            continue
        first, mask = meta.prefill_view(i, window)
        if chunk.context_len == 0:  # nothing earlier: the chunk's own K/V, as the cache holds them
            keys, values = as_cached(k[s:e], k_cache.dtype), as_cached(v[s:e], v_cache.dtype)
        else:
            total = chunk.context_len + chunk.num_tokens
            table = chunk.block_table[first // meta.block_size :]
            keys = _gather(k_cache, table, q.dtype)[: total - first]
            values = _gather(v_cache, table, q.dtype)[: total - first]
        o = _sdpa(
            q[s:e].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            mask,
            scale,
            softcap,
            is_causal=True,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out.flatten(1)
