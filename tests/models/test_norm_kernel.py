"""The native RMS norm (inferd/models/kernels/rms_norm_cpu.cpp) against the reference ops it replaces."""

from __future__ import annotations

import platform

import pytest
import torch

from inferd.models.attention import write_kv
from inferd.models.cpu_kernels import add_rms_norm_kernel, gated_act_kernel, qk_norm_rope_kernel, rms_norm_kernel
from inferd.models.layers import ACTIVATIONS, RMSNorm, apply_rotary, residual_norm
from inferd.models.loader import load_model
from tests.conftest import build_tiny_model

needs_kernel = pytest.mark.skipif(platform.system() != "Linux", reason="the native kernels are built on Linux")


def _pair(dim: int, unit_offset: bool, dtype: torch.dtype) -> RMSNorm:
    torch.manual_seed(dim)
    norm = RMSNorm(dim, 1e-6, unit_offset)
    norm.weight.data.normal_()
    return norm.to(dtype)


@needs_kernel
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("shape", [(1, 640), (7, 4, 256), (300, 640), (3, 24), (0, 64)])
def test_native_norm_matches_the_reference(unit_offset, shape):
    for dtype, tol in ((torch.float32, 2 * 2**-23), (torch.bfloat16, 2**-8)):
        norm = _pair(shape[-1], unit_offset, dtype)
        x = (torch.randn(shape) * 3).to(dtype)
        ref = norm(x)
        norm.native = rms_norm_kernel()
        got = norm(x)
        assert got.dtype == dtype and got.shape == ref.shape
        # only the sum of squares is added in another order: a rounding step of the largest value at most
        if ref.numel():
            scale = max(ref.float().abs().max().item(), 1.0)
            assert (got.float() - ref.float()).abs().max().item() <= 2 * tol * scale


@needs_kernel
def test_native_norm_takes_strided_input_and_refuses_mixed_dtypes():
    norm = _pair(32, True, torch.float32)
    norm.native = rms_norm_kernel()
    x = torch.randn(32, 5).t()  # not contiguous
    assert torch.allclose(norm(x), norm.native(x.contiguous(), norm.weight, norm.eps, True))
    with pytest.raises(RuntimeError, match="same dtype"):
        norm.native(x.to(torch.bfloat16), norm.weight, norm.eps, True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_model_loads_with_native_norms(tmp_path, dtype):
    from inferd.models import loader

    folder = build_tiny_model("gemma3", tmp_path / "m")
    config = loader.text_config(loader.load_config(folder))
    model = load_model(folder, config, dtype, torch.device("cpu"), 64)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.native is rms_norm_kernel() for m in norms)
    attentions = [m for m in model.modules() if hasattr(m, "qk_rope")]
    assert attentions and all(m.qk_rope is qk_norm_rope_kernel() for m in attentions)
    mlps = [m for m in model.modules() if hasattr(m, "gated_act")]
    assert mlps and all(m.gated_act is not None for m in mlps)


