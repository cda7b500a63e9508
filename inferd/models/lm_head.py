"""The LM head in vocabulary tiles, with a greedy argmax fused over them.

For a small model with a large vocabulary (Gemma 3 270M: 640 x 262,144) the LM head is most of a decode
step's FLOPs and bytes. `LMHead` holds it as row tiles of the vocabulary, each an ordinary `Linear`
(so the oneDNN packing and int8 quantization apply to tiles like to any other linear layer), computed in
the model's dtype. A request that only needs the argmax (greedy, no logprobs, no penalties) never gets a
full row of logits: `argmax` walks the tiles and keeps a running maximum, so only one tile of logits
exists at a time. Ties resolve to the first maximal index, as `torch.argmax` over the full row does
(tiles are visited in order and a later tile replaces the best only when strictly greater); NaN logits
are not supported on that path. Where the tiles are native int8 joined in one buffer (`quant.join_int8_tiles`)
and nothing transforms the logits, the int8 kernel folds its outputs into the argmax itself (`int8_argmax`):
no logits are written at all, which took a 32-row head from 10.4 to 8.8 ms on a Xeon with AMX. A greedy row
under a grammar passes the grammar's token bitmask, and only the tokens it allows compete: the same token as
masking the full row to -inf and taking its argmax, without that row or the pass over it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from inferd.models.cpu_kernels import named_in_profiles
from inferd.models.layers import Linear

LM_HEAD_TILE_ROWS = 16384  # 262,144 rows -> 16 tiles; [32 x 16384] fp32 logits are 2 MiB
#: rows up to which joined int8 tiles (`quant.join_int8_tiles`) take the whole head in one kernel call: at 4 rows the
#: logits of Gemma 3 270M's 262,144 tokens are 4 MiB
JOINED_MAX_ROWS = 4

Transform = Callable[[torch.Tensor], torch.Tensor]


class LMHead(nn.Module):
    """Vocabulary-tiled projection hidden -> logits. Tiles view the weight they were built from (no copy)."""

    def __init__(self, weight: torch.Tensor, tile_rows: int = LM_HEAD_TILE_ROWS):
        super().__init__()
        vocab, hidden = weight.shape
        self.vocab_size = vocab
        self.offsets = list(range(0, vocab, tile_rows))
        self.tiles = nn.ModuleList()
        for lo in self.offsets:
            rows = weight[lo : lo + tile_rows]
            tile = Linear(hidden, rows.shape[0], bias=False, device="meta")
            tile.weight = nn.Parameter(rows, requires_grad=False)
            self.tiles.append(tile)
        #: the native fold of a tile into the running argmax (`use_native_kernels`), or None for torch ops
        self.native_argmax = None
        #: (native int8 module, packed, scale) of the whole head where its int8 tiles view one buffer
        #: (`quant.join_int8_tiles`)
        self.joined: tuple | None = None

    def _joined_for(self, x: torch.Tensor) -> bool:
        """Whether rows x can take the joined head: the tiles' kernel would take them (CPU rows, float32 or bf16)."""
        return self.joined is not None and x.dim() == 2 and x.device.type == "cpu" and self.tiles[0].takes_kernel(x)

    def _whole(self, x: torch.Tensor) -> torch.Tensor | None:
        """All the logits in one kernel call, where the tiles are joined and x is a few CPU rows; else None."""
        if x.shape[0] > JOINED_MAX_ROWS or not self._joined_for(x):
            return None
        native, packed, scale = self.joined
        return named_in_profiles("inferd::int8_linear", native.int8_linear, x, packed, scale, None)

    def pack_for_cpu(self, keep_dense: bool) -> None:
        """Every tile on oneDNN (`Linear.pack_for_cpu`); `keep_dense` where the tiles view a weight another
        module still reads (a head tied to the embedding), so nothing is freed under it."""
        for tile in self.tiles:
            if isinstance(tile, Linear):
                tile.pack_for_cpu(drop_dense=not keep_dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Full logits [tokens, vocab]."""
        if (whole := self._whole(x)) is not None:
            return whole
        if len(self.tiles) == 1:
            return self.tiles[0](x)
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def argmax(
        self, x: torch.Tensor, transform: Transform | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """argmax over the vocabulary of transform(logits), tile by tile; first maximal index on ties. `mask`:
        int32 token bitmask words [rows, ceil(vocab / 32)] (xgrammar's layout), only set bits compete."""
        if mask is None and transform is None and self._joined_for(x):
            native, packed, scale = self.joined
            best_val = torch.full((x.shape[0],), float("-inf"))
            best_idx = torch.zeros(x.shape[0], dtype=torch.long)
            named_in_profiles("inferd::int8_argmax", native.int8_argmax, x, packed, scale, None, best_val, best_idx, 0)
            return best_idx
        native = self.native_argmax is not None and x.device.type == "cpu" and x.dim() == 2
        if mask is None and (whole := self._whole(x)) is not None:
            logits = whole if transform is None else transform(whole)
            # torch's argmax along a row is a scalar loop: 264 us over 262,144 logits on the Zen 3, the fold ~20
            return self._native_fold([(0, logits)], x.shape[0], None) if native else logits.argmax(dim=-1)
        if native and (mask is None or all(lo % 32 == 0 for lo in self.offsets)):  # the kernel reads whole words
            return self._native_fold(self._tile_logits(x, transform), x.shape[0], mask)
        best_val = best_idx = None
        for lo, logits in self._tile_logits(x, transform):
            if mask is not None:
                logits = logits.float().masked_fill(~allowed_tokens(mask, lo, logits.shape[1]), float("-inf"))
            val, idx = logits.max(dim=-1)
            if best_val is None:
                best_val, best_idx = val, idx
                continue
            better = val > best_val
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx + lo, best_idx)
        assert best_idx is not None
        return best_idx

    def _native_fold(self, pieces, rows: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The argmax of (first vocabulary row, logits) pieces, folded in order by the native kernel."""
        best_val = torch.full((rows,), float("-inf"))
        best_idx = torch.zeros(rows, dtype=torch.long)
        words = torch.empty(0, dtype=torch.int32) if mask is None else mask.contiguous()
        for lo, logits in pieces:
            self.native_argmax(logits.contiguous(), best_val, best_idx, lo, words)
        return best_idx

    def _tile_logits(self, x: torch.Tensor, transform: Transform | None):
        """(first vocabulary row, transform(logits)) per tile, one tile of logits at a time."""
        for lo, tile in zip(self.offsets, self.tiles, strict=True):
            logits = tile(x)
            yield lo, logits if transform is None else transform(logits)


def allowed_tokens(mask: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """bool [rows, n]: which of tokens lo..lo+n the bitmask words allow (tokens past its words: none)."""
    ids = torch.arange(lo, lo + n, device=mask.device)
    words = ids >> 5
    inside = words < mask.shape[1]
    bits = (mask[:, words.clamp(max=mask.shape[1] - 1)] >> (ids & 31)) & 1
    return (bits != 0) & inside
