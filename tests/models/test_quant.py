"""int8 weight-only quantization: the per-channel math, each kernel path against fp32, the error messages, and
the engine end to end on tiny models without leaking blocks."""

from __future__ import annotations

import argparse
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from inferd import LLM, SamplingParams
from inferd.config import add_engine_args, make_engine_config
from inferd.errors import ConfigError
from inferd.models import cpu_kernels as ck
from inferd.models import quant
from inferd.models.cpu_kernels import int4_kernels, int8_module
from inferd.models.dtypes import cpu_flags
from inferd.models.layers import Linear
from inferd.models.lm_head import LMHead
from tests.conftest import assert_idle


def _layer(n: int = 48, k: int = 40, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k))
        if bias:
            layer.bias.copy_(torch.randn(n))
    return layer


def test_per_channel_symmetric_round_trip():
    w = torch.randn(32, 64) * torch.linspace(0.01, 10, 32)[:, None]  # rows of very different ranges
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (32,) and q.abs().max() <= 127
    assert torch.equal(q.abs().amax(dim=1), torch.full((32,), 127, dtype=torch.int8))  # each row uses its range
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()


def test_the_native_kernel_builds_here():
    assert int8_module() is not None, "the native int8 kernel must build where CI runs"


def quantized_activations(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """What the native kernels compute with: each row in groups of 32 (the last one shorter; 128 for bf16 rows
    from 8 rows on AVX-512 where K allows) as int8 values and one step per group, x ~= xq * xd; returned padded
    to whole groups, [M, G, group] and [M, G], in float64."""
    m, k = x.shape
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))  # 127 / amax in fp32
    return torch.round(xf * inv[..., None]).double(), (amax / 127.0).double()


