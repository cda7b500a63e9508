"""Paged attention, PyTorch reference backend (CPU and CUDA).

Per layer, K and V live in [num_blocks, block_size, num_kv_heads, head_dim] tensors. Each step writes
the new tokens' K/V into their slots, then attends: decode tokens (one query each) as one padded
batch, prefill chunks one request at a time with a causal mask offset by what was computed before.
Sliding-window layers only look at the last `window` positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_len: int  # tokens of this request computed in earlier steps (or found in the prefix cache)
    block_table: torch.Tensor  # [num_blocks] block ids covering context_len + num_tokens


@dataclass
class AttentionMetadata:
    """Where every token of the flat batch lives and what it may attend to. Decodes come first."""

    slot_mapping: torch.Tensor  # [num_tokens]
    block_size: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes], including the token being decoded
    prefills: list[PrefillChunk] = field(default_factory=list)
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _prefill_masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_len] bool: which gathered key positions each decode query sees."""
        if window not in self._decode_masks:
            seq_lens = self.decode_seq_lens
            max_len = self.decode_block_tables.shape[1] * self.block_size
            pos = torch.arange(max_len, device=seq_lens.device)
            mask = pos[None, :] < seq_lens[:, None]
            if window is not None:
                mask &= pos[None, :] > (seq_lens[:, None] - 1 - window)
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """[q, context + q] bool causal (and windowed) mask; None where plain causal SDPA does the job."""
        key = (index, window)
        if key not in self._prefill_masks:
            chunk = self.prefills[index]
            total = chunk.context_len + chunk.num_tokens
            if chunk.context_len == 0 and (window is None or window >= total):
                self._prefill_masks[key] = None
            else:
                device = chunk.block_table.device
                q_pos = torch.arange(chunk.context_len, total, device=device)[:, None]
                k_pos = torch.arange(total, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                self._prefill_masks[key] = mask
        return self._prefill_masks[key]


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, kv_heads, head_dim]."""
    g = cache[block_table]
    return g.flatten(-4, -3)


def _sdpa(q, k, v, mask, scale, softcap, is_causal=False):
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D]; GQA by head grouping."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal and mask is None, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None and is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


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
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> attention output [T, H * D]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        keys = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)
        values = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
        o = _sdpa(q[:nd].unsqueeze(2), keys, values, meta.decode_mask(window), scale, softcap)
        out[:nd] = o.squeeze(2)
    for i, chunk in enumerate(meta.prefills):
        s, e = chunk.start, chunk.start + chunk.num_tokens
        if chunk.context_len == 0:
            keys, values = k[s:e], v[s:e]  # nothing earlier: attend over the chunk's own fresh K/V
        else:
            total = chunk.context_len + chunk.num_tokens
            keys = _gather(k_cache, chunk.block_table)[:total]
            values = _gather(v_cache, chunk.block_table)[:total]
        o = _sdpa(
            q[s:e].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            meta.prefill_mask(i, window),
            scale,
            softcap,
            is_causal=True,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out.flatten(1)
