"""The Llama family (Llama 2/3, Mistral) and Qwen2/Qwen3: pre-norm decoder, RoPE, GQA, SwiGLU.

Qwen2 adds a bias on q/k/v; Qwen3 drops it and RMS-normalises each head of q and k.
"""

from __future__ import annotations

import torch
from torch import nn

from inferd.models.attention import AttentionMetadata, paged_attention
from inferd.models.base import CausalLM, KVCache
from inferd.models.layers import ACTIVATIONS, FusedLinear, Linear, RMSNorm, apply_rotary, build_rotary, residual_norm


def layer_windows(config) -> list[int | None]:
    """Sliding window per layer, from `layer_types` where the config has it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if window and getattr(config, "use_sliding_window", True):
        return [window] * config.num_hidden_layers
    return [None] * config.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, config, window: int | None, qkv_bias: bool, qk_norm: bool, unit_offset_norm: bool = False):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(config.hidden_size, [q, kv, kv], bias=qkv_bias)
        self.o_proj = Linear(q, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.window = window
        self.scale = self.head_dim**-0.5
        self.softcap = None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset_norm) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset_norm) if qk_norm else None
        self.qk_rope = None  # the native q/k norm + rotary (use_native_kernels): the same arithmetic in one call

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        written = False  # K/V already in the cache
        if self.qk_rope is not None and qkv.dtype == cos.dtype and qkv.dim() == 2 and qkv.device.type == "cpu":
            written = kv_cache[0].dtype in (qkv.dtype, torch.bfloat16) and kv_cache[0].is_contiguous()
            q, k = self._native_qk(qkv, cos, sin, (*kv_cache, meta.slot_mapping) if written else ())
            v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_dim :]
            v = v.view(-1, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = self.qkv_proj.split(qkv)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap, kv_written=written
        )
        return self.o_proj(o)

    def _native_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write: tuple = ()) -> list:
        """q and k, normed and rotated in one call; `write`: (k_cache, v_cache, slots) to store k and v in too."""
        norm = self.q_norm
        qw, kw = (norm.weight, self.k_norm.weight) if norm is not None else (_NO_WEIGHT, _NO_WEIGHT)
        eps, unit = (norm.eps, norm.unit_offset) if norm is not None else (0.0, False)
        return self.qk_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, qw, kw, unit, eps, *write)


_NO_WEIGHT = torch.empty(0)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.act_name = act
        #: the native act(gate) * up in one call (`use_native_kernels`), for the activations it knows
        self.gated_act = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gated_act is not None and gate_up.dim() == 2 and gate_up.device.type == "cpu":
            return self.down_proj(self.gated_act(gate_up, self.gate_up_proj.out_sizes[0]))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, window: int | None, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, window, qkv_bias, qk_norm)
        act = getattr(config, "hidden_act", "silu")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x, h = residual_norm(x, h, None, self.post_attention_layernorm)
        return x + self.mlp(h)


class DecoderBody(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = layer_windows(config)
        self.layers = nn.ModuleList(DecoderLayer(config, w, qkv_bias, qk_norm) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    fused_shards = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, max_positions: int):
        super().__init__(config)
        bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = DecoderBody(config, bias, self.qk_norm)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = build_rotary(config, max_positions)
        self.tie_weights_if_needed()

    def forward(self, input_ids, positions, kv_caches: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
