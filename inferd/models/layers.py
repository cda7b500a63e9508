"""Building blocks shared by the model classes: norms, rotary embedding, fused linears."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.cpu import cpu_flags


class RMSNorm(nn.Module):
    """RMS norm computed in fp32. Gemma scales by (1 + weight); Llama-style models by weight.

    `native` is the one-call CPU kernel (`use_native_kernels`), the same arithmetic as the ops below;
    `native_add` the one that adds a residual between two norms (`residual_norm`)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.native = None
        self.native_add = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.is_cpu:
            weight = self.weight
            if x.dtype == weight.dtype:
                return self.native(x, weight, self.eps, self.unit_offset)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


_EMPTY = torch.empty(0)


def residual_norm(
    x: torch.Tensor, h: torch.Tensor, norm1: RMSNorm | None, norm2: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + norm1(h) (h itself without norm1), and norm2 of that (None without norm2): the residual stream and
    the next block's input. One native call where the norms have it (the same rounding as the ops they replace),
    up to three small ops otherwise."""
    lead = norm1 if norm2 is None else norm2
    native = lead.native_add
    w1 = _EMPTY if norm1 is None else norm1.weight
    w2 = _EMPTY if norm2 is None else norm2.weight
    if (
        native is not None
        and x.is_cpu
        and x.dtype == h.dtype == lead.weight.dtype
        and (norm1 is None or norm2 is None or _alike(norm1, norm2))
    ):
        x, out = native(x, h, w1, w2, lead.eps, lead.unit_offset)
        return x, out if norm2 is not None else None
    x = x + (h if norm1 is None else norm1(h))
    return x, None if norm2 is None else norm2(x)


def _alike(a: RMSNorm, b: RMSNorm) -> bool:
    """Two norms the one native call can compute: the same dtype, eps and offset."""
    return a.weight.dtype == b.weight.dtype and a.eps == b.eps and a.unit_offset == b.unit_offset


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed per token (HF's rotate_half layout)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = emb.shape[-1]
        # plain attributes, not buffers: model.to(dtype) must not round the tables to low precision
        self.cos = emb.cos() * attention_scaling
        self.sin = emb.sin() * attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, rotary_dim]. Partial rotary leaves the tail."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def build_rotary(config, max_positions: int, layer_type: str | None = None) -> RotaryEmbedding:
    """Rotary embedding from a transformers config, using transformers' own RoPE scaling functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return RotaryEmbedding(default_inv_freq(theta, dim), max_positions)
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return RotaryEmbedding(inv_freq, max_positions, scaling)


class Linear(nn.Linear):
    """nn.Linear that can hand its matmul to oneDNN on CPU, and one bf16 row to a matrix-vector product.

    oneDNN's inner-product kernels use every vector unit the CPU has (AVX-512 where present) and are
    much faster than the dense sgemm path for the small batches of decoding; see benchmarks/.
    A single bf16 row on CPU with dense weights (a decode step at batch 1 on an AMX CPU, where the body stays
    dense) goes through `torch.addmv`, torch's bf16 gemv with float32 accumulation: `F.linear` there goes
    through a general matmul set up per call, which on the default model's small layers costs more than the
    product (docs/performance.md). Without AMX the body is packed (`bf16_body_on_onednn`).
    """

    _packed: torch.Tensor | None = None

    def weight_bytes(self) -> int:
        """What a pass over the layer reads: its weights in their dtype, from the shape (a packed layer
        keeps an empty dense weight of that dtype)."""
        return self.in_features * self.out_features * self.weight.element_size()

    def pack_for_cpu(self, drop_dense: bool) -> None:
        """Hand the matmul to oneDNN: fp32 as a plain oneDNN tensor, bf16 reordered into oneDNN's blocked
        layout for its AMX/AVX512_BF16 kernels (`ONEDNN_BATCH_HINT`)."""
        weight = self.weight.detach()
        if weight.dtype == torch.bfloat16:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
        else:
            self._packed = weight.to_mkldnn()
        if drop_dense:  # keep the parameter object (names, state) but release its memory
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
                return _gemv(self.weight, x, self.bias)
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        bias = None if self.bias is None else self.bias.detach()
        # dense in, dense out: no per-call conversion of activations to oneDNN tensors
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self._packed, bias, "none", [], "")
        return y.view(*shape[:-1], -1)


