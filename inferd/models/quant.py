"""Quantized weights for the linear layers and the LM head (`--quantization int8|int4|gguf`; gguf, a GGUF's own
blocks, is inferd/models/gguf_blocks.py).

int8, per output channel, symmetric: each weight row is stored as int8 `q` with one float32 scale,
w ~= q * scale, scale = max|row| / 127 (a quarter of fp32's bytes, half of bf16's: what decoding a small batch
is bound by). The weights are quantized from the float values the model was loaded with: for a GGUF
(Q4_K_M and the like) that is the float folder transformers dequantized it into, so a GGUF tensor is
dequantized once to float, then quantized to int8 per channel (not converted block-to-block).

int4, group-wise and asymmetric (as llama.cpp's Q4_1): 32 consecutive weights of a row share a step and a
low value, w ~= q * step + low with q in 0..15: 4 bits per weight plus 2 for the group's float32 step and
low (6 in all, against bf16's 16 and int8's 8). A group already on a 16-level grid (a GGUF's 4-bit block
dequantized to float) keeps its grid (to float rounding) instead of being quantized a second time. A layer
whose input width is not a multiple of 32 stays int8 (logged), and so does the LM head. Without a compiler
int4 cannot run fast: it is then a ConfigError, not a silent crawl.

Kernels, picked per call from the number of activation rows M (the bounds chosen on Gemma 3 270M's shapes;
the reasons in docs/performance.md):
- decode (int8 M <= NATIVE_MAX_ROWS, int4 M <= INT4_FUSED_MAX_ROWS): our native kernels
  (`kernels/int8_linear_cpu.cpp`, `kernels/int4_linear_cpu.cpp`) quantize each activation row to int8 in
  groups of 32 (as llama.cpp's Q8_0) and sum the products in int32 (AVX-512 VNNI, AMX from 8 rows, AVX2, or
  a portable loop, chosen when the kernel is compiled for the CPU), so a decode step is bound by the weight
  bytes it streams; from 8 rows, bf16 rows on AVX-512 (AMX or VNNI) go in groups of 128 where K allows (a
  quarter of the per-group float work, which bounded AMX and took a quarter of the VNNI blocks' instructions).
  int8 holds its weights in the kernel's tiled layout (`int8_pack`).
  The activations' rounding to int8 is the one numeric change these modes make beyond the weights; the
  quality it costs is measured (benchmarks/quality.py).
- float32 rows (the CPUs without native bf16), and bf16 rows where the kernel is built for AVX-512 VNNI (with
  or without AMX): the int8 kernel at every row count, prefill included: its integer products outrun a matmul
  on the widened weights (an fp32 matmul does a quarter of `vpmaddubsw` + `vpmaddwd`'s products an
  instruction; `vpdpbusd` does twice `vdpbf16ps`'s, AMX's TDPBSUD twice TDPBF16PS's, and neither reads a
  widened copy). Prefill's activations are then rounded to int8 as a decode step's are.
- many bf16 rows otherwise (bf16 forced on a CPU without AVX-512, or without the native kernel): the weights are
  widened (int8: q * scale, rounded once to the activations' dtype, by the native `int8_unpack`; exactly q,
  scaled after the matmul, without it) or unpacked (int4, a chunk of rows at a time into a cache-sized
  buffer) for the dense matmul (AVX512_BF16 for bf16), which is compute-bound there; the activations are not
  quantized.
- int8 without its native kernel (no compiler): `torch.ops.aten._weight_int8pack_mm` for a few bf16 rows
  (only where K is a multiple of 16: torch 2.13's kernel gives wrong results otherwise), widening otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferd.errors import ConfigError
from inferd.models import huge_pages
from inferd.models.cpu_kernels import named_in_profiles
from inferd.models.gguf_blocks import COMPACT_MAX_ROWS
from inferd.models.layers import Linear
from inferd.models.lm_head import LMHead

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4", "gguf")

# bf16 rows up to which the int8-reading kernels beat widening the weights for the dense matmul (see module
# doc): torch's packed op without our kernel; ours, below the point on Gemma 3 270M's shapes where a bf16
# matmul on widened weights stops being bound by their bytes. float32 rows take our kernel at every count (an
# fp32 matmul is slower than its integer products), and so do bf16 rows where our kernel is built for AVX-512
# VNNI (vpdpbusd or AMX's TDPBSUD against vdpbf16ps or AMX-BF16 on widened weights).
INT8PACK_MAX_ROWS = 8
NATIVE_MAX_ROWS = 64
# torch 2.13's bf16 `_weight_int8pack_mm` on CPU returns garbage (or crashes) unless K is a multiple of 16
INT8PACK_K_MULTIPLE = 16
INT4_GROUP = 32
# rows up to which int4's fused kernel (integer products, nothing unpacked) beats unpacking chunks for the
# dense matmul (~16 on Gemma 3 270M's shapes; 12 leaves a margin); the chunk of weight rows unpacked at a
# time (2048 x 640 bf16 = 2.5 MiB: stays in L2/L3)
INT4_FUSED_MAX_ROWS = 12
INT4_CHUNK_ROWS = 2048


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32), w ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class QuantizedLinear(nn.Module):
    """What every quantized layer shares: a fused q/k/v or gate/up layer splits its output as FusedLinear's
    does (`out_sizes` is copied from the layer it replaces)."""

    out_sizes: list[int]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)


def bf16_rows_at_every_count(native) -> bool:
    """Whether bf16 rows take the int8 kernel `native` at every row count, as float32 rows do: where it is built
    for AVX-512 VNNI (AMX or not) its integer products outrun a bf16 matmul on widened weights (module doc)."""
    return native.isa().startswith("avx512-vnni")


def int8_rows_path(native) -> str:
    """Where an int8 layer's rows go on this CPU, in words (`Int8Linear.takes_kernel`'s rule), for the log."""
    if native is None:
        return "torch's ops on the int8 weights (no native int8 kernel)"
    kernel = f"the native int8 kernel ({native.isa()}), activations rounded to int8 in groups"
    if bf16_rows_at_every_count(native):
        return f"{kernel}, at every row count"
    return f"{kernel}: float32 rows at every count, bfloat16 rows up to {NATIVE_MAX_ROWS} (more widen the weights)"


class Int8Linear(QuantizedLinear):
    """A linear layer with int8 weights and per-channel float32 scales; activations in any float dtype.

    With the native module (`cpu_kernels.int8_module()`) the weights are held only in its tiled layout
    (`packed`, from `int8_pack`): its kernel reads that layout, and many rows unpack it for the dense matmul.
    Without it they stay a plain [N, K] int8 `qweight` for torch's ops."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, native=None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.native = native
        if native is not None:
            self.register_buffer("packed", native.int8_pack(q))
        else:
            self.register_buffer("qweight", q)
        # plain attributes, not buffers: model.to(bfloat16) must not round the scales
        self.scale = scale.float()
        self._scales: dict[torch.dtype, torch.Tensor] = {torch.float32: self.scale}
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.int8pack_ok = self.in_features % INT8PACK_K_MULTIPLE == 0
        self.all_rows = native is not None and bf16_rows_at_every_count(native)
        #: a GGUF's own blocks for a few rows (`gguf_blocks.CompactBlocks`, --quantization auto), or None
        self.small = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, native=None) -> Int8Linear:
        q, scale = quantize_int8(linear.weight)
        return cls(q, scale, linear.bias, native)

    def int8_weight(self) -> torch.Tensor:
        """The weights as [N, K] int8, whichever layout holds them."""
        if self.native is None:
            return self.qweight
        return self._widened(torch.float32).to(torch.int8)

    def weight_bytes(self) -> int:
        """What a pass over the layer reads: its int8 weights (with the tiles' padding) and scales."""
        weights = self.packed if self.native is not None else self.qweight
        return weights.numel() + self.scale.numel() * self.scale.element_size()

    def bytes_at(self, rows: int) -> int:
        """What a pass of `rows` activation rows reads: the compact blocks' bytes where they take those rows."""
        small = self.small
        return small.weight_bytes() if small is not None and rows <= small.max_rows else self.weight_bytes()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.int8_weight().float() * self.scale[:, None]).to(dtype)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scales:
            self._scales[dtype] = self.scale.to(dtype)
        return self._scales[dtype]

    def _widened(self, dtype: torch.dtype, scaled: bool = False) -> torch.Tensor:
        """The weights as [N, K] in dtype: q (exact: |q| <= 127), or q * scale rounded once to dtype."""
        if self.native is None:
            w = self.qweight.to(dtype)
            return w * self._scale(dtype)[:, None] if scaled else w
        unpack = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        scale = self.scale if scaled else None
        return self.native.int8_unpack(self.packed, self.out_features, self.in_features, unpack, scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # every call of a decode step: no reshape or view around the kernel (88 calls a step here)
            return self._forward_rows(x)
        y = self._forward_rows(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], self.out_features)

    def takes_kernel(self, x2: torch.Tensor) -> bool:
        """Whether rows x2 [M, K] take the native kernel (in x's dtype) rather than a dense matmul."""
        dtype = x2.dtype
        return self.native is not None and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and (self.all_rows or x2.shape[0] <= NATIVE_MAX_ROWS))
        )

    def _forward_rows(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = x2.dtype
        small = self.small
        if small is not None and x2.shape[0] <= small.max_rows and dtype in (torch.float32, torch.bfloat16):
            return small(x2)
        if self.takes_kernel(x2):
            return named_in_profiles(
                "inferd::int8_linear", self.native.int8_linear, x2, self.packed, self.scale, self.bias
            )
        bias = None if self.bias is None else self.bias.to(dtype)  # the kernels take the float32 bias as it is
        if dtype == torch.bfloat16 and x2.shape[0] <= INT8PACK_MAX_ROWS and self.int8pack_ok and self.native is None:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self._scale(dtype))
            if bias is not None:
                y = y + bias
        elif self.native is not None:  # the weights widened with their scales folded in, for the dense matmul
            w = named_in_profiles("inferd::int8_unpack", self._widened, dtype, scaled=True)
            y = F.linear(x2, w, bias)
        else:  # widened exactly; the outputs scaled
            y = F.linear(x2, self._widened(dtype)) * self._scale(dtype)
            if bias is not None:
                y = y + bias
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def join_int8_tiles(head: LMHead) -> bool:
    """An LM head's native int8 tiles as views of one buffer, so that a few rows take the whole head in one kernel
    call rather than one per tile (`LMHead.joined`; at batch 1 on the Zen 3, 16 calls streamed Gemma 3 270M's
    168 MB head at 33.4 GB/s, one at 34.8, before the calls' own costs). `int8_pack`'s layout is
    tile-major and every tile but the last holds whole kernel tiles (of 16 rows), so the tiles' buffers end to end
    are the packing of the whole weight. Returns whether they were joined."""
    head.joined = None
    tiles = list(head.tiles)
    if not all(isinstance(t, Int8Linear) and t.native is not None and t.bias is None for t in tiles):
        return False
    # packed: [kernel tiles, Kp / 4, rows a tile, 4]; a padded kernel tile inside would shift the rest
    if any(t.packed.shape[0] * t.packed.shape[2] != t.out_features for t in tiles[:-1]):
        return False
    packed = huge_pages.cat([t.packed for t in tiles])
    for t, part in zip(tiles, packed.split([t.packed.shape[0] for t in tiles]), strict=True):
        t.packed = part
    head.joined = (tiles[0].native, packed, torch.cat([t.scale for t in tiles]))
    return True


