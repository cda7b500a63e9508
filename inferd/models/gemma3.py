"""Gemma 3 (text): interleaved sliding-window and global layers, each kind with its own RoPE base;
q/k norm; four norms per layer; embeddings scaled by sqrt(hidden); GELU-tanh MLP; tied LM head."""

from __future__ import annotations

import torch
from torch import nn

from inferd.models.attention import AttentionMetadata
from inferd.models.base import CausalLM, KVCache
from inferd.models.layers import Linear, RMSNorm, build_rotary, residual_norm
from inferd.models.llama import Attention, GatedMLP, layer_windows


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, window: int | None):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Attention(config, window, config.attention_bias, qk_norm=True, unit_offset_norm=True)
        self.self_attn.scale = config.query_pre_attn_scalar**-0.5
        self.self_attn.softcap = config.attn_logit_softcapping
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.is_sliding = window is not None

    def forward(self, x, cos, sin, kv_cache, meta):
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x, h = residual_norm(x, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return residual_norm(x, self.mlp(h), self.post_feedforward_layernorm, None)[0]


class Gemma3Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, w) for w in layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)


class Gemma3ForCausalLM(CausalLM):
    fused_shards = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # multimodal Gemma 3 checkpoints keep the text model under model.language_model
    checkpoint_prefixes = [("model.language_model.", "model."), ("language_model.model.", "model.")]
    ignored_checkpoint_keys = [r"rotary_emb", r"vision_tower", r"multi_modal_projector", r"embed_scale"]

    def __init__(self, config, max_positions: int):
        super().__init__(config)
        self.model = Gemma3Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_global = build_rotary(config, max_positions, "full_attention")
        self.rotary_local = build_rotary(config, max_positions, "sliding_attention")
        self.embed_scale = config.hidden_size**0.5
        self.tie_weights_if_needed()

    def tie_weights_if_needed(self) -> None:
        # Gemma always ties its LM head to the embedding
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope_global = self.rotary_global(positions, x.dtype)
        rope_local = self.rotary_local(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            cos, sin = rope_local if layer.is_sliding else rope_global
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)