def _gemv(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """weight @ x for one row x, in x's shape with the last dimension the weight's rows."""
    row = x.reshape(-1)
    y = torch.mv(weight, row) if bias is None else torch.addmv(bias, weight, row)
    return y.view(*x.shape[:-1], weight.shape[0])


def use_native_kernels(model: nn.Module, dtype: torch.dtype) -> bool:
    """Give a CPU float32/bfloat16 model the native fused small ops, if they build: every RMSNorm its
    one-call kernel (and its residual add between norms), every attention with a `qk_rope` slot the q/k
    norm + rotary kernel, every gated MLP act(gate) * up in one call (SiLU, GELU-tanh), a tiled LM head its
    argmax fold.

    At small batches a step is mostly the fixed cost of small ops: the reference norm is ten of them, six
    times a layer in Gemma 3, and q/k's split, norms and rotary some thirty a layer
    (inferd/models/kernels/norm_rope_cpu.cpp). The kernels do the same arithmetic."""
    from inferd.models.cpu_kernels import (
        add_rms_norm_kernel,
        argmax_update_kernel,
        gated_act_kernel,
        qk_norm_rope_kernel,
        rms_norm_kernel,
    )

    if dtype not in (torch.float32, torch.bfloat16):
        return False
    norm, rope = rms_norm_kernel(), qk_norm_rope_kernel()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.native, m.native_add = norm, add_rms_norm_kernel()
        elif hasattr(m, "qk_rope"):
            m.qk_rope = rope
        elif hasattr(m, "gated_act"):
            m.gated_act = gated_act_kernel(m.act_name)
        elif hasattr(m, "native_argmax"):
            m.native_argmax = argmax_update_kernel()
    return norm is not None


#: the batch size oneDNN lays a bf16 weight out for: on the default model's LM head tiles (16,384 x 640) the
#: layout for 64 rows was the fastest at every batch size from 1 to 64, ahead of the layout for 1 row and of
#: dense `F.linear`.
ONEDNN_BATCH_HINT = 64


def bf16_onednn_available() -> bool:
    """oneDNN's bf16 matmul with reordered weights: present in this torch build, and native on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_body_on_onednn(flags: frozenset[str] | None = None) -> bool:
    """Whether a bf16 model's body layers go on oneDNN's blocked layout too, not only its LM head: on CPUs
    with AVX512_BF16 but no AMX. There, on Gemma 3 270M's body (18 layers' q/k/v, o, gate/up and down), oneDNN
    on reordered weights took 13.2 ms a step at 1 row against 22.1 for torch's gemv on dense weights, 14.8
    against 26.7 at 16 rows, and was as fast on prefill (304 against 317 ms at 512 rows): torch's bf16 gemv
    runs far below the memory's speed there. With AMX, dense weights were as fast at 32 rows and faster on
    long prefills (docs/performance.md). `flags`: another CPU's (default: this one's)."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags and not {"amx_bf16", "amx_tile"} & flags and bf16_onednn_available()


def pack_linears_for_cpu(model: nn.Module, dtype: torch.dtype = torch.float32) -> bool:
    """Move every `dtype` Linear of a CPU model onto oneDNN (the LM head's tiles too where not yet packed).
    Weights shared with another module keep their dense copy."""
    if not torch.backends.mkldnn.is_available():
        return False
    for module in model.modules():
        if (
            isinstance(module, Linear)
            and module._packed is None
            and module.weight.device.type == "cpu"
            and module.weight.dtype == dtype
        ):
            module.pack_for_cpu(drop_dense=not _is_tied(model, module))
    return True


def _is_tied(model: nn.Module, linear: nn.Linear) -> bool:
    return any(m is not linear and getattr(m, "weight", None) is linear.weight for m in model.modules())


class FusedLinear(Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up): fewer, larger kernels.

    The checkpoint stores the parts separately; `load_shard` writes each into its rows.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load_shard(self, shard: int, param_name: str, tensor: torch.Tensor) -> None:
        target = getattr(self, param_name)
        start, size = self.offsets[shard], self.out_sizes[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard} has {tensor.shape[0]} rows, expected {size}")
        with torch.no_grad():
            target[start : start + size].copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "gelu": F.gelu,
}