def activation_group(module, rows: int, k: int, dtype: torch.dtype) -> int:
    """The activation group the int8 kernel uses for `rows` x K: 128 for bf16 rows on an AVX-512 build (AMX or
    vpdpbusd, 8 rows and more) where the padded K is a multiple of it, 32 everywhere else."""
    wide = hasattr(module, "wide_group") and rows >= 8 and dtype == torch.bfloat16
    return module.wide_group() if wide and -(-k // 32) * 32 % module.wide_group() == 0 else 32


def int8_emulated(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, group: int = 32
) -> torch.Tensor:
    xq, xd = quantized_activations(x, group)
    groups = xq.shape[1]
    qf = F.pad(q.double(), (0, groups * group - q.shape[1])).view(q.shape[0], groups, group)
    y = (torch.einsum("mgj,ngj->mng", xq, qf) * xd[:, None]).sum(-1) * scale.double()
    return y if bias is None else y + bias.double()


def int4_emulated(x: torch.Tensor, packed, step, low, bias: torch.Tensor | None) -> torch.Tensor:
    xq, xd = quantized_activations(x)
    b = packed.view(packed.shape[0], -1, 16)
    q = torch.cat([b & 15, b >> 4], dim=-1).double()
    y = (torch.einsum("mgj,ngj->mng", xq, q) * step.double()[None] * xd[:, None]).sum(-1)
    xsum = x.double().view(x.shape[0], -1, 32).sum(-1)
    rounding = xsum - xd * xq.sum(-1)  # what rounding x to int8 moved each group's sum by
    y = y + xsum @ low.double().T + 7.5 * rounding @ step.double().T  # q's middle, 7.5, carries no rounding
    return y if bias is None else y + bias.double()


def _close_to(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest |want|: float summation order gives ~1e-7, one int8 step of one
    activation rounded the other way ~1e-3."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()


# the instruction sets the small-M kernels are built for, forced below -march=native where the CPU has more
ISA_BUILDS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"], "portable": ["-mno-avx2"]}


@functools.cache
def _kernel_build(source: str, isa: str):
    native = ck.int8_module() if source == "int8" else int4_kernels()
    if isa == "native" or (native is not None and native.isa() == isa):  # an AVX2 CPU: the same build
        return native
    path = ck._INT8_SOURCE if source == "int8" else ck._INT4_SOURCE
    return ck._build(f"inferd_test_{source}_{isa}", path, f"{source} kernel ({isa})", ISA_BUILDS[isa])


def _forced_isa(isa: str) -> str:
    """The path a forced build compiles: AVX2 only where the CPU has it (-march=native then still enables it)."""
    return "avx2" if isa == "avx2" and "avx2" in cpu_flags() else "portable"


def _isa_params():
    return [pytest.param(isa, marks=[] if isa == "native" else [pytest.mark.slow]) for isa in ISA_BUILDS]


@pytest.mark.parametrize("isa", _isa_params())
def test_int8_kernel_is_its_integer_arithmetic_on_every_instruction_set(isa):
    module = _kernel_build("int8", isa)
    assert module is not None, f"the int8 kernel must build for {isa}"
    if isa != "native":  # the forced builds say which path they compiled
        assert module.isa() == _forced_isa(isa)
    torch.manual_seed(0)
    for k in (40, 64, 96, 640):  # 40 and 96: a short last group; 96: one 64-k run and a tail group
        for n in (37, 130):  # tiles of 16 output rows: the last one partly filled; 130: stripes of several tiles
            q, scale = quant.quantize_int8(torch.randn(n, k))
            bias = torch.randn(n)
            packed = module.int8_pack(q)
            assert torch.equal(module.int8_unpack(packed, n, k, torch.float32), q.float())
            assert torch.equal(module.int8_unpack(packed, n, k, torch.bfloat16), q.bfloat16())
            scaled = q.float() * scale[:, None]  # the scales folded in, rounded once
            assert torch.equal(module.int8_unpack(packed, n, k, torch.float32, scale), scaled)
            assert torch.equal(module.int8_unpack(packed, n, k, torch.bfloat16, scale), scaled.bfloat16())
            for rows in (1, 2, 3, 4, 5, 9, 18, 32):  # blocks of up to 6 rows (AVX-512), 4 (AVX2) and tails
                x = torch.randn(rows, k) * torch.linspace(0.1, 10, k)
                x[0, :32] = 0  # an all-zero group: a zero step, no division by zero
                got = module.int8_linear(x, packed, scale, bias)
                assert got.dtype == torch.float32
                assert _close_to(got, int8_emulated(x, q, scale, bias)) < 1e-5, (k, n, rows)
                # bf16 activations: the same arithmetic on the same values, the output rounded to bf16 (where
                # bf16 rows go in groups of 128, float32 rows are switched to them to compare)
                xb = x.bfloat16()
                got = module.int8_linear(xb, packed, scale, None)
                assert got.dtype == torch.bfloat16
                group = activation_group(module, rows, k, torch.bfloat16)
                try:
                    if group != 32:
                        module.set_wide_groups(2)
                    want = module.int8_linear(xb.float(), packed, scale, None)
                finally:
                    if group != 32:
                        module.set_wide_groups(1)
                assert torch.equal(got, want.bfloat16()), (k, n, rows)
                assert _close_to(want, int8_emulated(xb.float(), q, scale, None, group)) < 1e-5, (k, n, rows)


@pytest.mark.parametrize("isa", _isa_params())
def test_int8_argmax_is_the_first_maximal_index_of_int8_linear(isa):
    """int8_argmax folds the outputs into a running argmax without writing them: the index torch.argmax gives
    over int8_linear's outputs (rounded to x's dtype, so bf16 ties count), plus the offset, and only where the
    value beats the running best; with exact ties across tiles, within a lane, in the last partial tile."""
    module = _kernel_build("int8", isa)
    assert module is not None, f"the int8 kernel must build for {isa}"
    torch.manual_seed(2)
    n, k = 1000, 96  # 63 tiles, the last one partly filled
    w = torch.randn(n, k)
    w[[5, 21, 37, 500, 999]] = w[3] * 0 + 2  # one best row at 5 places: lane 5 of tiles 0-2, two other lanes
    q, scale = quant.quantize_int8(w)
    packed = module.int8_pack(q)
    paths = [True, False] if hasattr(module, "set_amx") else [True]
    for amx in paths:
        for rows in (1, 3, 5, 8, 17, 33):  # the vector blocks' tails and, on AMX, padded row tiles
            x = torch.randn(rows, k) * 3
            x[0] = w[5]  # the tied rows win: the first, 5
            x[-1] = 0  # every output 0: the first index
            for xx in (x, x.bfloat16()):
                try:
                    module.set_amx(amx) if hasattr(module, "set_amx") else None
                    y = module.int8_linear(xx, packed, scale, None).float()
                    best_val, best_idx = torch.full((rows,), float("-inf")), torch.zeros(rows, dtype=torch.long)
                    module.int8_argmax(xx, packed, scale, None, best_val, best_idx, 7)
                    # a running best from earlier outputs: a greater one is kept, an equal one too (it came first)
                    kept_val, kept_idx = y.max(dim=-1).values.clone(), torch.full((rows,), 3, dtype=torch.long)
                    kept_val[1:] += 1
                    module.int8_argmax(xx, packed, scale, None, kept_val, kept_idx, 7)
                finally:
                    module.set_amx(True) if hasattr(module, "set_amx") else None
                assert torch.equal(best_idx, y.argmax(dim=-1) + 7), (amx, rows, xx.dtype)
                assert torch.equal(best_val, y.max(dim=-1).values)
                assert best_idx[-1].item() == 7 and (rows == 1 or best_idx[0].item() == 12)
                assert kept_idx.tolist() == [3] * rows


def test_the_int8_kernel_claims_amx_exactly_where_the_cpu_has_it():
    module = int8_module()
    has_amx = {"amx_int8", "amx_tile"} <= cpu_flags()
    assert hasattr(module, "set_amx") == has_amx
    assert module.isa().endswith("+amx") == has_amx
    if not has_amx:
        assert "amx" not in module.isa()


@pytest.mark.cpu_feature
def test_int8_amx_path_gives_the_bits_of_the_vnni_path():
    """Where the CPU has AMX (Intel Sapphire Rapids and later), 8 rows and more take AMX tiles: the same integer
    sums and the same float order as the vpdpbusd blocks in the same activation groups (32; 128 for bf16 rows
    where K is a multiple of it, 128, 640, 1152, or for every row with the wide groups forced), so the outputs
    are the same bits as an AVX-512 CPU without AMX computes."""
    module = int8_module()
    if not hasattr(module, "set_amx"):
        pytest.skip(f"the int8 kernel was built without AMX ({module.isa()}): this CPU has no AMX-INT8")
    assert module.isa().endswith("+amx") and module.wide_group() == 128
    torch.manual_seed(1)

    def run(xx, packed, scale, bias, amx=True, wide=1):
        try:
            module.set_amx(amx)
            module.set_wide_groups(wide)
            return module.int8_linear(xx, packed, scale, bias)
        finally:
            module.set_amx(True)
            module.set_wide_groups(1)

    for k in (40, 96, 128, 640, 1152):
        for n in (37, 300):
            q, scale = quant.quantize_int8(torch.randn(n, k))
            bias, packed = torch.randn(n), module.int8_pack(q)
            for rows in (8, 17, 33):  # row tiles of 16, the last one padded
                x = torch.randn(rows, k) * torch.linspace(0.1, 10, k)
                x[0, :32] = 0
                x[1, :128] = 0  # an all-zero wide group
                xb = x.bfloat16()
                for xx in (x, xb):
                    for wide in (0, 1, 2):
                        want = run(xx, packed, scale, bias, amx=False, wide=wide)
                        assert torch.equal(run(xx, packed, scale, bias, wide=wide), want), (k, n, rows, wide)
                group = activation_group(module, rows, k, torch.bfloat16)
                assert group == (128 if k % 128 == 0 else 32)
                wide = run(x, packed, scale, bias, wide=2)  # float32 rows in the bf16 rows' groups
                assert _close_to(wide, int8_emulated(x, q, scale, bias, group)) < 1e-5, (k, n, rows)
                assert torch.equal(
                    run(xb, packed, scale, bias), run(xb.float(), packed, scale, bias, wide=2).bfloat16()
                )


def test_many_bf16_rows_take_the_int8_kernel_exactly_where_it_is_built_for_avx512_vnni():
    """Prefill's hundreds of bf16 rows: where the kernel is built for AVX-512 VNNI (AMX or not) the int8 kernel
    itself (TDPBSUD or vpdpbusd on the quantized activations, the very call a decode step makes); elsewhere
    the weights widened for the dense matmul, the activations not quantized. Either way close to the float
    layer."""
    module = int8_module()
    torch.manual_seed(2)
    layer = _layer(k=640, n=300)
    q8 = quant.Int8Linear.from_linear(layer, module)
    assert q8.all_rows == module.isa().startswith("avx512-vnni")
    assert q8.all_rows == ("avx512_vnni" in cpu_flags())
    for rows in (quant.NATIVE_MAX_ROWS + 5, 300):
        x = torch.randn(rows, 640).bfloat16()
        got = q8(x)
        kernel = module.int8_linear(x, q8.packed, q8.scale, q8.bias)
        widened = torch.nn.functional.linear(x, q8._widened(torch.bfloat16, scaled=True), q8.bias.bfloat16())
        assert torch.equal(got, kernel if q8.all_rows else widened), rows
        ref = layer(x.float())
        assert ((got.float() - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize(
    ("isa", "all_rows"),
    [("avx512-vnni+amx", True), ("avx512-vnni", True), ("avx2-vnni", False), ("avx2", False), ("portable", False)],
)
def test_which_bf16_rows_take_the_int8_kernel_follows_the_kernels_instruction_set(isa, all_rows):
    """The rule itself, on any CPU: a kernel built for AVX-512 VNNI (AMX or not) takes bf16 rows at every row
    count; any other takes up to NATIVE_MAX_ROWS and leaves more to the dense matmul; float32 rows it takes always."""

    class Native:  # int8_pack's layout is not read here: only the kernel's instruction set
        def isa(self):
            return isa

        def int8_pack(self, q):
            return q

    layer = quant.Int8Linear.from_linear(_layer(k=64, n=32), Native())
    assert layer.all_rows == all_rows
    for rows in (1, quant.NATIVE_MAX_ROWS, quant.NATIVE_MAX_ROWS + 1, 512):
        bf16, fp32 = torch.zeros(rows, 64, dtype=torch.bfloat16), torch.zeros(rows, 64)
        assert layer.takes_kernel(bf16) == (all_rows or rows <= quant.NATIVE_MAX_ROWS), rows
        assert layer.takes_kernel(fp32)
    # and the log says the same: every row count, or bf16 rows up to the bound
    said = quant.int8_rows_path(Native())
    assert isa in said and ("at every row count" in said) == all_rows
    assert (f"bfloat16 rows up to {quant.NATIVE_MAX_ROWS}" in said) != all_rows


@pytest.mark.parametrize("isa", _isa_params())
def test_int4_kernel_is_its_integer_arithmetic_on_every_instruction_set(isa):
    module = _kernel_build("int4", isa)
    assert module is not None, f"the int4 kernel must build for {isa}"
    if isa != "native":
        assert module.isa() == _forced_isa(isa)
    torch.manual_seed(0)
    for k in (64, 96, 128, 640):  # 64, 96: a row shorter than one block of four groups, or not a multiple
        packed, step, low = quant.quantize_int4(torch.randn(37, k))
        bias = torch.randn(37)
        for rows in (1, 3, 4, 5, 9):
            x = torch.randn(rows, k) * torch.linspace(0.1, 10, k)
            x[0, :32] = 0
            got = module.int4_linear(x, packed, step, low, bias)
            assert got.dtype == torch.float32
            assert _close_to(got, int4_emulated(x, packed, step, low, bias)) < 1e-5, (k, rows)
            xb = x.bfloat16()
            got = module.int4_linear(xb, packed, step, low, bias)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, module.int4_linear(xb.float(), packed, step, low, bias).bfloat16())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 32, 33, 40])
@pytest.mark.parametrize("kernel", ["native", "widen"])
def test_fp32_paths_match_the_dequantized_weights(rows, kernel):
    layer = _layer()
    native = int8_module() if kernel == "native" else None
    q8 = quant.Int8Linear.from_linear(layer, native)
    x = torch.randn(2, rows, 40)
    exact = F.linear(x, q8.dequantized(), layer.bias)
    if kernel == "native":  # int8-quantized activations, at every row count for fp32 rows
        assert _close_to(q8(x).view(-1, 48), int8_emulated(x.view(-1, 40), q8.int8_weight(), q8.scale, q8.bias)) < 1e-5
        assert ((q8(x) - exact).norm() / exact.norm()).item() < 0.01
    else:
        torch.testing.assert_close(q8(x), exact, rtol=1e-4, atol=1e-4)
    # and close to the unquantized layer: int8 per channel keeps ~2 significant digits
    ref = layer(x)
    assert ((q8(x) - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("rows", [1, quant.INT8PACK_MAX_ROWS, quant.INT8PACK_MAX_ROWS + 1, 33])
@pytest.mark.parametrize("k", [64, 40])  # 40: torch's packed op is wrong there, the widening path serves it
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_bf16_paths_match_fp32_within_bf16_precision(rows, k, kernel):
    layer = _layer(k=k)
    q8 = quant.Int8Linear.from_linear(layer, int8_module() if kernel == "native" else None)
    assert q8.int8pack_ok == (k % 16 == 0)
    x = torch.randn(rows, k)
    got = q8(x.bfloat16())
    assert got.dtype == torch.bfloat16
    ref = layer(x)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 0.03


def test_quantized_lm_head_argmax_equals_its_full_logits_argmax():
    weight = torch.randn(300, 16)
    head = LMHead(weight, 64)
    quant.quantize_model(head, "int8", torch.device("cpu"))
    assert all(isinstance(t, quant.Int8Linear) for t in head.tiles)
    x = torch.randn(5, 16)
    assert torch.equal(head.argmax(x), head(x).argmax(dim=-1))
    assert ((head(x) - F.linear(x, weight)).norm() / F.linear(x, weight).norm()).item() < 0.02


def test_unknown_or_impossible_quantization_is_a_clear_error():
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, int8, int4, gguf; got 'fp8'"):
        make_engine_config("x", quantization="fp8").validate()
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, int8, int4, gguf"):
        quant.check_quantization("int3", torch.device("cpu"))
    with pytest.raises(ConfigError, match="CPU only"):
        quant.check_quantization("int8", torch.device("cuda"))
    with pytest.raises(ConfigError, match="no linear layers"):
        quant.quantize_model(torch.nn.Sequential(torch.nn.ReLU()), "int8", torch.device("cpu"))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--quantization", "int8"]).quantization == "int8"
    assert parser.parse_args(["--quantization", "int4"]).quantization == "int4"
    assert parser.parse_args([]).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int2"])


def test_int4_group_wise_round_trip():
    w = torch.randn(8, 128) * torch.linspace(0.01, 10, 8)[:, None]
    w[0, :32] = 0.5  # a constant group: a zero step must not divide by zero
    packed, step, low = quant.quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 64) and step.shape == low.shape == (8, 4)
    back = quant.dequantize_int4(packed, step, low)
    assert torch.allclose(back[0, :32], w[0, :32])
    assert ((back - w).abs() <= step.repeat_interleave(32, dim=1) / 2 + 1e-5).all()
    # each group spans its own range: its smallest and largest values come back (almost) exactly
    groups = w.view(8, 4, 32)
    assert torch.allclose(back.view(8, 4, 32).amin(-1), groups.amin(-1), atol=1e-5)
    assert torch.allclose(back.view(8, 4, 32).amax(-1), groups.amax(-1), rtol=1e-5, atol=1e-5)


def test_the_int4_kernels_build_here():
    assert int4_kernels() is not None, "the native int4 kernels must build where CI runs"


@pytest.mark.parametrize("rows", [1, quant.INT4_FUSED_MAX_ROWS, quant.INT4_FUSED_MAX_ROWS + 1, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_int4_paths_match_the_dequantized_weights(rows, bias, monkeypatch):
    monkeypatch.setattr(quant, "INT4_CHUNK_ROWS", 20)  # 48 output rows: chunks of 20, 20 and 8
    layer = _layer(k=64, bias=bias)
    q = quant.Int4Linear.from_linear(layer, int4_kernels())
    x = torch.randn(rows, 64)
    ref = F.linear(x, q.dequantized(), layer.bias)
    if rows <= quant.INT4_FUSED_MAX_ROWS:  # int8-quantized activations
        assert _close_to(q(x), int4_emulated(x, q.qweight, q.step, q.low, q.bias)) < 1e-5
        assert ((q(x) - ref).norm() / ref.norm()).item() < 0.01
    else:
        assert torch.allclose(q(x), ref, atol=1e-4, rtol=1e-4)
    got = q(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref, atol=0.1, rtol=0.05)  # bf16 activations and output rounding
    assert q(x.view(rows, 1, 64)).shape == (rows, 1, 48)


def test_int4_keeps_int8_for_layers_it_cannot_group(caplog):
    model = torch.nn.Sequential(_layer(k=64), _layer(k=40))
    quant.quantize_model(model, "int4", torch.device("cpu"))
    assert isinstance(model[0], quant.Int4Linear) and isinstance(model[1], quant.Int8Linear)
    assert "1 of 2 linear layers" in caplog.text and "stay int8" in caplog.text


def test_int4_without_its_kernel_is_a_clear_error(monkeypatch):
    import inferd.models.cpu_kernels as ck

    monkeypatch.setattr(ck, "int4_kernels", lambda: None)
    with pytest.raises(ConfigError, match="int4 needs its native CPU kernel"):
        quant.quantize_model(torch.nn.Sequential(_layer(k=64)), "int4", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "llama"])  # tied head; tied head with q/k/v bias; untied
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_runs_quantized_end_to_end(tiny_models, arch, dtype, mode):
    llm = LLM(str(tiny_models[arch]), max_model_len=128, num_blocks=24, block_size=8, dtype=dtype, quantization=mode)
    model = llm.engine.model
    assert not any(isinstance(m, Linear) for m in model.modules()), "every linear layer is quantized"
    assert isinstance(model.lm_head.tiles[0], quant.Int8Linear)  # int4 too keeps the LM head in int8
    layer_class = quant.Int8Linear if mode == "int8" else quant.Int4Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, layer_class)
    texts = ["The quick brown fox", "def add(a, b):", "Question: What is the capital of France?", "Paged"]
    prompts = [t for t in texts for _ in range(3)]  # each prompt greedy, greedy with logprobs, sampled
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=1),
    ] * 4
    outs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    if dtype == "float32":  # bf16 kernels round differently for different row counts: near-ties may flip
        for greedy, with_logprobs in zip(outs[0::3], outs[1::3], strict=True):
            assert greedy.outputs[0].token_ids == with_logprobs.outputs[0].token_ids
    assert_idle(llm)


