"""Serve a GGUF checkpoint with exactly its own quantized weights (`--quantization gguf`).

A GGUF (the default model is Q4_K_M) stores each weight matrix as blocks of a GGML type: Q5_0, Q8_0, Q4_K, Q6_K
... (4.5-8.5 bits a weight). inferd converts the file once to a float folder (loader.py), builds the model from
it, and with this mode then puts each linear layer back on the file's own blocks: a `GGUFLinear` decodes its
rows once into tiles (a code a byte, in the int8 kernel's layout, with each group's factor) and the native
kernel (`kernels/gguf_linear_cpu.cpp`) multiplies by them, so the weights a step uses are the file's values, the
same values llama.cpp computes with, and only the activations are rounded (to int8 in groups of 32, as
llama.cpp's Q8_0). Decoding the blocks at every step instead cost more than the bytes it saved
(docs/performance.md).

Each layer's blocks are checked at load against the float weights the model was built from: they must
dequantize to exactly those values (a row order is found for q/k where the converter permuted them, as
transformers does for Llama-family GGUFs). A layer whose tensor is missing, of a type without a kernel, or
that does not match stays on the int8 path (`quant.Int8Linear`), and the log says which and why. The LM head's
vocabulary tiles take their rows of the file's output (or tied embedding) tensor; the embedding lookup keeps
the float table.

`--quantization auto` serves such a file in int8 (faster from a few rows up), and gives each body layer whose
blocks have compact tiles a `CompactBlocks` for 1-`COMPACT_MAX_ROWS` activation rows: the same file values at
the file's own bits (Q5_0 5.5 a weight, Q4_K 6), where a batch-1 step is bound by the bytes it reads.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from inferd.models.cpu_kernels import named_in_profiles
from inferd.models.layers import FusedLinear, Linear
from inferd.models.lm_head import LMHead

logger = logging.getLogger(__name__)

#: GGML types the kernel reads, by name -> GGML's type code
GGUF_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# activation rows up to which the tile kernel (integer products) runs; above, chunks of weight rows are widened
# into the activations' dtype for the dense matmul. float32 rows take the kernel at every count, as int8's do
# (its integer products outrun an fp32 matmul); bf16 rows above 64 take the bf16 matmul, which AMX-BF16 runs faster
# than these tiles from 128 rows (int8's own kernel, unlike these tiles, takes bf16 rows at every count on AVX-512).
GGUF_TILE_MAX_ROWS = {torch.float32: 1 << 62, torch.bfloat16: 64}
GGUF_CHUNK_ROWS = 2048  # weight rows dequantized at a time
#: activation rows up to which an int8 layer of a GGUF (`--quantization auto`) reads its compact blocks instead
COMPACT_MAX_ROWS = 3


class GGUFLinear(nn.Module):
    """A linear layer on a GGUF's blocks: `segments`, each (GGML type code, uint8 [rows, row bytes]) as the file
    stores them, are its output rows in order (a fused q/k/v layer whose v the file stores in another type has
    several). They are packed once (`gguf_pack`) into tiles of 8 rows: the codes a byte each, interleaved as the
    int8 kernel's tiles, with each group's float factor (and a k-quant's offset), the file's exact values in 9-10
    bits a weight; the blocks themselves are not kept."""

    out_sizes: list[int]

    def __init__(self, segments: list[tuple[int, torch.Tensor]], in_features: int, bias, kernels):
        super().__init__()
        self.in_features = in_features
        self.types = [int(t) for t, _ in segments]
        self.rows = [int(w.shape[0]) for _, w in segments]
        self.out_features = sum(self.rows)
        # (codes, a, b, s) of each segment, flat as the kernel takes them; plain attributes, not buffers:
        # model.to(bfloat16) must not round the float factors and offsets
        self.tiles: list[torch.Tensor] = []
        for kind, w in segments:
            self.tiles += kernels.gguf_pack(w.contiguous(), kind, in_features)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.kernels = kernels

    def _segment(self, i: int) -> list[torch.Tensor]:
        return self.tiles[4 * i : 4 * i + 4]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)

    def weight_bytes(self) -> int:
        """What a pass over the layer reads: the tiles' codes, factors and offsets."""
        return sum(t.numel() * t.element_size() for t in self.tiles)

    def dequantized(self, dtype: torch.dtype = torch.float32, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The weights, rows [lo, hi) (all by default), exactly as the file's blocks dequantize."""
        hi = self.out_features if hi is None else hi
        parts, first = [], 0
        for i, (kind, rows) in enumerate(zip(self.types, self.rows, strict=True)):
            a, b = max(lo - first, 0), min(hi - first, rows)
            if a < b:
                parts.append(self.kernels.gguf_unpack(self._segment(i), kind, self.in_features, a, b))
            first += rows
        return torch.cat(parts).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self._forward_rows(x)
        y = self._forward_rows(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_rows(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = x2.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return self._forward_rows(x2.float()).to(dtype)
        if x2.shape[0] <= GGUF_TILE_MAX_ROWS[dtype]:
            kernel = self.kernels.gguf_linear
            return named_in_profiles("inferd::gguf_linear", kernel, x2, self.tiles, self.types, self.rows, self.bias)
        return named_in_profiles("inferd::gguf_linear_dense", self._dense, x2)

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        """Many rows: chunks of the weights' rows widened for the dense matmul."""
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype)
        for lo in range(0, self.out_features, GGUF_CHUNK_ROWS):
            hi = min(lo + GGUF_CHUNK_ROWS, self.out_features)
            torch.mm(x2, self.dequantized(x2.dtype, lo, hi).t(), out=y[:, lo:hi])
        return y if self.bias is None else y + self.bias.to(x2.dtype)

    def extra_repr(self) -> str:
        names = {code: name for name, code in GGUF_TYPES.items()}
        kinds = "+".join(names[t] for t in self.types)
        return f"in_features={self.in_features}, out_features={self.out_features}, GGUF {kinds} blocks in tiles"


class CompactBlocks:
    """A layer's weights as the GGUF's blocks, in compact tiles (`gguf_pack_compact`: 16 rows a tile, the
    codes at the file's bits) for a few activation rows: `gguf_linear_compact` gives the bits `GGUFLinear`
    does on the same blocks. Held by an `Int8Linear` (`small`), which takes it for up to `max_rows` rows."""

    max_rows = COMPACT_MAX_ROWS

    def __init__(self, segments: list[tuple[int, torch.Tensor]], in_features: int, bias, kernels):
        self.in_features = in_features
        self.types = [int(t) for t, _ in segments]
        self.rows = [int(w.shape[0]) for _, w in segments]
        self.tiles = [kernels.gguf_pack_compact(w.contiguous(), t, in_features) for t, w in segments]
        self.bias = None if bias is None else bias.detach().float().clone()
        self.kernels = kernels

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.gguf_linear_compact
        return named_in_profiles(
            "inferd::gguf_linear_compact", kernel, x2, self.tiles, self.types, self.rows, self.bias
        )

    def weight_bytes(self) -> int:
        return sum(t.numel() for t in self.tiles)

    def dequantized(self) -> torch.Tensor:
        """The weights (float32 [N, K]), exactly as the file's blocks dequantize."""
        unpack = self.kernels.gguf_unpack_compact
        parts = [
            unpack(t, kind, self.in_features, 0, n)
            for t, kind, n in zip(self.tiles, self.types, self.rows, strict=True)
        ]
        return torch.cat(parts)


def _tensor_name_map(architecture: str, num_layers: int):
    import gguf

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
    return None if arch is None else gguf.get_tensor_name_map(arch, num_layers)


def _head_rows_order(n: int, heads: int) -> torch.Tensor:
    """The row order transformers' GGUF loader gives q/k of Llama-family files (it undoes llama.cpp's
    permutation for rotary): our row i is the file's row order[i]."""
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)


class _Blocks:
    """The GGUF file's weight matrices by name, as uint8 [rows, row bytes] with their GGML type (read through a
    memory map at the offsets recorded when the file was converted, `loader.GGUFSource`)."""

    def __init__(self, source, num_layers: int):
        self.file = np.memmap(source.path, dtype=np.uint8, mode="r")
        self.tensors = source.tensors
        self.names = _tensor_name_map(source.architecture, num_layers)

    def lookup(self, module_name: str, prefixes: list[tuple[str, str]] = ()):
        """(type name, uint8 rows) of the tensor stored for a module name (ours, or ours with a prefix
        rewritten back to a checkpoint's spelling), or None."""
        spellings = [module_name] + [c + module_name[len(o) :] for c, o in prefixes if module_name.startswith(o)]
        names = [self.names.get_name(n) for n in spellings] if self.names is not None else []
        name = next((n for n in names if n), None)
        t = self.tensors.get(f"{name}.weight") if name else None
        if t is None:
            return None
        kind, rows, row_bytes, offset = t
        if kind not in GGUF_TYPES:
            return kind, None
        data = np.array(self.file[offset : offset + rows * row_bytes]).reshape(rows, row_bytes)
        return kind, torch.from_numpy(data)


def _rows(rows: torch.Tensor | None, lo: int, n: int) -> torch.Tensor | None:
    return None if rows is None else rows[lo : lo + n]


def _shards(model: nn.Module, path: str, layer: nn.Module) -> list[str]:
    """The checkpoint module names whose rows make up our layer at `path`, in row order."""
    parent, _, leaf = path.rpartition(".")
    fused: dict[str, list[str]] = {}
    for ckpt, (ours, _) in sorted(getattr(model, "fused_shards", {}).items(), key=lambda kv: kv[1][1]):
        fused.setdefault(ours, []).append(ckpt)
    names = fused.get(leaf, [leaf]) if isinstance(layer, FusedLinear) else [leaf]
    return [f"{parent}.{n}" for n in names]


def _matching_rows(kernels, type_code: int, rows: torch.Tensor, want: torch.Tensor, heads: list[int]):
    """`rows` in the order that dequantizes exactly to `want` (float32 [N, K]), or None."""
    n, k = want.shape
    got = kernels.gguf_dequantize(rows, type_code, k, 0, rows.shape[0])
    if torch.equal(got, want):
        return rows
    for h in heads:
        if h and n % (2 * h) == 0:
            order = _head_rows_order(n, h)
            if torch.equal(got[order], want):
                return rows[order].contiguous()
    return None


def _file_layers(model: nn.Module, source, kernels, head: bool = True):
    """Each linear layer (the LM head's tiles too, with `head`) with the file's blocks that make up its rows, in
    order: yields (parent, child name, layer, path, [(GGML type code, uint8 rows)] or None, why not). Blocks must
    dequantize exactly to the layer's float weights."""
    config = model.config
    blocks = _Blocks(source, config.num_hidden_layers)
    heads = [getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", 0)]
    lm_head = getattr(model, "lm_head", None)
    head_tiles = (
        {id(t): lo for lo, t in zip(lm_head.offsets, lm_head.tiles, strict=True)} if isinstance(lm_head, LMHead) else {}
    )
    tied = getattr(config, "tie_word_embeddings", False)
    head_tensor = blocks.lookup("model.embed_tokens" if tied else "lm_head") if head and head_tiles else None
    for path_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or (not head and id(child) in head_tiles):
                continue
            name = f"{path_name}.{child_name}" if path_name else child_name
            weight = child.weight.detach().float()
            if id(child) in head_tiles:
                lo = head_tiles[id(child)]
                found = [head_tensor and (head_tensor[0], _rows(head_tensor[1], lo, weight.shape[0]))]
                wants = [weight]
            else:
                shard_names = _shards(model, name, child)
                found = [blocks.lookup(n, getattr(model, "checkpoint_prefixes", [])) for n in shard_names]
                sizes = getattr(child, "out_sizes", [weight.shape[0]])
                wants = list(weight.split(sizes))
            segments, why = [], None
            for shard, want in zip(found, wants, strict=True):
                if not shard:
                    why = "no tensor for it in the file"
                elif shard[1] is None:
                    why = f"stored as {shard[0]}, which has no block kernel"
                else:
                    rows = _matching_rows(kernels, GGUF_TYPES[shard[0]], shard[1], want.contiguous(), heads)
                    why = None if rows is not None else "its blocks do not dequantize to the loaded weights"
                    segments.append((GGUF_TYPES[shard[0]], rows))
                if why:
                    break
            yield parent, child_name, child, name, None if why else segments, why


def use_gguf_blocks(model: nn.Module, source, kernels) -> tuple[int, dict[str, str]]:
    """Replace each linear layer (the LM head's tiles included) by a `GGUFLinear` on the file's blocks where
    they dequantize exactly to its float weights. Returns (how many layers were replaced, {layer: why not}
    for the others, which the caller quantizes otherwise)."""
    replaced, skipped = 0, {}
    for parent, child_name, child, name, segments, why in _file_layers(model, source, kernels):
        if why:
            skipped[name] = why
            continue
        layer = GGUFLinear(segments, child.weight.shape[1], child.bias, kernels)
        layer.out_sizes = list(getattr(child, "out_sizes", [layer.out_features]))
        setattr(parent, child_name, layer)
        replaced += 1
    return replaced, skipped


#: GGML types with compact tiles (the kernel's `compact_type`)
COMPACT_TYPES = {GGUF_TYPES[t] for t in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K")}


def compact_blocks(model: nn.Module, source, kernels) -> tuple[dict[int, CompactBlocks], dict[str, str]]:
    """For `--quantization auto`'s int8 on a GGUF: each body layer's blocks as `CompactBlocks`, by the id of the
    float layer they dequantize to, where all its segments have compact tiles and those read fewer bytes than
    int8 (a layer stored in Q6_K, or all in Q8_0, keeps int8 at every row count). The LM head keeps int8 (its
    Q8_0 would read more). Returns ({id: blocks}, {layer: why not})."""
    found, skipped = {}, {}
    for _, _, child, name, segments, why in _file_layers(model, source, kernels, head=False):
        if why is None and (kinds := {t for t, _ in segments} - COMPACT_TYPES):
            names = {code: n for n, code in GGUF_TYPES.items()}
            why = f"stored as {', '.join(sorted(names[k] for k in kinds))}, which has no compact tiles"
        if why is None:
            blocks = CompactBlocks(segments, child.weight.shape[1], child.bias, kernels)
            if blocks.weight_bytes() < child.weight.numel():
                found[id(child)] = blocks
                continue
            why = "its blocks read no fewer bytes than int8"
        skipped[name] = why
    return found, skipped
