"""Self-drafting's head: the model's own LM head cut to the tokens its traffic uses most.

A small model with a large vocabulary spends most of a decode step's bytes in its LM head (Gemma 3 270M:
640 x 262,144, 62% of the default model's weights). Drafting with the model's own body and only the rows of
the `draft_vocab_size` most frequent tokens (FR-Spec's frequency-ranked draft vocabulary, arXiv 2502.14856,
with the model itself as the drafter) reads a fraction of those bytes per draft token, and the draft is the
model's own argmax whenever that token is among the rows kept: the body's hidden state is exactly the one
verification computes. The frequencies are the engine's own: every prompt and output token is counted as it
passes, and the head is rebuilt from the counts each time they double (drafting waits for the first build,
after as many tokens as the head has rows, or 256). The rows are the head's weights as the model computes
with them (read back through the head itself, whatever its layout), stored the way the head stores them
(int8 rows for an int8 head).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from inferd.models.layers import Linear
from inferd.models.lm_head import LMHead
from inferd.models.quant import Int8Linear

FIRST_BUILD_TOKENS = 256  # tokens counted before the first head is built (fewer for a smaller head)


class DraftHead:
    """Counts tokens; scores hidden states over the most frequent ones (`argmax`)."""

    def __init__(self, model: nn.Module, size: int):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.size = min(size, self.vocab_size)
        self.counts = np.zeros(self.vocab_size, dtype=np.int64)
        self.counted = 0
        self.next_build = min(FIRST_BUILD_TOKENS, self.size)
        self.ids: torch.Tensor | None = None  # the vocabulary ids of the head's rows, ascending
        self.head: nn.Module | None = None
        self.builds = 0

    def observe(self, token_ids: Iterable[int]) -> None:
        """Count tokens that passed through the engine (a prompt, a step's outputs)."""
        ids = np.fromiter(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        np.add.at(self.counts, ids, 1)
        self.counted += len(ids)

    @property
    def ready(self) -> bool:
        """A head exists or can be built now."""
        return self.head is not None or self.counted >= self.next_build

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        """Per row of `hidden` (final-norm outputs), the most likely of the head's tokens. Softcapping is
        monotonic, so the argmax of the raw rows is the capped logits' argmax."""
        if self.counted >= self.next_build:
            self._build()
        assert self.head is not None and self.ids is not None
        return self.ids[self.head(hidden).argmax(dim=-1).cpu()].tolist()

    def _build(self) -> None:
        seen = np.flatnonzero(self.counts)
        top = seen if len(seen) <= self.size else seen[np.argpartition(self.counts[seen], -self.size)[-self.size :]]
        ids = torch.from_numpy(np.sort(top))
        self.ids, self.head = ids, cut_head(self.model, ids)
        self.next_build = 2 * self.counted
        self.builds += 1


def cut_head(model: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear layer computing the model's logits of tokens `ids` only, stored like the model's head."""
    head = model.lm_head
    tiles, offsets = (head.tiles, head.offsets) if isinstance(head, LMHead) else ([head], [0])
    param = next(model.parameters())
    device = param.device
    dtype = param.dtype if param.is_floating_point() else torch.float32
    hidden = model.config.hidden_size
    eye = torch.eye(hidden, dtype=dtype, device=device)
    rows = []
    with torch.no_grad():
        for lo, tile in zip(offsets, tiles, strict=True):
            n = tile.out_features
            mine = ids[(ids >= lo) & (ids < lo + n)] - lo
            if len(mine):
                rows.append(tile(eye).float().T[mine.to(device)])  # the weights as the tile computes with them
    weight = torch.cat(rows)
    layer = Linear(hidden, len(ids), bias=False, device="meta")
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if isinstance(tiles[0], Int8Linear):
        return Int8Linear.from_linear(layer, tiles[0].native)
    return layer