def weights_to_huge_pages(model: nn.Module) -> int:
    """The CPU weights of the quantized layers (int8's and int4's packed buffers, the GGUF tiles, an int8 layer's
    compact blocks) copied into one mapping in huge pages, each layer then holding a view of its part
    (`huge_pages`); a joined LM head has its own already. Returns the bytes moved. Measured on the Zen 3,
    alternated in one process: a pass over the body's 72 int8 matrices of Gemma 3 270M 4.39 -> 4.04 ms, its LM
    head 5.83 -> 5.51 ms. On a Zen 4 the compact blocks gained nothing in 4 KiB pages, 5-9% of a batch-1 step in
    huge pages (docs/performance.md)."""
    from inferd.models.gguf_blocks import GGUFLinear

    heads = [m for m in model.modules() if getattr(m, "joined", None)]
    joined = {id(t) for m in heads for t in m.tiles}
    owners: list[tuple[object, str | int]] = []  # (module, buffer name) or (owner of `tiles`, index into them)
    tensors: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, Int8Linear) and m.native is not None and id(m) not in joined:
            owners.append((m, "packed"))
            tensors.append(m.packed)
            for i, tile in enumerate(m.small.tiles if m.small is not None else ()):  # its compact blocks
                owners.append((m.small, i))
                tensors.append(tile)
        elif isinstance(m, Int4Linear):
            owners.append((m, "qweight"))
            tensors.append(m.qweight)
        elif isinstance(m, GGUFLinear):
            for i, tile in enumerate(m.tiles):
                owners.append((m, i))
                tensors.append(tile)
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return 0
    views = huge_pages.pack([t.contiguous() for t in tensors])
    for (module, where), view in zip(owners, views, strict=True):
        if isinstance(where, int):
            module.tiles[where] = view
        else:
            setattr(module, where, view)
    moved = sum(t.numel() * t.element_size() for t in tensors)
    logger.info(
        "quantized weights: %.0f MB in %s%s",
        moved / 1e6,
        huge_pages.describe(views[0]),
        "".join(
            f"; the joined LM head, {h.joined[1].numel() / 1e6:.0f} MB, in {huge_pages.describe(h.joined[1])}"
            for h in heads
        ),
    )
    return moved


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 (groups of 32 along K): (packed [N, K/2] uint8, step [N, K/32], low
    [N, K/32]) with w ~= q * step + low, q in 0..15; byte j of a group holds q[j] | q[j + 16] << 4.

    A group whose values already lie on a grid of at most 16 evenly spaced levels (a GGUF's Q4_K, Q4_0 or
    Q4_1 block dequantized to float) keeps that grid, to float rounding (`_grid_steps`), so such a tensor is not
    quantized twice; every other group spans its range: step = (max - min) / 15."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    step = ((high - low) / 15.0).clamp(min=1e-12)
    grid = _grid_steps(groups, low)
    step = torch.where(grid > 0, grid, step)
    q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    half = INT4_GROUP // 2
    packed = (q[..., :half] | (q[..., half:] << 4)).reshape(n, k // 2)
    return packed.contiguous(), step.contiguous(), low.contiguous()


def _grid_steps(groups: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Per group, the step of the 16-level grid its values lie on exactly (0 where there is none).

    The candidate is the smallest gap between two different values of the group; it is taken only if every
    value is low + q * step with q in 0..15, to within float rounding (2^-18 of the group's largest |w|,
    far below int4's own error of up to step / 2)."""
    ordered = groups.sort(dim=-1).values
    tol = groups.abs().amax(dim=-1) * 2.0**-18
    gaps = ordered.diff(dim=-1)
    gaps = torch.where(gaps > tol[..., None], gaps, torch.full_like(gaps, float("inf")))
    step = gaps.amin(dim=-1)
    ok = torch.isfinite(step)
    step = torch.where(ok, step, torch.ones_like(step))
    q = torch.round((groups - low[..., None]) / step[..., None])
    exact = ((q * step[..., None] + low[..., None] - groups).abs() <= tol[..., None]).all(dim=-1)
    ok &= exact & (q.amax(dim=-1) <= 15)
    return torch.where(ok, step, torch.zeros_like(step))


def dequantize_int4(packed: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weights an int4 layer stands for (the reference the kernels are tested against)."""
    n = packed.shape[0]
    b = packed.view(n, -1, INT4_GROUP // 2)
    q = torch.cat([b & 15, b >> 4], dim=-1).float()
    return (q * step[..., None] + low[..., None]).view(n, -1)


class Int4Linear(QuantizedLinear):
    """A linear layer with group-wise int4 weights (native kernels only); activations fp32 or bf16."""

    def __init__(self, packed, step, low, bias: torch.Tensor | None, kernels):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.register_buffer("qweight", packed)
        # plain attributes, not buffers: model.to(bfloat16) must not round the step and low values
        self.step, self.low = step.float(), low.float()
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels) -> Int4Linear:
        return cls(*quantize_int4(linear.weight), linear.bias, kernels)

    def weight_bytes(self) -> int:
        """What a pass over the layer reads: two int4 weights a byte, and each group's float32 step and low."""
        return self.qweight.numel() + (self.step.numel() + self.low.numel()) * 4

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.step, self.low).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        dtype = x2.dtype
        if x2.shape[0] <= INT4_FUSED_MAX_ROWS and dtype in (torch.float32, torch.bfloat16):
            y = self.kernels.int4_linear(x2, self.qweight, self.step, self.low, self.bias)  # in x's dtype
        else:
            if dtype not in (torch.float32, torch.bfloat16):
                x2 = x2.float()
            y = self.kernels.int4_linear_chunked(x2, self.qweight, self.step, self.low, self.bias, INT4_CHUNK_ROWS)
            y = y.to(dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


# GGML storage types that hold floats; every other type a GGUF stores a weight matrix in is a quantized block
FLOAT_FORMATS = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass(frozen=True)
class QuantChoice:
    """The weight mode a model runs in (int8, int4, gguf, or None for the checkpoint's values in --dtype), and why
    (logged at start, shown on the server's /v1/models)."""

    name: str | None
    reason: str
    #: int8 layers take the GGUF's own blocks for a few rows (`gguf_blocks.compact_blocks`): auto on a GGUF
    small_on_blocks: bool = False


def check_quantization(name: str | None, device: torch.device) -> None:
    """A clear ConfigError for a quantization that is unknown or that this device cannot run."""
    if name in (None, "none", "auto"):
        return
    if name not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of auto, none, {', '.join(QUANTIZATIONS)}; got {name!r}")
    if device.type != "cpu":
        raise ConfigError(f"--quantization {name} runs on CPU only (its kernels are CPU kernels); got {device}")


def resolve_quantization(name: str | None, device: torch.device, formats: dict[str, int], gguf=None) -> QuantChoice:
    """'auto', 'none' (or None) or a mode -> the mode the weights run in. `formats` is how the checkpoint stored
    its weight matrices (`inferd.models.loader.checkpoint_formats`), `gguf` the GGUF file it was converted
    from, if any (`loader.gguf_source`): `gguf` serves that file's blocks.

    auto: a checkpoint that stores its weights quantized (a GGUF's Q4_K/Q5_0/Q6_K/Q8_0 blocks, 4.5-8.5 bits a
    weight) runs in int8 on CPU: it has already given up float precision, and a decode step, bound by the bytes
    it reads, reads half of bf16's (int8 is 8 bits a weight against the file's 4.5-8.5: not the file's own
    blocks, and the rounding to int8 costs a measured perplexity, docs/performance.md; `gguf` serves the file's
    own values at about 1.1-1.2x int8's time a step). Float checkpoints, and any on a GPU (the int8 kernels are CPU
    kernels), keep their values in --dtype."""
    check_quantization(name, device)
    if name == "gguf" and gguf is None:
        raise ConfigError("--quantization gguf serves a GGUF file's own blocks; this checkpoint is not a GGUF")
    if name in QUANTIZATIONS:
        return QuantChoice(name, "asked for")
    if name != "auto":
        return QuantChoice(None, "asked for (none)")
    stored = {k: v for k, v in formats.items() if k not in FLOAT_FORMATS}
    if not stored:
        return QuantChoice(None, "auto: the checkpoint's weights are floats")
    listing = ", ".join(f"{n} {k}" for k, n in sorted(stored.items(), key=lambda kv: -kv[1]))
    if device.type != "cpu":
        return QuantChoice(None, f"auto: the checkpoint stores {listing} blocks, but the int8 kernels are CPU kernels")
    from inferd.models.cpu_kernels import int8_module

    if int8_module() is None:
        return QuantChoice(None, f"auto: the checkpoint stores {listing} blocks, but the int8 kernel did not build")
    return QuantChoice(
        "int8",
        f"auto: the checkpoint stores {listing} blocks; int8 reads half of bf16's bytes, and up to "
        f"{COMPACT_MAX_ROWS} rows a layer reads the file's own blocks where they are fewer "
        "(--quantization gguf: the file's own values at every row count, a little slower)",
        small_on_blocks=gguf is not None,
    )


def quantize_model(model: nn.Module, name: str, device: torch.device, gguf=None, small_on_blocks: bool = False) -> int:
    """Replace every Linear (the LM head's tiles included) by its quantized form; returns how many. gguf: each
    layer on the blocks of the GGUF file `gguf` (a `loader.GGUFSource`) where it can be
    (inferd/models/gguf_blocks.py), int8 otherwise. `small_on_blocks` (int8 of a GGUF): each int8 layer whose
    blocks have compact tiles takes them for a few rows (`gguf_blocks.compact_blocks`)."""
    check_quantization(name, device)
    from inferd.models.cpu_kernels import gguf_module, int4_kernels, int8_module

    native = int8_module() if device.type == "cpu" else None
    on_blocks = 0
    if name == "gguf":
        on_blocks = _use_gguf_blocks(model, gguf, gguf_module())
    small = _compact_blocks(model, gguf, gguf_module()) if name == "int8" and small_on_blocks and native else {}
    int4 = None
    if name == "int4":
        int4 = int4_kernels()
        if int4 is None:
            raise ConfigError("--quantization int4 needs its native CPU kernel, which failed to build (see the log)")
    targets = [(parent, child_name, child) for parent in model.modules() for child_name, child in _linears(parent)]
    if not targets and on_blocks:
        return on_blocks
    if not targets:
        raise ConfigError(f"--quantization {name}: {type(model).__name__} has no linear layers to quantize")
    # int4 keeps the LM head in int8, as llama.cpp keeps its output tensor at 6-8 bits: every logit rests on
    # it, and an int4 head cost a large share of int4's perplexity loss on Gemma 3 270M
    head = {id(m) for m in getattr(getattr(model, "lm_head", None), "tiles", [])}
    head |= {id(m) for m in getattr(model, "tiles", [])} if isinstance(model, LMHead) else set()
    kept_int8 = 0
    for parent, child_name, child in targets:
        if id(child) in head:
            quantized = Int8Linear.from_linear(child, native)
        elif int4 is not None and child.in_features % INT4_GROUP == 0:
            quantized = Int4Linear.from_linear(child, int4)
        else:
            kept_int8 += name == "int4"
            quantized = Int8Linear.from_linear(child, native)
            quantized.small = small.get(id(child))
        if hasattr(child, "out_sizes"):  # FusedLinear: keep how its output splits
            quantized.out_sizes = child.out_sizes
        setattr(parent, child_name, quantized)
    if kept_int8:
        logger.warning(
            "quantization int4: %d of %d linear layers have an input width that is not a multiple of %d; "
            "they stay int8",
            kept_int8,
            len(targets),
            INT4_GROUP,
        )
    logger.info(
        "quantization %s: %d linear layers%s; int8 rows take %s",
        name,
        len(targets) + on_blocks,
        f" ({on_blocks} on the file's blocks, {len(targets)} int8)" if name == "gguf" else "",
        int8_rows_path(native),
    )
    return len(targets) + on_blocks


def _use_gguf_blocks(model: nn.Module, gguf, kernels) -> int:
    from inferd.models.gguf_blocks import use_gguf_blocks

    if gguf is None or kernels is None:
        raise ConfigError(
            "--quantization gguf needs a GGUF checkpoint and the native GGUF kernel"
            + ("" if kernels is not None else ", which failed to build (see the log)")
        )
    replaced, skipped = use_gguf_blocks(model, gguf, kernels)
    for layer, why in sorted(skipped.items()):
        logger.info("quantization gguf: %s stays int8: %s", layer, why)
    return replaced


def _compact_blocks(model: nn.Module, gguf, kernels) -> dict:
    """{id of a float layer: its `CompactBlocks`} for int8 on a GGUF, where the compact kernel runs here."""
    from inferd.models.gguf_blocks import compact_blocks

    if gguf is None or kernels is None or not kernels.compact_available():
        why = "not a GGUF" if gguf is None else "the compact GGUF kernel needs AVX-512 VNNI"
        logger.info("quantization int8: every row count takes the int8 weights (%s)", why)
        return {}
    found, skipped = compact_blocks(model, gguf, kernels)
    for layer, why in sorted(skipped.items()):
        logger.info("quantization int8: %s takes int8 at every row count: %s", layer, why)
    logger.info("quantization int8: %d layers read the file's own blocks for 1-%d rows", len(found), COMPACT_MAX_ROWS)
    return found


def _linears(parent: nn.Module):
    for child_name, child in parent.named_children():
        if isinstance(child, Linear):
            yield child_name, child
