"""A loaded model's facts in the units a roofline reasons in: weight bytes a forward pass reads, KV bytes
per token (and per query at a context), FLOPs per token.

The labs, the benchmarks and the engine's KV sizing take them from here. Weight bytes are what the
layers store, as each linear layer reports it (`weight_bytes()`: float, oneDNN-packed, int8 and int4
layers alike, the LM head's tiles included); the embedding is a gather of a few rows and not counted.
FLOPs count 2 per weight per token for the decoder layers, the LM head only where a token is sampled,
and attention (QK^T and PV) over each token's visible context, a sliding-window layer's at most its window.

Nothing here imports torch or the models: `model_facts` reads a model through the attributes inferd's
`CausalLM` has (`config`, `num_layers`, `num_kv_heads`, `head_dim`, `model.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of K and V one token holds across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * elem_bytes


def weight_bytes(model: Any, rows: int | None = None) -> int:
    """Bytes of weights one forward pass reads: every linear layer's, as stored (see the module docstring); of
    `rows` activation rows, where a layer reads other weights for a few rows (`Int8Linear.bytes_at`)."""
    total = 0
    for m in model.modules():
        if rows is not None and callable(getattr(m, "bytes_at", None)):
            total += m.bytes_at(rows)
        elif callable(getattr(m, "weight_bytes", None)):
            total += m.weight_bytes()
    return total


@dataclass(frozen=True)
class ModelFacts:
    """A loaded model's size: parameters, bytes, FLOPs per token."""

    name: str
    dtype: str
    elem_bytes: int  # of a weight in the model's dtype
    kv_elem_bytes: int  # of a K or V element in the cache's dtype
    hidden: int
    vocab: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    body_params: int  # the decoder layers' matmul weights
    lm_head_params: int
    weight_bytes: int  # what a forward pass reads (`weight_bytes`)
    windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    tied_embeddings: bool = False  # the LM head is the embedding's matrix

    @property
    def resident_params(self) -> int:
        """Parameters a replica holds in memory: the decoder layers', the embedding's and, unless tied to it,
        the LM head's."""
        return self.body_params + self.vocab * self.hidden + (0 if self.tied_embeddings else self.lm_head_params)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_elem_bytes)

    def seen(self, context: int) -> int:
        """Keys one query attends to at this context, summed over the layers (a sliding layer: its window)."""
        return sum(min(context, w) if w else context for w in self.windows)

    def kv_bytes_read(self, context: int) -> int:
        """K/V bytes one query reads at this context."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_elem_bytes * self.seen(context)

    def flops_per_token(self, context: int, sampled: bool = True) -> int:
        attention = 4 * self.seen(context) * self.num_heads * self.head_dim
        return 2 * self.body_params + attention + (2 * self.lm_head_params if sampled else 0)

    def prefill_flops(self, length: int) -> int:
        """FLOPs of one prefill of `length` tokens: every token through the body, the LM head once."""
        return sum(self.flops_per_token(i + 1, sampled=False) for i in range(length)) + 2 * self.lm_head_params

    def roofline_step_s(self, batch: int, context: int, flops: float, bandwidth: float, elem_bytes: int) -> float:
        """Seconds of one decode step of `batch` at this context on a machine of `flops` FLOP/s and `bandwidth`
        bytes/s, weights and KV in a dtype of `elem_bytes`: the larger of reading the bytes and doing the
        FLOPs, no overheads (a projection, not a measurement)."""
        weights = (self.body_params + self.lm_head_params) * elem_bytes
        nbytes = weights + batch * self.kv_bytes_read(context) * elem_bytes / self.kv_elem_bytes
        return max(nbytes / bandwidth, batch * self.flops_per_token(context) / flops)

    def prefill_intensity(self, length: int) -> float:
        """FLOPs per byte of that prefill, reading the weights once and writing each token's K and V."""
        return self.prefill_flops(length) / (self.weight_bytes + length * self.kv_bytes_per_token)


def model_facts(model: Any, dtype: Any, kv_dtype: Any = None, name: str = "") -> ModelFacts:
    """The facts of inferd's loaded `model` with weights in `dtype` and the KV cache in `kv_dtype` (torch
    dtypes; the cache in the weights' dtype when None)."""
    cfg = model.config
    layers = model.model.layers
    # count from the linear shapes: packed (oneDNN) and quantized layers hold no dense weight to sum
    body = sum(m.in_features * m.out_features for m in layers.modules() if hasattr(m, "out_features"))
    return ModelFacts(
        name=name,
        dtype=str(dtype).removeprefix("torch."),
        elem_bytes=dtype.itemsize,
        kv_elem_bytes=(kv_dtype or dtype).itemsize,
        hidden=cfg.hidden_size,
        vocab=cfg.vocab_size,
        num_layers=model.num_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        body_params=body,
        lm_head_params=cfg.vocab_size * cfg.hidden_size,
        weight_bytes=weight_bytes(model),
        windows=tuple(getattr(layer.self_attn, "window", None) for layer in layers),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