def _reference_qk(qkv, heads, kv_heads, d, cos, sin, q_norm, k_norm):
    q = qkv[:, : heads * d].reshape(-1, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(-1, kv_heads, d)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


@needs_kernel
@pytest.mark.parametrize("norm", [None, "unit", "plain"])  # Llama, Gemma 3, Qwen 3
@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_qk_norm_rope_matches_the_reference(norm, rot, dtype):
    heads, kv_heads, d, tokens = 4, 2, 32, 9
    torch.manual_seed(rot)
    wide = torch.randn(tokens, (heads + 2 * kv_heads) * d + 8).to(dtype)
    qkv = wide[:, 8:]  # rows strided, as a slice of a wider projection would be
    angles = torch.rand(tokens, 1, rot // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q_norm = k_norm = None
    if norm is not None:
        q_norm, k_norm = _pair(d, norm == "unit", dtype), _pair(d, norm == "unit", dtype)
        k_norm.weight.data.mul_(0.5)
    ref_q, ref_k = _reference_qk(qkv, heads, kv_heads, d, cos, sin, q_norm, k_norm)
    qw, kw = (q_norm.weight, k_norm.weight) if norm else (torch.empty(0), torch.empty(0))
    eps, unit = (q_norm.eps, q_norm.unit_offset) if norm else (0.0, False)
    q, k = qk_norm_rope_kernel()(qkv, heads, kv_heads, d, cos, sin, qw, kw, unit, eps)
    assert q.shape == ref_q.shape and k.shape == ref_k.shape and q.dtype == dtype
    for got, ref in ((q, ref_q), (k, ref_k)):
        if norm is None:  # no reduction: the same operations in the same order
            assert torch.equal(got, ref)
        else:
            step = 2**-8 if dtype == torch.bfloat16 else 2**-22
            assert (got.float() - ref.float()).abs().max().item() <= 2 * step * max(ref.float().abs().max().item(), 1)


@needs_kernel
def test_native_qk_norm_rope_refuses_what_it_cannot_do():
    qkv = torch.randn(3, 64)
    cos = sin = torch.ones(3, 1, 16)
    with pytest.raises(RuntimeError, match="narrower"):
        qk_norm_rope_kernel()(qkv, 4, 2, 16, cos, sin, torch.empty(0), torch.empty(0), False, 0.0)
    with pytest.raises(RuntimeError, match="dtype"):
        qk_norm_rope_kernel()(qkv, 2, 1, 16, cos.to(torch.bfloat16), sin, torch.empty(0), torch.empty(0), False, 0.0)


@needs_kernel
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_norm", [True, False])
def test_native_residual_norm_is_the_add_between_its_norms(unit_offset, dtype, first_norm):
    torch.manual_seed(5)
    x, h = (torch.randn(7, 640).to(dtype) for _ in range(2))
    norm1, norm2 = _pair(640, unit_offset, dtype), _pair(640, unit_offset, dtype)
    norm2.weight.data.mul_(0.5)
    norm1 = norm1 if first_norm else None
    plain = residual_norm(x, h, norm1, norm2)  # no native kernels yet: the reference ops
    for n in (norm1, norm2):
        if n is not None:
            n.native, n.native_add = rms_norm_kernel(), add_rms_norm_kernel()
    fused = residual_norm(x, h, norm1, norm2)
    by_parts = x + (h if norm1 is None else norm1(h))  # the native norm alone, and torch's add
    assert torch.equal(fused[0], by_parts) and torch.equal(fused[1], norm2(by_parts))
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(fused[0].float(), plain[0].float(), atol=tol * 4, rtol=tol)
    x_only, none = residual_norm(x, h, norm2, None)
    assert none is None and torch.equal(x_only, x + norm2(h))


@needs_kernel
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
def test_native_qk_norm_rope_writes_k_and_v_as_write_kv_does(dtype, cache_dtype):
    heads, kv_heads, d, tokens = 4, 2, 32, 5
    torch.manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d + 8).to(dtype)[:, 8:]  # strided rows
    cos = sin = torch.full((tokens, 1, d), 0.5, dtype=dtype)
    norm = _pair(d, True, dtype)
    args = (qkv, heads, kv_heads, d, cos, sin, norm.weight, norm.weight, True, norm.eps)
    slots = torch.tensor([9, 0, 31, 4, 17])
    got_k, got_v = (torch.zeros(4, 8, kv_heads, d, dtype=cache_dtype) for _ in range(2))
    q, k = qk_norm_rope_kernel()(*args, got_k, got_v, slots)
    ref_q, ref_k = qk_norm_rope_kernel()(*args)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    ref_kc, ref_vc = (torch.zeros(4, 8, kv_heads, d, dtype=cache_dtype) for _ in range(2))
    v = qkv[:, (heads + kv_heads) * d :].reshape(tokens, kv_heads, d)
    write_kv(ref_k, v, ref_kc, ref_vc, slots)
    assert torch.equal(got_k, ref_kc) and torch.equal(got_v, ref_vc)
    with pytest.raises(RuntimeError, match="slot out of range"):
        qk_norm_rope_kernel()(*args, got_k, got_v, torch.tensor([0, 1, 2, 3, 32]))
    with pytest.raises(RuntimeError, match="come together"):
        qk_norm_rope_kernel()(*args, got_k, None, slots)


@needs_kernel
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 33])
def test_native_gated_act_matches_the_reference(act, dtype, rows):
    inter = 200
    torch.manual_seed(rows)
    wide = (torch.randn(rows, 2 * inter + 6) * 4).to(dtype)
    if rows:  # zeros, both signs' tails, where the activation saturates or underflows
        wide[0, 6:14] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-20, -50.0, 50.0, -9.0])
    gate_up = wide[:, 6:]  # rows strided, as in a slice of a wider tensor
    gate, up = gate_up.split([inter, inter], dim=-1)
    ref = ACTIVATIONS[act](gate) * up
    got = gated_act_kernel(act)(gate_up, inter)
    assert got.shape == ref.shape and got.dtype == dtype
    # our exp is within a few ulp of libm's, and torch's 1 + tanh(u) cancels for negative x (an error of
    # ~|x| 1e-7 before the product): a few float32 rounding steps of |gate * up|, or a bf16 step
    step = 2**-8 if dtype == torch.bfloat16 else 2**-21
    scale = (gate.float() * up.float()).abs().clamp_min(1.0)
    assert ((got.float() - ref.float()).abs() <= step * scale).all()


@needs_kernel
def test_native_gated_act_knows_its_activations_and_refuses_bad_rows():
    assert gated_act_kernel("gelu") is None  # exact GELU (erf) stays on the reference
    with pytest.raises(RuntimeError, match="narrower"):
        gated_act_kernel("silu")(torch.randn(2, 10), 6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        gated_act_kernel("silu")(torch.randn(2, 12).half(), 6)
