"""LoRA adapters on a loaded model: PEFT's format read and checked, every adapter's products batched per step.

A LoRA adapter adds to a linear layer W a low-rank product: y = W x + s B (A x), with A [r, in], B [out, r]
and s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). PEFT saves A and B as `<layer>.lora_A.weight` and
`<layer>.lora_B.weight` in `adapter_model.safetensors`, beside an `adapter_config.json` (rank, alpha, target
modules, base model). inferd adapts the layers every model family has: q/k/v/o and the MLP's gate/up/down.

`install_lora` wraps each such layer of a loaded model, once, in a `LoRALinear` with `max_loras` slots of A
and B zero-padded to `max_lora_rank`, whatever the base layer computes with (float, int8 or int4 weights,
packed or dense): the base output is what it is without adapters, and the adapters' products are added. A
fused layer (q/k/v, gate/up) keeps one A and B per part, as the checkpoint has them.

One step may mix adapters and the base model. `LoRABatch.activate` reads the step's rows (each row's adapter
slot, -1 for the base model) once per step. On CPU every layer then adds all its rows' products in one call of
the native kernel `lora_add` (inferd/models/kernels/lora_cpu.cpp): each row reads only its own adapter's A and
B, so the cost follows the rows and the adapters they use. Elsewhere (a GPU, or no compiler), rows in runs of
LONG_RUN or more under one adapter (a prefill chunk's rows are contiguous) take two dense matmuls per part on
their slice, and the other rows a masked pair of matmuls over every slot up to the highest in use, each row
keeping only its own slot's columns. Rows of the base model get nothing added. On this CPU the kernel was
faster than the matmuls in every case measured, decode and prefill (`benchmarks/lora.py --kernels`,
docs/lora.md): bf16 matmuls of rank 8 pay a fixed cost each and compute little. With no adapter in the step a
layer is its base layer and nothing more.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from inferd.errors import InvalidRequestError

#: the layers an adapter may target, by the names checkpoints (and PEFT's target_modules) give them
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: without the native kernel: rows under one adapter from which a run takes dense matmuls on its slice
LONG_RUN = 32
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served on this model: missing, malformed, too large a rank, or made for
    another base model."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter as read from its folder and checked against the model (its tensors stay on disk)."""

    name: str
    path: Path
    rank: int
    scaling: float
    targets: tuple[str, ...]  # the layer names it adapts (q_proj, ...)
    base_model: str | None  # adapter_config.json's base_model_name_or_path
    digest: str  # sha256 of the weights file: what the prefix cache keys this adapter's blocks by

    @property
    def key(self) -> str:
        """The adapter's identity in prefix-cache keys: blocks computed under it are never another's."""
        return f"{self.name}@{self.digest[:16]}"


