"""The three ways a LoRA layer adds a step's products (the native kernel `lora_add`, the masked matmuls it
replaces where it does not build, dense matmuls on long runs of one adapter's rows) against the plain
formula: every row gets its own adapter's product, base rows nothing, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from inferd.models.cpu_kernels import lora_kernel
from inferd.models.lora import LoRABatch, LoRALinear


class _Zeros:
    def __init__(self, k: int, parts: list[int]):
        self.in_features, self.out_features, self.out_sizes = k, sum(parts), parts

    def __call__(self, x):
        return torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "run"), [(1, 1), (7, 1), (40, 1), (120, 40)])
def test_native_kernel_matches_the_formula_and_the_matmuls(dtype, rows, run):
    if lora_kernel() is None:
        pytest.fail("the native LoRA kernel did not build (see inferd doctor)")
    torch.manual_seed(rows)
    rank, slots_n, parts = 4, 3, [24, 8, 8]
    batch = LoRABatch(rank, native=True)
    layer = LoRALinear(_Zeros(32, parts), batch, slots_n, dtype, torch.device("cpu"))
    adapters = {}
    for s in range(slots_n):
        r = s + 2  # ranks below the slots' width, zero-padded
        per_part = [(torch.randn(r, 32), torch.randn(n, r)) for n in parts]
        adapters[s] = per_part
        for p, (a, b) in enumerate(per_part):
            layer.set_slot(s, p, a, b)
    x = torch.randn(rows, 32).to(dtype)
    # -1 (base), 0, 1, 2, ... in turn, each for `run` rows (40: a run long enough for the dense matmuls)
    slots = torch.tensor([(i // run % (slots_n + 1)) - 1 for i in range(rows)])
    batch.activate(slots.tolist(), torch.device("cpu"))
    assert not batch.runs  # with the kernel every row is the kernel's
    native = layer(x)
    layer.native, batch.native = None, False  # as without the kernel: dense matmuls on runs, masked for the rest
    batch.activate(slots.tolist(), torch.device("cpu"))
    assert len(batch.runs) == (2 if run == 40 else 0)
    matmuls = layer(x)
    want = torch.zeros(rows, sum(parts))
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        at = 0
        for (a, b), n in zip(adapters[s], parts, strict=True):
            want[i, at : at + n] = x[i].float() @ a.to(dtype).float().T @ b.to(dtype).float().T
            at += n
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.3)
    torch.testing.assert_close(native.float(), want, **tol)
    torch.testing.assert_close(matmuls.float(), want, **tol)
    assert (native[slots < 0] == 0).all()  # a base row gets nothing added, not even a rounding
