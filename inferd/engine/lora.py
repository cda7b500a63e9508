"""Which LoRA adapters the engine serves, and which of them sit in the model's slots now.

`LoRAManager` owns both. The registry is the adapters by name (`add` checks an adapter against the model
before it is served; `remove` refuses one that running requests use); a request names its adapter by `model`,
as in vLLM. The slots are the `max_loras` places in the model's wrapped layers (inferd/models/lora.py): before
each step the runner calls `activate` with each token row's adapter, which loads the adapters the step needs
into free slots or the least recently used ones the step does not need, and tells the layers which slot each
row uses. A load reads the adapter's file (a few MB) unless its weights are among the `max_cpu_loras` most
recently loaded, which stay in host memory. The scheduler keeps the adapters of
running requests within `max_loras` (`Scheduler.adapter_fits`), so a step never needs more slots than there
are: a request for an adapter that does not fit waits, and is never failed for it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from inferd.config import LoRAConfig
from inferd.models.lora import LoRAAdapter, LoRAError, LoRALayers, install_lora, load_adapter_weights, read_adapter

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    """Counters for /metrics: slot loads and their time, tokens per adapter."""

    loads: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    file_reads: int = 0  # loads that read the adapter's file (the others found it in host memory)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    generation_tokens: dict[str, int] = field(default_factory=dict)


class LoRAManager:
    def __init__(self, model, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.max_loras = config.max_loras
        self.dtype = dtype
        self.device = device
        self.prefixes = list(getattr(model, "checkpoint_prefixes", []))
        self.layers: LoRALayers = install_lora(model, config.max_loras, config.max_lora_rank, dtype, device)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        # adapter -> its weights as loaded, least recently used first, at most max_cpu_loras
        self.host: OrderedDict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.stats = LoRAStats()
        for name, path in config.modules():
            self.add(name, path)

    # -- the registry ------------------------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoRAAdapter:
        """An adapter checked against the model, not yet served (a LoRAError says what is wrong)."""
        if not name or not name.strip():
            raise LoRAError("an adapter needs a name (lora_name)")
        if "," in name:  # lora_requests_info lists adapters joined by commas, as vLLM does
            raise LoRAError(f"an adapter's name may not hold a comma: {name!r}")
        return read_adapter(name, path, self.layers, self.prefixes, self.config.max_lora_rank)

    def add(self, name: str, path: str) -> LoRAAdapter:
        adapter = self.read(name, path)
        old = self.adapters.get(name)
        if old is not None and old.digest != adapter.digest:
            self.drop(name)  # new weights under an old name: the slot's and the host's copies are stale
            self.host.pop(name, None)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %s: rank %d on %s, from %s", name, adapter.rank, ", ".join(adapter.targets), path)
        return adapter

    def remove(self, name: str) -> None:
        self.adapters.pop(name)
        self.drop(name)
        self.host.pop(name, None)

    def drop(self, name: str) -> None:
        """Free `name`'s slot, if it has one (its weights are zeroed, so the slot adds nothing)."""
        slot = self.resident.pop(name, None)
        if slot is not None:
            self._write(slot, None)

    # -- the slots -------------------------------------------------------------------------------------
    def activate(self, row_adapters: list[str | None]) -> None:
        """Load the adapters these token rows use and mark each row's slot for the next forward pass."""
        needed = {a for a in row_adapters if a is not None}
        if not needed:
            self.layers.batch.clear()
            return
        if len(needed) > self.max_loras:  # the scheduler keeps a step within the slots
            raise RuntimeError(f"a step mixes {len(needed)} adapters but there are {self.max_loras} slots")
        for name in needed:
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in needed - self.resident.keys():
            self._load(name, self._free_slot(needed))
        slots = [-1 if a is None else self.resident[a] for a in row_adapters]
        self.layers.batch.activate(slots, self.device)

    def deactivate(self) -> None:
        self.layers.batch.clear()

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(name for name in self.resident if name not in keep)  # least recently used first
        self.stats.evictions += 1
        return self.resident.pop(victim)

    def _load(self, name: str, slot: int) -> None:
        started = time.perf_counter()
        weights = self.host.pop(name, None)
        if weights is None:
            weights = load_adapter_weights(self.adapters[name], self.prefixes)
            self.stats.file_reads += 1
        self.host[name] = weights  # the most recently used
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        self._write(slot, weights)
        self.resident[name] = slot
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - started

    def _write(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Every layer's part in `slot`: the adapter's A and B where it has them, zeros elsewhere."""
        weights = weights or {}
        by_part = {self.layers.parts[m]: ab for m, ab in weights.items()}
        for path, layer in self.layers.layers.items():
            for part in range(len(layer.out_sizes)):
                a, b = by_part.get((path, part), (None, None))
                layer.set_slot(slot, part, a, b)

    # -- what requests and metrics read -----------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.adapters[name].key

    def count_tokens(self, name: str, prompt: int, generated: int) -> None:
        self.stats.prompt_tokens[name] = self.stats.prompt_tokens.get(name, 0) + prompt
        self.stats.generation_tokens[name] = self.stats.generation_tokens.get(name, 0) + generated