@dataclass
class LoRABatch:
    """Which adapter slot the rows of the current forward pass use, shared by every `LoRALinear` of a model:
    `runs` (start, end, slot) of LONG_RUN or more rows under one adapter, and `slots` the other rows' slots
    (-1 for the base model and the runs' rows; None when none of them has an adapter)."""

    rank: int
    native: bool = False  # the layers add with the native kernel: every row goes to `slots`, no runs
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    slots: torch.Tensor | None = None
    width: int = 0  # the masked matmuls' columns: (highest slot in `slots` + 1) x rank
    mask: torch.Tensor | None = None  # built on first use, without the native kernel

    def activate(self, slots: list[int], device: torch.device) -> None:
        """`slots`: per token row its adapter slot, -1 for the base model."""
        self.clear()
        short = list(slots)
        i = 0
        while i < len(slots) and not self.native:  # the kernel takes every row: no runs to find
            j = i
            while j < len(slots) and slots[j] == slots[i]:
                j += 1
            if slots[i] >= 0 and j - i >= LONG_RUN:
                self.runs.append((i, j, slots[i]))
                short[i:j] = [-1] * (j - i)
            i = j
        top = max(short, default=-1)
        if top >= 0:
            self.slots = torch.tensor(short, dtype=torch.long, device=device)
            self.width = (top + 1) * self.rank

    @property
    def active(self) -> bool:
        return self.slots is not None or bool(self.runs)

    def masked(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, width]: 1 in a row's own slot's columns."""
        if self.mask is None:
            columns = torch.arange(self.width, device=self.slots.device) // self.rank
            self.mask = (self.slots[:, None] == columns[None, :]).to(dtype)
        return self.mask

    def clear(self) -> None:
        self.runs, self.slots, self.width, self.mask = [], None, 0, None


class LoRALinear(nn.Module):
    """A base linear layer (of any weight format) plus `max_loras` slots of LoRA weights per output part."""

    def __init__(self, base: nn.Module, batch: LoRABatch, max_loras: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.batch = batch
        self.out_sizes = list(getattr(base, "out_sizes", None) or [base.out_features])
        self.offsets = [sum(self.out_sizes[:i]) for i in range(len(self.out_sizes))]
        self.in_features = base.in_features
        self.out_features = base.out_features
        rows = max_loras * batch.rank
        # A as [slots x rank, in] and B transposed, [slots x rank, out]: a slot's rows are contiguous
        self.lora_a = [torch.zeros(rows, self.in_features, dtype=dtype, device=device) for _ in self.out_sizes]
        self.lora_b = [torch.zeros(rows, size, dtype=dtype, device=device) for size in self.out_sizes]
        self.native = _native_kernel() if batch.native else None  # lora_add

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one part's A [r, in] and scaled B [out, r] into `slot` (None: zeros, the part not adapted)."""
        r = self.batch.rank
        rows = slice(slot * r, (slot + 1) * r)
        self.lora_a[part][rows].zero_()
        self.lora_b[part][rows].zero_()
        if a is not None and b is not None:
            self.lora_a[part][rows][: a.shape[0]].copy_(a)
            self.lora_b[part][rows][: b.shape[1]].copy_(b.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.active:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        r = batch.rank
        for start, end, slot in batch.runs:  # long runs under one adapter: dense matmuls on their slice
            rows, ranks = slice(start, end), slice(slot * r, (slot + 1) * r)
            for a, b, offset, size in zip(self.lora_a, self.lora_b, self.offsets, self.out_sizes, strict=True):
                y2[rows, offset : offset + size].addmm_(torch.mm(x2[rows], a[ranks].T), b[ranks])
        if batch.slots is None:
            return y
        if self.native is not None:  # the other rows: each reads its own adapter's A and B
            self.native(y2, x2, self.lora_a, self.lora_b, self.offsets, batch.slots, r)
            return y
        mask, width = batch.masked(x.dtype), batch.width
        for a, b, offset, size in zip(self.lora_a, self.lora_b, self.offsets, self.out_sizes, strict=True):
            shrink = torch.mm(x2, a[:width].T).mul_(mask)
            y2[:, offset : offset + size].addmm_(shrink, b[:width])
        return y

    def extra_repr(self) -> str:
        return f"parts={self.out_sizes}, slots={self.lora_a[0].shape[0] // self.batch.rank}, rank={self.batch.rank}"


def _native_kernel():
    from inferd.models.cpu_kernels import lora_kernel

    return lora_kernel()


@dataclass
class LoRALayers:
    """A model's wrapped layers by module path, and what maps a checkpoint layer name onto them."""

    batch: LoRABatch
    layers: dict[str, LoRALinear]
    # checkpoint module path (model.layers.0.self_attn.q_proj) -> (wrapped module path, part)
    parts: dict[str, tuple[str, int]] = field(default_factory=dict)

    def shapes(self, module: str) -> tuple[int, int]:
        """(in, out) of a checkpoint layer's part."""
        path, part = self.parts[module]
        layer = self.layers[path]
        return layer.in_features, layer.out_sizes[part]


def install_lora(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRALayers:
    """Wrap every q/k/v/o and gate/up/down layer of `model` (after it is loaded, quantized and packed)."""
    native = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _native_kernel() is not None
    batch = LoRABatch(max_rank, native)
    layers: dict[str, LoRALinear] = {}
    parts: dict[str, tuple[str, int]] = {}
    fused = {target: shard for target, shard in getattr(model, "fused_shards", {}).items() if target in TARGETS}
    fused_names = {name for name, _ in fused.values()}
    for parent_path, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name not in fused_names and child_name not in TARGETS:
                continue
            path = f"{parent_path}.{child_name}" if parent_path else child_name
            wrapped = LoRALinear(child, batch, max_loras, dtype, device)
            setattr(parent, child_name, wrapped)
            layers[path] = wrapped
            if child_name in fused_names:
                for target, (name, shard) in fused.items():
                    if name == child_name:
                        parts[f"{parent_path}.{target}"] = (path, shard)
            else:
                parts[path] = (path, 0)
    return LoRALayers(batch, layers, parts)


# -- PEFT's format ---------------------------------------------------------------------------------------------
def read_adapter(name: str, path: str | Path, lora: LoRALayers, checkpoint_prefixes, max_rank: int) -> LoRAAdapter:
    """An adapter folder read and checked against the model: every failure is a LoRAError saying what to fix."""
    from safetensors import safe_open

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise LoRAError(f"adapter {name!r}: {folder} is not a folder (PEFT's: {CONFIG_FILE}, {WEIGHTS_FILE})")
    config = _read_config(name, folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} has no valid rank `r` (got {rank!r})")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}; raise it to {rank}")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("rank_pattern", "rank_pattern"),
                      ("alpha_pattern", "alpha_pattern")):  # fmt: skip
        if config.get(key):
            raise LoRAError(f"adapter {name!r} uses {what}, which inferd does not serve (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r} trains biases (bias={config['bias']!r}); inferd serves bias='none' only")
    _check_targets(name, config.get("target_modules"), lora)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise LoRAError(f"adapter {name!r}: {folder} has no {WEIGHTS_FILE} (it holds {found})")
    targets: set[str] = set()
    try:
        with safe_open(weights, "pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as e:  # a truncated or foreign file: safetensors' own message says which
        raise LoRAError(f"adapter {name!r}: cannot read {weights.name}: {e}") from None
    pairs: dict[str, dict[str, tuple]] = {}
    for key, shape in shapes.items():
        module, ab = _module_of(name, key, checkpoint_prefixes)
        pairs.setdefault(module, {})[ab] = shape
    if not pairs:
        raise LoRAError(f"adapter {name!r}: {weights.name} holds no lora_A/lora_B weights")
    base = config.get("base_model_name_or_path")
    for module, ab in pairs.items():
        if module not in lora.parts:
            leaf = module.rpartition(".")[2]
            if leaf in TARGETS:
                raise LoRAError(f"adapter {name!r} adapts {module}, which this model does not have{_made_for(base)}")
            raise LoRAError(f"adapter {name!r} adapts {module}; inferd adapts only {', '.join(TARGETS)}")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: {module} has lora_{'A' if 'B' in ab else 'B'} missing")
        n_in, n_out = lora.shapes(module)
        if ab["A"] != (rank, n_in) or ab["B"] != (n_out, rank):
            raise LoRAError(
                f"adapter {name!r}: {module} has A {list(ab['A'])} and B {list(ab['B'])}, but this model's layer "
                f"takes {n_in} inputs to {n_out} outputs at rank {rank}{_made_for(base)}"
            )
        targets.add(module.rpartition(".")[2])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    return LoRAAdapter(name, folder, rank, float(scaling), tuple(sorted(targets)), base, digest)


def _made_for(base: str | None) -> str:
    return f" (the adapter was trained on {base})" if base else " (it was trained on another base model)"


def _read_config(name: str, folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"adapter {name!r}: {folder} has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"adapter {name!r} is a {config['peft_type']} adapter; inferd serves LORA adapters")
    return config


def _check_targets(name: str, targets, lora: LoRALayers) -> None:
    """A list of target modules must name layers the model has and inferd adapts (a regex or "all-linear" is
    checked through the weights instead)."""
    if not isinstance(targets, list):
        return
    have = {m.rpartition(".")[2] for m in lora.parts}
    for t in targets:
        if t not in TARGETS:
            raise LoRAError(f"adapter {name!r} targets {t!r}; inferd adapts only {', '.join(TARGETS)}")
        if t not in have:
            raise LoRAError(f"adapter {name!r} targets {t!r}, which this model does not have")


def _module_of(name: str, key: str, checkpoint_prefixes) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj', 'A')."""
    m = _KEY.match(key)
    if m is None:
        raise LoRAError(f"adapter {name!r}: {key} is not a LoRA weight (lora_A/lora_B)")
    module = m["module"].removeprefix("base_model.model.")
    for src, dst in checkpoint_prefixes:
        if module.startswith(src):
            module = dst + module[len(src) :]
            break
    return module, m["ab"]


def load_adapter_weights(adapter: LoRAAdapter, checkpoint_prefixes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module path -> (A [r, in], B [out, r] times the adapter's scaling), in float32."""
    from safetensors.torch import load_file

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(adapter.path / WEIGHTS_FILE).items():
        module, ab = _module_of(adapter.name, key, checkpoint_prefixes)
        pairs.setdefault(module, {})[ab] = tensor.float()
    return {module: (ab["A"], ab["B"] * adapter.scaling) for module, ab in pairs.items()}
