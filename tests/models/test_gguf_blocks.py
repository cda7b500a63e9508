"""--quantization gguf: the GGUF block kernel against the `gguf` package, and a model on a GGUF file's blocks."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf import MODEL_ARCH_NAMES as ARCH_NAMES
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from inferd import LLM, SamplingParams
from inferd.errors import ConfigError
from inferd.models import cpu_kernels as ck
from inferd.models import loader
from inferd.models.cpu_kernels import gguf_module
from inferd.models.dtypes import cpu_flags
from inferd.models.gguf_blocks import COMPACT_MAX_ROWS, GGUF_TYPES, CompactBlocks, GGUFLinear
from inferd.models.quant import Int8Linear
from tests.conftest import cpu_feature

T = GGMLQuantizationType


@pytest.fixture(scope="module")
def kernels():
    module = gguf_module()
    if module is None:
        pytest.skip("the native GGUF kernel did not build here")
    return module


def random_blocks(kind: T, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Rows of random blocks of `kind`: random codes and scale bytes, with sane fp16 steps."""
    rng = np.random.default_rng(seed)
    values, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, k // values, size), dtype=np.uint8)
    steps = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}.get(kind, (0,))
    for at in steps:
        half = (rng.random((rows, k // values)) * 0.02 + 1e-3).astype(np.float16)
        raw[:, :, at : at + 2] = half.view(np.uint8).reshape(rows, k // values, 2)
    return raw.reshape(rows, -1)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: int8 per group of 32 with a float step max|x| / 127, back in float64."""
    m, k = x.shape
    groups = x.float().view(m, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(groups * inv) * (amax / 127.0)).view(m, k).double()


KINDS = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_blocks_dequantize_exactly_as_the_gguf_package_does(kernels, kind):
    raw = random_blocks(kind, 37, 512)
    want = dequantize(raw, kind).reshape(37, 512).astype(np.float32)
    got = kernels.gguf_dequantize(torch.from_numpy(raw), int(kind), 512, 0, 37)
    assert torch.equal(got, torch.from_numpy(want))
    part = kernels.gguf_dequantize(torch.from_numpy(raw), int(kind), 512, 5, 9)
    assert torch.equal(part, got[5:9])


def packed(kernels, raw: np.ndarray, kind: T, k: int) -> list[torch.Tensor]:
    return list(kernels.gguf_pack(torch.from_numpy(raw), int(kind), k))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_tiles_hold_exactly_the_files_values(kernels, kind):
    """37 rows: four full tiles of 8 and one of 5."""
    raw = random_blocks(kind, 37, 512, seed=1)
    tiles = packed(kernels, raw, kind, 512)
    assert tiles[0].shape == (5, 512 // 32 * 256)
    want = kernels.gguf_dequantize(torch.from_numpy(raw), int(kind), 512, 0, 37)
    assert torch.equal(kernels.gguf_unpack(tiles, int(kind), 512, 0, 37), want)
    assert torch.equal(kernels.gguf_unpack(tiles, int(kind), 512, 6, 19), want[6:19])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
def test_the_kernel_is_the_dot_product_of_rounded_activations_with_the_files_values(kernels, kind, rows):
    """Exact but for float summation order: the file's weights times the activations rounded to int8 per 32.
    37 output rows leave a partial last tile; 5 and 13 activation rows partial blocks of 4."""
    raw = random_blocks(kind, 37, 512, seed=rows)
    w = torch.from_numpy(dequantize(raw, kind).reshape(37, 512).astype(np.float64))
    tiles = packed(kernels, raw, kind, 512)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, 512), torch.randn(37)
    got = kernels.gguf_linear(x, tiles, [int(kind)], [37], bias)
    xq = rounded_activations(x)
    want = xq @ w.T + bias.double()
    scale = xq.abs() @ w.abs().T + bias.double().abs()
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() / scale).max() < 1e-5
    # bfloat16 rows: rounded to int8 from their bf16 values, the output rounded to bf16
    got16 = kernels.gguf_linear(x.bfloat16(), tiles, [int(kind)], [37], bias)
    want16 = rounded_activations(x.bfloat16()) @ w.T + bias.double()
    assert got16.dtype == torch.bfloat16
    assert ((got16.double() - want16).abs() / scale).max() < 1e-2


@pytest.mark.slow
@pytest.mark.cpu_feature  # skips itself where the CPU has no VNNI (a Zen 3)
def test_the_vnni_kernel_gives_the_avx2_kernels_bits(kernels):
    """Where the CPU has VNNI the integer sums are vpdpbusd's (Q6_K's halves scaled after): the same integers as
    AVX2's vpmaddubsw + vpmaddwd, the same float work after, so the same output bits. A build forced to plain
    AVX2 here is the reference."""
    if not kernels.isa().startswith("avx2-vnni"):
        pytest.skip(f"the GGUF kernel was built for {kernels.isa()} here: no VNNI path to compare")
    plain = ck._build("inferd_test_gguf_avx2", ck._GGUF_SOURCE, "GGUF kernel (avx2)",
                      ["-ffp-contract=off", "-mno-avx512f", "-mno-avxvnni"])  # fmt: skip
    assert plain is not None and plain.isa() == "avx2"
    for kind in KINDS:
        raw = random_blocks(kind, 37, 512, seed=7)
        tiles = packed(kernels, raw, kind, 512)
        for rows in (1, 4, 7):
            x = torch.randn(rows, 512) * 3
            for dtype in (torch.float32, torch.bfloat16):
                got = kernels.gguf_linear(x.to(dtype), tiles, [int(kind)], [37], None)
                want = plain.gguf_linear(x.to(dtype), tiles, [int(kind)], [37], None)
                assert torch.equal(got, want), (kind.name, rows, dtype)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_rows_outputs_are_the_same_bits_alone_and_among_many(kernels, kind):
    """Each row's outputs take the same integer sums and float steps at any row count: alone (one row), in blocks
    of four, or (from 8 rows on a CPU with AMX) in AMX's tiles of 16. 21 rows: a partial row tile."""
    raw = random_blocks(kind, 37, 512, seed=11)
    tiles = packed(kernels, raw, kind, 512)
    x = torch.randn(21, 512) * 2
    for dtype in (torch.float32, torch.bfloat16):
        many = kernels.gguf_linear(x.to(dtype), tiles, [int(kind)], [37], None)
        alone = torch.cat(
            [kernels.gguf_linear(x[i : i + 1].to(dtype), tiles, [int(kind)], [37], None) for i in range(21)]
        )
        assert torch.equal(many, alone), dtype
    if hasattr(kernels, "set_amx"):  # the AMX path against the vpdpbusd path at the same row count
        kernels.set_amx(False)
        try:
            plain = kernels.gguf_linear(x, tiles, [int(kind)], [37], None)
        finally:
            kernels.set_amx(True)
        assert torch.equal(kernels.gguf_linear(x, tiles, [int(kind)], [37], None), plain)


def test_segments_of_several_types_are_one_layer_and_bf16_rows_above_64_take_the_dense_path(kernels):
    k = 256
    parts = [(T.Q5_0, random_blocks(T.Q5_0, 24, k, 1)), (T.Q8_0, random_blocks(T.Q8_0, 9, k, 2)),
             (T.Q6_K, random_blocks(T.Q6_K, 16, k, 3))]  # fmt: skip
    layer = GGUFLinear([(int(kind), torch.from_numpy(raw)) for kind, raw in parts], k, None, kernels)
    layer.out_sizes = [24, 9, 16]
    x = torch.randn(6, k)
    whole = layer(x)
    alone = [
        kernels.gguf_linear(x, packed(kernels, raw, kind, k), [int(kind)], [len(raw)], None) for kind, raw in parts
    ]
    assert torch.equal(whole, torch.cat(alone, 1))
    assert [t.shape[-1] for t in layer.split(whole)] == [24, 9, 16]
    w = torch.cat([torch.from_numpy(dequantize(raw, kind).reshape(-1, k).astype(np.float32)) for kind, raw in parts])
    assert torch.equal(layer.dequantized(), w) and torch.equal(layer.dequantized(lo=20, hi=40), w[20:40])
    # many bf16 rows: the weights widened to bf16 for the dense matmul, the activations not rounded
    many = torch.randn(70, k).bfloat16()
    torch.testing.assert_close(layer(many).float(), (many @ w.bfloat16().T).float(), rtol=2e-2, atol=2e-2)
    tiles_bytes = sum(t.numel() * t.element_size() for t in layer.tiles)
    assert layer.weight_bytes() == tiles_bytes


def test_the_kernels_refuse_what_does_not_fit(kernels):
    raw = torch.from_numpy(random_blocks(T.Q5_0, 4, 256))
    with pytest.raises(RuntimeError, match="needs"):
        kernels.gguf_pack(raw, int(T.Q5_0), 512)
    with pytest.raises(RuntimeError, match="not supported"):
        kernels.gguf_pack(raw, int(T.IQ4_NL), 256)
    tiles = list(kernels.gguf_pack(raw, int(T.Q5_0), 256))
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels.gguf_linear(torch.randn(1, 512), tiles, [int(T.Q5_0)], [4], None)


# -- compact tiles: a few rows on the file's own bits -----------------------------------------------------------
HAS_COMPACT = {"avx512_vnni", "avx512bw", "avx512vl", "f16c"} <= cpu_flags()
needs_compact = cpu_feature(not HAS_COMPACT, "the compact GGUF kernel needs AVX-512 VNNI, which this CPU lacks")
COMPACT_KINDS = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K]
#: bits a weight of each kind's compact tiles: the file's codes, fp16 steps (Q8_0/Q4_0/Q5_0 as stored), the
#: k-quants' A and B in float32
COMPACT_BITS = {T.Q8_0: 8.5, T.Q4_0: 4.5, T.Q5_0: 5.5, T.Q4_K: 6.0, T.Q5_K: 7.0}


def test_the_compact_kernel_is_built_exactly_where_the_cpu_has_avx512_vnni(kernels):
    assert kernels.compact_available() == HAS_COMPACT


@pytest.mark.parametrize("kind", COMPACT_KINDS, ids=lambda k: k.name)
def test_compact_tiles_hold_exactly_the_files_values_at_its_bits(kernels, kind):
    """37 rows: two full tiles of 16 and one of 5."""
    raw = random_blocks(kind, 37, 512, seed=3)
    tiles = kernels.gguf_pack_compact(torch.from_numpy(raw), int(kind), 512)
    assert tiles.shape == (3, 512 // 32 * int(COMPACT_BITS[kind] * 16 * 32 / 8))  # a group: 16 rows x 32 weights
    want = kernels.gguf_dequantize(torch.from_numpy(raw), int(kind), 512, 0, 37)
    assert torch.equal(kernels.gguf_unpack_compact(tiles, int(kind), 512, 0, 37), want)
    assert torch.equal(kernels.gguf_unpack_compact(tiles, int(kind), 512, 6, 19), want[6:19])


@needs_compact
@pytest.mark.parametrize("kind", COMPACT_KINDS, ids=lambda k: k.name)
def test_the_compact_kernel_gives_the_tile_kernels_bits(kernels, kind):
    """The same integer sums and float steps in the same order as the 8-row tiles' kernel: the same output bits,
    at 1-7 rows (partial blocks of 4), float32 and bf16, with a bias, over a partial last tile."""
    raw = random_blocks(kind, 37, 512, seed=5)
    tiles = packed(kernels, raw, kind, 512)
    compact = kernels.gguf_pack_compact(torch.from_numpy(raw), int(kind), 512)
    bias = torch.randn(37)
    for rows in (1, 2, 3, 4, 5, 7):
        x = torch.randn(rows, 512) * 3
        for dtype in (torch.float32, torch.bfloat16):
            want = kernels.gguf_linear(x.to(dtype), tiles, [int(kind)], [37], bias)
            got = kernels.gguf_linear_compact(x.to(dtype), [compact], [int(kind)], [37], bias)
            assert torch.equal(got, want), (rows, dtype)


@needs_compact
def test_compact_segments_of_several_types_are_one_layer(kernels):
    k = 256
    parts = [(T.Q5_0, random_blocks(T.Q5_0, 24, k, 1)), (T.Q8_0, random_blocks(T.Q8_0, 9, k, 2)),
             (T.Q4_K, random_blocks(T.Q4_K, 16, k, 3))]  # fmt: skip
    blocks = CompactBlocks([(int(kind), torch.from_numpy(raw)) for kind, raw in parts], k, None, kernels)
    x = torch.randn(2, k)
    alone = [
        kernels.gguf_linear(x, packed(kernels, raw, kind, k), [int(kind)], [len(raw)], None) for kind, raw in parts
    ]
    assert torch.equal(blocks(x), torch.cat(alone, 1))
    w = torch.cat([torch.from_numpy(dequantize(raw, kind).reshape(-1, k).astype(np.float32)) for kind, raw in parts])
    assert torch.equal(blocks.dequantized(), w)
    assert blocks.weight_bytes() == sum(t.numel() for t in blocks.tiles)


def test_the_compact_kernels_refuse_what_they_cannot_run(kernels):
    raw = torch.from_numpy(random_blocks(T.Q6_K, 4, 256))
    with pytest.raises(RuntimeError, match="has no compact tiles"):
        kernels.gguf_pack_compact(raw, int(T.Q6_K), 256)
    tiles = kernels.gguf_pack_compact(torch.from_numpy(random_blocks(T.Q5_0, 4, 256)), int(T.Q5_0), 256)
    with pytest.raises(RuntimeError, match="do not fit" if HAS_COMPACT else "needs AVX-512 VNNI"):
        kernels.gguf_linear_compact(torch.randn(1, 512), [tiles], [int(T.Q5_0)], [4], None)


# -- a model on a GGUF file's blocks ---------------------------------------------------------------------------
# what each matrix is stored as in the test's file (the gguf package quantizes these types)
STORED = {"attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_down": T.Q4_0, "token_embd": T.Q8_0, "output": T.Q8_0}


def llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's converter permutes them for Llama-family models (rotary's pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder, target, arch: str, permute: bool):
    """A GGUF of `folder`'s weights, quantized, and `target`: a copy of the folder holding the file's values,
    as converting the file gives (with the file recorded as its source)."""
    import json

    shutil.copytree(folder, target)
    config = json.loads((folder / "config.json").read_text())
    names = get_tensor_name_map(next(a for a, n in ARCH_NAMES.items() if n == arch), config["num_hidden_layers"])
    weights = load_file(str(folder / "model.safetensors"))
    path = target.parent / f"{target.name}.gguf"
    writer = GGUFWriter(path, arch)
    values = {}
    for name, tensor in weights.items():
        gguf_name = names.get_name(name.removesuffix(".weight"))
        if tensor.dim() != 2 or gguf_name is None:
            values[name] = tensor
            continue
        kind = STORED.get(gguf_name.split(".")[-1], T.Q5_0)
        w = tensor.float().numpy()
        kv = config["num_key_value_heads"]
        heads = {"attn_q": config["num_attention_heads"], "attn_k": kv}.get(gguf_name.split(".")[-1])
        if permute and heads:
            w = llama_cpp_order(w, heads)
        blocks = quantize(w, kind)
        writer.add_tensor(f"{gguf_name}.weight", blocks, raw_dtype=kind)
        stored = dequantize(blocks, kind).astype(np.float32).reshape(w.shape)
        if permute and heads:  # back to the checkpoint's order, as transformers' GGUF loader does
            n = stored.shape[0]
            stored = stored[np.arange(n).reshape(heads, n // heads // 2, 2).transpose(0, 2, 1).reshape(-1)]
        values[name] = torch.from_numpy(np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(values, str(target / "model.safetensors"))
    loader._write_source(path, target)
    return path


@pytest.mark.parametrize(("arch", "gguf_arch", "permute"), [("llama", "llama", True), ("gemma3", "gemma3", False)])
def test_a_model_on_its_ggufs_blocks_multiplies_by_the_files_values(tiny_models, tmp_path, arch, gguf_arch, permute):
    if gguf_module() is None:
        pytest.skip("the native GGUF kernel did not build here")
    write_gguf(tiny_models[arch], tmp_path / arch, gguf_arch, permute)
    kw = dict(max_model_len=64, num_blocks=32, block_size=8, dtype="float32")
    blocks = LLM(str(tmp_path / arch), quantization="gguf", **kw)
    reference = LLM(str(tmp_path / arch), quantization="none", cpu_linear="dense", **kw)
    assert blocks.engine.quantization == "gguf"
    ours = dict(blocks.engine.model.named_modules())
    floats = dict(reference.engine.model.named_modules())
    on_blocks = {name: m for name, m in ours.items() if isinstance(m, GGUFLinear)}
    assert not any(isinstance(m, Int8Linear) for m in ours.values())
    assert {n.rsplit(".", 1)[-1] for n in on_blocks} >= {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert sum(n.startswith("lm_head.tiles") for n in on_blocks) == len(reference.engine.model.lm_head.tiles)
    for name, layer in on_blocks.items():  # the file's values, q/k rows in the checkpoint's order
        assert torch.equal(layer.dequantized(), floats[name].weight.float()), name
    qkv = ours["model.layers.0.self_attn.qkv_proj"]
    assert qkv.types == [GGUF_TYPES["Q5_0"], GGUF_TYPES["Q5_0"], GGUF_TYPES["Q8_0"]]
    params = SamplingParams(max_tokens=8, temperature=0)
    (out,) = blocks.generate(["the quick brown fox"], params)
    assert len(out.outputs[0].token_ids) == 8
    # a bf16 model: the tiles' float factors and offsets stay float32 (the kernel reads them so)
    bf16 = LLM(str(tmp_path / arch), quantization="gguf", **{**kw, "dtype": "bfloat16"})
    layer = bf16.engine.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, GGUFLinear) and all(t.dtype == torch.float32 for t in layer.tiles[1:3])
    assert torch.equal(layer.dequantized(), on_blocks["model.layers.0.mlp.down_proj"].dequantized())
    (out16,) = bf16.generate(["the quick brown fox"], params)
    assert len(out16.outputs[0].token_ids) == 8


def test_a_layer_whose_blocks_do_not_match_stays_int8_and_the_log_says_why(tiny_models, tmp_path, caplog):
    if gguf_module() is None:
        pytest.skip("the native GGUF kernel did not build here")
    target = tmp_path / "llama"
    write_gguf(tiny_models["llama"], target, "llama", permute=True)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] += 1e-3  # no longer what the file stores
    save_file(weights, str(target / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="inferd.models.quant"):
        llm = LLM(str(target), quantization="gguf", max_model_len=64, num_blocks=32, block_size=8, dtype="float32")
    layers = llm.engine.model.model.layers
    assert isinstance(layers[1].mlp.down_proj, Int8Linear) and isinstance(layers[0].mlp.down_proj, GGUFLinear)
    assert "model.layers.1.mlp.down_proj stays int8: its blocks do not dequantize to the loaded weights" in caplog.text


@needs_compact
def test_auto_int8_reads_the_files_own_blocks_for_a_few_rows(tiny_models, tmp_path):
    """--quantization auto on a GGUF: int8 layers, each body layer holding its compact blocks (the file's values)
    for 1-COMPACT_MAX_ROWS rows, where it gives --quantization gguf's bits; more rows take int8; explicit
    --quantization int8 has none. The LM head stays int8."""
    import json

    write_gguf(tiny_models["gemma3"], tmp_path / "gemma3", "gemma3", permute=False)
    # what converting the file records: its matrices' types (auto quantizes a checkpoint that stored them so)
    (tmp_path / "gemma3" / loader.FORMATS_FILE).write_text(json.dumps({"Q5_0": 1, "Q8_0": 1, "Q4_0": 1}))
    kw = dict(max_model_len=64, num_blocks=32, block_size=8, dtype="float32")
    auto = LLM(str(tmp_path / "gemma3"), **kw)
    blocks = LLM(str(tmp_path / "gemma3"), quantization="gguf", **kw)
    int8 = LLM(str(tmp_path / "gemma3"), quantization="int8", **kw)
    assert auto.engine.quantization == "int8" and auto.engine.quant_choice.small_on_blocks
    ours, theirs = dict(auto.engine.model.named_modules()), dict(blocks.engine.model.named_modules())
    body = {n: m for n, m in ours.items() if isinstance(m, Int8Linear) and not n.startswith("lm_head")}
    assert body and all(m.small is not None for m in body.values())
    assert all(m.small is None for n, m in ours.items() if isinstance(m, Int8Linear) and n.startswith("lm_head"))
    assert all(m.small is None for m in int8.engine.model.modules() if isinstance(m, Int8Linear))
    for name, layer in body.items():
        assert torch.equal(layer.small.dequantized(), theirs[name].dequantized()), name
        assert layer.bytes_at(1) == layer.small.weight_bytes() < layer.weight_bytes() == layer.bytes_at(8)
        for rows in (1, COMPACT_MAX_ROWS, COMPACT_MAX_ROWS + 1):
            x = torch.randn(rows, layer.in_features)
            if rows <= COMPACT_MAX_ROWS:
                assert torch.equal(layer(x), theirs[name](x)), (name, rows)
            else:
                assert torch.equal(layer(x), int8.engine.model.get_submodule(name)(x)), (name, rows)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = auto.generate(["the quick brown fox", "a b c d"], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]


def test_gguf_needs_a_gguf_checkpoint(tiny_models):
    with pytest.raises(ConfigError, match="not a GGUF"):
        LLM(str(tiny_models["llama"]), quantization="gguf", max_model_len=64, num_blocks=16, block_size=8)
    assert loader.gguf_source(tiny_models["llama"]) is None