def test_int4_keeps_a_4_bit_grid_exactly():
    """Values dequantized from 4-bit blocks (w = d * q - m, q in 0..15, as a GGUF's Q4_K holds them) come back
    to float rounding (where min-max would be off by up to half a step), even where a group does
    not use the lowest or highest level (min-max would re-round them);
    values with 17 or more levels, or off any grid, fall back to min-max."""
    torch.manual_seed(0)
    q = torch.randint(2, 14, (6, 64)).float()  # levels 2..13 only: min-max's step would differ
    d = torch.tensor([0.0123, 0.5, 3.0, 1e-3, 7.25, 0.0625])[:, None]
    w = q * d - 0.37 * d
    w[5, 32:] = torch.randn(32)  # one group off any grid
    packed, step, low = quant.quantize_int4(w)
    back = quant.dequantize_int4(packed, step, low)
    err = (back - w).abs().view(6, 2, 32).amax(-1)
    top = w.abs().view(6, 2, 32).amax(-1)
    on_grid = torch.ones(6, 2, dtype=torch.bool)
    on_grid[5, 1] = False
    assert (err[on_grid] <= top[on_grid] * 2.0**-20).all()  # float rounding, not int4's error
    minmax = (w[:5] - w[:5].view(5, 2, 32).amin(-1).repeat_interleave(32, 1)) / (
        (w[:5].view(5, 2, 32).amax(-1) - w[:5].view(5, 2, 32).amin(-1)) / 15
    ).repeat_interleave(32, 1)
    assert (minmax - minmax.round()).abs().max() > 0.1  # the grid was not min-max's: that would re-round
    assert torch.allclose(step[:5], d[:5].expand(5, 2))
    off = w[5, 32:]
    assert step[5, 1] == pytest.approx(float(off.max() - off.min()) / 15)
    wide = torch.arange(32.0).repeat(2, 1) * 0.1  # 32 levels: no 16-level grid
    assert quant.quantize_int4(wide)[1] == pytest.approx((31 * 0.1) / 15)


