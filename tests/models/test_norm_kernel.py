"""The native RMS norm (inferd/models/kernels/rms_norm_cpu.cpp) against the reference ops it replaces."""

from __future__ import annotations

import platform

import pytest
import torch

from inferd.models.cpu_kernels import rms_norm_kernel
from inferd.models.layers import RMSNorm
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
