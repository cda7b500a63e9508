"""What every model class shares: the forward signature, logits, and checkpoint-name mapping."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from inferd.models.attention import AttentionMetadata
from inferd.models.layers import FusedLinear
from inferd.models.lm_head import LM_HEAD_TILE_ROWS, LMHead, allowed_tokens

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class CausalLM(nn.Module):
    """A decoder-only model over a flat batch of tokens and a paged KV cache.

    Subclasses declare how checkpoint names map onto their parameters:
    - `fused_shards`: checkpoint module name -> (our fused module name, shard index)
    - `checkpoint_prefixes`: (checkpoint prefix, our prefix) rewrites applied first
    - `ignored_checkpoint_keys`: regexes of checkpoint tensors we do not need
    """

    fused_shards: dict[str, tuple[str, int]] = {}
    checkpoint_prefixes: list[tuple[str, str]] = []
    ignored_checkpoint_keys: list[str] = [r"rotary_emb\.inv_freq"]

    def __init__(self, config):
        super().__init__()
        self.config = config

    def pin_attributes(self) -> None:
        """Put each module's submodules and parameters into its instance dict, for a model whose structure is
        final: a forward's `self.qkv_proj` or `norm.weight` is then a plain attribute read, not a call of
        `nn.Module.__getattr__`, which searches three dicts (about 400 such reads a decode step of Gemma 3 270M:
        3-7% of its batch-1 step on a 2-vCPU Xeon, docs/performance.md). Assigning a Module or a Parameter
        afterwards still works: `nn.Module.__setattr__` drops the copy first. Buffers are left out (they are
        assigned again, as the huge-page move does); so is anything that removes a submodule or parameter
        (`del`, or assigning None), which a final model does not do."""
        for module in self.modules():
            for registered in (module._modules, module._parameters):
                module.__dict__.update((k, v) for k, v in registered.items() if v is not None)

    # -- geometry the engine needs to size the KV cache ------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [tokens, vocab] in the model's dtype."""
        logits = self.lm_head(hidden)
        softcap = self._softcap()
        return logits if softcap is None else softcap(logits)

    def greedy_tokens(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """argmax of `compute_logits(hidden)` per row (first maximal index), without full rows of logits
        once `tile_lm_head` has run; over the tokens a grammar's bitmask `mask` allows, when given."""
        if isinstance(self.lm_head, LMHead):
            return self.lm_head.argmax(hidden, self._softcap(), mask)
        logits = self.compute_logits(hidden)
        if mask is not None:
            logits = logits.float().masked_fill(~allowed_tokens(mask, 0, logits.shape[1]), float("-inf"))
        return logits.argmax(dim=-1)

    def _softcap(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The config's final logit softcap as a function of the logits, or None where it has none (then the
        LM head may pick a greedy token without making logits)."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        if not cap:
            return None
        return lambda logits: torch.tanh(logits / cap) * cap

    def pack_lm_head_for_cpu(self) -> None:
        """The tiled LM head on oneDNN's blocked layout (bf16 CPU models; the body keeps dense weights, on
        which prefill's large matmuls were as fast or faster, docs/performance.md). A head tied to the
        embedding keeps its dense view for the lookups: the packed copy is extra memory (335 MB for Gemma 3
        270M in bf16)."""
        if not isinstance(self.lm_head, LMHead):
            return
        head_storage = self.lm_head.tiles[0].weight.untyped_storage().data_ptr()
        others = {
            p.untyped_storage().data_ptr() for name, p in self.named_parameters() if not name.startswith("lm_head.")
        }
        self.lm_head.pack_for_cpu(keep_dense=head_storage in others)

    def tile_lm_head(self, tile_rows: int = LM_HEAD_TILE_ROWS) -> None:
        """Replace the loaded LM head by vocabulary tiles over the same weight (after loading, before packing
        or quantizing the linear layers)."""
        if not isinstance(self.lm_head, LMHead):
            self.lm_head = LMHead(self.lm_head.weight.detach(), tile_rows)

    # -- weights ----------------------------------------------------------------------------------
    def tie_weights_if_needed(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into our parameters; complain about anything missing."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        ignored = [re.compile(p) for p in self.ignored_checkpoint_keys]
        tied = getattr(self.config, "tie_word_embeddings", False)
        for name, tensor in weights:
            for src, dst in self.checkpoint_prefixes:
                if name.startswith(src):
                    name = dst + name[len(src) :]
                    break
            if any(p.search(name) for p in ignored) or (tied and name == "lm_head.weight"):
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in self.fused_shards:
                fused_name, shard = self.fused_shards[leaf]
                fused = modules[f"{parent}.{fused_name}"]
                assert isinstance(fused, FusedLinear)
                fused.load_shard(shard, param_name, tensor)
                loaded.add(f"{parent}.{fused_name}.{param_name}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        self._check_all_loaded(params, modules, loaded)

    def _check_all_loaded(self, params, modules, loaded: set[str]) -> None:
        missing = []
        for name in params:
            module_path, _, param_name = name.rpartition(".")
            module = modules[module_path]
            if isinstance(module, FusedLinear):
                shards = [f"{name}#{i}" for i in range(len(module.out_sizes))]
                missing += [s for s in shards if s not in loaded]
            elif name not in loaded and not (
                name == "lm_head.weight" and self.lm_head.weight is self.model.embed_tokens.weight
            ):
                missing.append(name)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