def test_int4_from_gguf_q4_k_blocks_is_not_quantized_twice():
    """Q4_K blocks (random bytes, sane scales) dequantized by the gguf package, as the converter does, then
    quantized to int4: the weights come back to float rounding, where min-max on the same values would not."""
    import gguf

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (8, 144 * 2), dtype=np.uint8)  # 8 rows of 2 blocks of 256 weights
    for row in range(8):
        for b in range(2):
            raw[row, b * 144 : b * 144 + 4] = np.array([0.01 * (row + 1), 0.003], dtype=np.float16).view(np.uint8)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).copy())
    back = quant.dequantize_int4(*quant.quantize_int4(w))
    assert (back - w).abs().max() <= w.abs().max() * 2.0**-20
    groups = w.view(8, -1, 32)
    span = ((groups.amax(-1) - groups.amin(-1)) / 15).clamp(min=1e-12)
    minmax = (groups - groups.amin(-1, keepdim=True)) / span[..., None]
    assert (minmax - minmax.round()).abs().max() > 0.1


# -- --quantization auto: the checkpoint's own storage decides ---------------------------------------------
GGUF_FORMATS = {"F32": 2, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_serves_a_quantized_checkpoint_in_int8_on_cpu_and_floats_otherwise(monkeypatch):
    monkeypatch.setattr(ck, "int8_module", lambda: object())
    choice = quant.resolve_quantization("auto", CPU, GGUF_FORMATS)
    assert choice.name == "int8" and "81 Q5_0, 27 Q4_K, 10 Q8_0, 9 Q6_K" in choice.reason
    assert quant.resolve_quantization("auto", CPU, {}).name is None  # a folder of float weights
    assert quant.resolve_quantization("auto", CPU, {"F16": 100, "F32": 30}).name is None  # a float GGUF
    on_gpu = quant.resolve_quantization("auto", CUDA, GGUF_FORMATS)
    assert on_gpu.name is None and "CPU kernels" in on_gpu.reason
    monkeypatch.setattr(ck, "int8_module", lambda: None)
    unbuilt = quant.resolve_quantization("auto", CPU, GGUF_FORMATS)
    assert unbuilt.name is None and "did not build" in unbuilt.reason
    # what is asked for is what runs
    assert quant.resolve_quantization("none", CPU, GGUF_FORMATS).name is None
    assert quant.resolve_quantization(None, CPU, GGUF_FORMATS).name is None
    assert quant.resolve_quantization("int4", CPU, {}) == quant.QuantChoice("int4", "asked for")


def test_a_converted_gguf_records_how_the_file_stored_each_matrix(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from inferd.models import loader

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(rng.standard_normal((4, 64), dtype=np.float32),
                      GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((4, 64), dtype=np.float32).astype(np.float16))
    writer.add_tensor("output_norm.weight", rng.standard_normal(64, dtype=np.float32))  # a vector: not a matrix
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    folder.mkdir()
    assert loader.checkpoint_formats(folder) == {}
    loader._write_formats(path, folder)
    assert loader.checkpoint_formats(folder) == {"F16": 1, "Q8_0": 1}


def test_an_engine_on_a_quantized_checkpoint_runs_int8_by_default_and_says_so(tiny_models, tmp_path):
    if int8_module() is None:
        pytest.skip("the native int8 kernel did not build here, so auto keeps floats")
    import json
    import shutil

    from inferd.models.loader import FORMATS_FILE

    folder = tmp_path / "gguf-like"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / FORMATS_FILE).write_text(json.dumps({"Q4_K": 3, "Q8_0": 1}))
    engine = LLM(str(folder), max_model_len=64, num_blocks=16, block_size=8).engine
    assert engine.quantization == "int8" and "3 Q4_K, 1 Q8_0" in engine.quant_choice.reason
    assert isinstance(engine.model.model.layers[0].mlp.down_proj, quant.Int8Linear)
    plain = LLM(str(folder), max_model_len=64, num_blocks=16, block_size=8, quantization="none").engine
    assert plain.quantization is None and isinstance(plain.model.model.layers[0].mlp.down_proj, Linear)
    assert LLM(str(tiny_models["llama"]), max_model_len=64, num_blocks=16, block_size=8).engine.quantization is None
