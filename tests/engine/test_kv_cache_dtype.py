"""An fp8 KV cache, or a bf16 one under float32 activations (--kv-cache-dtype): what is stored, what every
attention path reads back, what it holds."""

from __future__ import annotations

import functools

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.disagg.transport import checksums, copy_blocks, gather, scatter
from inferd.errors import ConfigError
from inferd.models import cpu_kernels, dtypes
from inferd.models.attention import AttentionMetadata, DecodeGroup, paged_attention, to_cache
from tests.conftest import assert_idle
from tests.engine.test_attention import _case as attention_case
from tests.engine.test_prefill_attention import _case as prefill_case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HAS_AMX_BF16 = {"amx_bf16", "amx_tile"} <= dtypes.cpu_flags()


@pytest.mark.parametrize("fp8", FP8)
def test_writes_round_to_nearest_and_clamp_to_the_finite_range(fp8):
    top = torch.finfo(fp8).max
    x = torch.tensor([0.0, 1.0, -3.3, 1e-3, 2 * top, -5 * top, float(top)])
    stored = to_cache(x, fp8)
    assert stored.dtype == fp8
    assert torch.isfinite(stored.float()).all(), "a bare cast turns e4m3's overflow into NaN"
    assert stored.float()[4] == top and stored.float()[5] == -top
    assert torch.equal(stored.float()[:4], x[:4].to(fp8).float())


def _finite_patterns(fp8: torch.dtype, n: int) -> torch.Tensor:
    """n values of the format covering every finite bit pattern (NaNs and infinities replaced by zero)."""
    bits = torch.arange(256, dtype=torch.uint8).repeat(-(-n // 256))[:n]
    values = bits.view(fp8).float()
    return torch.where(torch.isfinite(values), values, 0.0).to(fp8)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_widens_every_value_exactly(fp8, dtype):
    """One key: the softmax is 1 and the output is that token's value row, as torch converts it. The row
    holds every finite pattern of the format (subnormals, both signs), through the kernel's vector path."""
    D = 256
    v_cache = _finite_patterns(fp8, D).view(1, 1, 1, D)
    k_cache = torch.zeros(1, 1, 1, D).to(fp8)
    q = torch.randn(1, 2, D).to(dtype)
    out = cpu_kernels.paged_decode_kernel()(q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.long),
                                            torch.tensor([1]), 0.1, 0, 0.0)  # fmt: skip
    assert torch.equal(out[0].float(), v_cache.view(1, D).float().expand(2, D).to(dtype).float())


@pytest.mark.parametrize("fp8", FP8)
def test_bf16_queries_on_fp8_equal_a_bf16_cache_of_the_same_values(fp8):
    """Keys and values holding every finite pattern: the fp8 cache, widened in the kernel, gives the bits a bf16
    cache holding the same values gives (both products sum the same bf16 values in the same order)."""
    g = torch.Generator().manual_seed(1)
    D, BS, blocks = 256, 16, 8
    k_cache = _finite_patterns(fp8, blocks * BS * D)[torch.randperm(blocks * BS * D, generator=g)].view(
        blocks, BS, 1, D
    )
    v_cache = _finite_patterns(fp8, blocks * BS * D).view(blocks, BS, 1, D)
    q = (torch.randn(3, 4, D, generator=g) / 64).bfloat16()  # small: the scores of 448-sized keys stay finite
    tables = torch.stack([torch.randperm(blocks, generator=g) for _ in range(3)])
    lens = torch.tensor([BS * blocks, 77, 1])
    kernel = cpu_kernels.paged_decode_kernel()
    got = kernel(q, k_cache, v_cache, tables, lens, 0.05, 0, 0.0)
    same = kernel(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 0.05, 0, 0.0)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, same)


@pytest.mark.parametrize("fp8", FP8)
def test_every_key_pattern_reaches_the_scores_exactly(fp8):
    """Each (request, head) probes one pattern: its query is 1 / |k| at that d, so the score is +-1 and a key
    widened wrongly (even a subnormal off by one step) moves the weight of its value row of ones against three
    keys of zeros by far more than bf16's rounding; bf16 queries take the kernel's vdpbf16ps path."""
    D = 256
    keys = _finite_patterns(fp8, D)
    exact = keys.float()
    batch = D // 4
    k_cache = torch.zeros(batch, 16, 1, D).to(fp8)
    v_cache = torch.zeros(batch, 16, 1, D).to(fp8)
    k_cache[:, 0, 0] = keys
    v_cache[:, 0, 0] = torch.ones(D).to(fp8)
    q = torch.zeros(batch, 4, D)
    d = torch.arange(D)
    q.view(D, D)[d, d] = torch.where(exact != 0, 1 / exact.abs().clamp(min=2**-16), 0.0)
    q = q.bfloat16()
    tables, lens = torch.arange(batch)[:, None], torch.full((batch,), 4)  # four keys: the vector path takes fours
    kernel = cpu_kernels.paged_decode_kernel()
    got = kernel(q, k_cache, v_cache, tables, lens, 1.0, 0, 0.0)
    same = kernel(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 1.0, 0, 0.0)
    assert torch.equal(got, same)
    e = torch.exp(q.float().view(D, D)[d, d] * exact)
    expected = (e / (e + 3)).view(batch, 4, 1).expand(batch, 4, D)  # against three keys of zeros
    assert torch.allclose(got.float(), expected, atol=1e-2)


def _decode_case(seed, fp8):
    """test_attention's decode batch (one request 300 tokens long), its caches in fp8."""
    case = list(attention_case(seed, 4, 2, batch=6, head_dim=64, longest=300, first_len=300))
    case[3], case[4] = to_cache(case[3] * 3, fp8), to_cache(case[4], fp8)
    return case


def _decode(kernel, case, dtype, window, softcap):
    q, k_new, v_new, k_cache, v_cache, tables, seq_lens, slots = case
    group = DecodeGroup(0, q.shape[0], tables, seq_lens, k_cache.shape[1])
    meta = AttentionMetadata(slots, k_cache.shape[1], decode_groups=[group], decode_kernel=kernel)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = paged_attention(q.to(dtype), k_new.to(dtype), v_new.to(dtype), k_cache, v_cache, meta, 0.2, window, softcap)
    return out, k_cache


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("threads", [0, 8])  # 8: long requests' tokens split over threads and merged
def test_decode_kernel_on_fp8_matches_the_reference_on_the_same_values(fp8, dtype, window, threads):
    case = _decode_case(int(dtype.itemsize) + (window or 0), fp8)
    case = [t.to(dtype).float() if t.dtype == torch.float32 else t for t in case]  # q and new K/V as dtype holds them
    ref, ref_cache = _decode(None, case, torch.float32, window, 20.0)
    kernel = functools.partial(cpu_kernels.paged_decode_kernel(), threads=threads)
    got, cache = _decode(kernel, case, dtype, window, 20.0)
    assert got.dtype == dtype and cache.dtype == fp8
    if dtype == torch.float32:  # the same new K/V, rounded into the cache alike by either path
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert torch.allclose(got.float(), ref, **tol)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("threads", [0, 8])
def test_float32_queries_on_a_bf16_cache_equal_a_float32_cache_of_the_same_values(window, threads):
    """--kv-cache-dtype bfloat16 under a float32 model: the new K/V are rounded to bf16 as they are written, and
    the kernel, widening the rows as it reads them, gives what a float32 cache holding those values gives, to
    float32's rounding (a sum's order may differ with the vector width; bf16's own error is ~1e-3 here); the
    PyTorch path agrees too."""
    case = _decode_case(5, torch.bfloat16)
    k_new, v_new = (t.bfloat16().float() for t in case[1:3])  # what the cache will hold of the new K/V
    kernel = functools.partial(cpu_kernels.paged_decode_kernel(), threads=threads)
    got, cache = _decode(kernel, case, torch.float32, window, 20.0)
    assert got.dtype == torch.float32 and cache.dtype == torch.bfloat16
    as_float = [case[0], k_new, v_new, case[3].float(), case[4].float(), *case[5:]]
    same, float_cache = _decode(kernel, as_float, torch.float32, window, 20.0)
    assert torch.equal(cache.float(), float_cache)  # written rounded to nearest, as torch casts
    assert torch.allclose(got, same, atol=1e-6, rtol=1e-6)
    ref, _ = _decode(None, case, torch.float32, window, 20.0)
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)


def _prefill_case(seed, fp8):
    """test_prefill_attention's chunks (bf16 queries and new K/V), with and without context, caches in fp8."""
    tensors, prefills, slots = prefill_case(seed, 4, 1, 256, 16, [(70, 0), (17, 37), (16, 100)])
    q, k, v, k_cache, v_cache = tensors
    return (q, k, v, to_cache(k_cache.float() * 3, fp8), to_cache(v_cache.float(), fp8)), prefills, slots


def _prefill(kernel, case, dtype, window, softcap):
    (q, k, v, k_cache, v_cache), prefills, slots = case
    meta = AttentionMetadata(slots, k_cache.shape[1], prefills=prefills, prefill_kernel=kernel)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, q.shape[-1] ** -0.5, window, softcap)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_on_fp8_reads_what_the_cache_holds(fp8, window):
    """Chunks with and without context: the AMX-BF16 kernel (where the CPU has it) and bf16 SDPA both see the
    fp8 values, the first chunk's own fresh K/V included; fp32 SDPA on the same values is the reference."""
    case = _prefill_case(3, fp8)
    ref = _prefill(None, case, torch.float32, window, 20.0)
    sdpa = _prefill(None, case, torch.bfloat16, window, 20.0)
    got = _prefill(cpu_kernels.prefill_attention_kernel(), case, torch.bfloat16, window, 20.0)
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=1e-2)
    assert (got.float() - ref).norm() <= 2 * (sdpa.float() - ref).norm() + 1e-3
    # a bf16 cache with the same values gives the kernel the same answer, bit for bit
    (q, k, v, k_cache, v_cache), prefills, slots = case
    k, v = (to_cache(t, fp8).bfloat16() for t in (k, v))  # rounded as the fp8 path rounds them
    as_bf16 = ((q, k, v, k_cache.bfloat16(), v_cache.bfloat16()), prefills, slots)
    same = _prefill(cpu_kernels.prefill_attention_kernel(), as_bf16, torch.bfloat16, window, 20.0)
    assert torch.equal(got, same)


@pytest.mark.parametrize("fp8", FP8)
def test_block_bytes_move_between_fp8_caches(fp8):
    """The disaggregated handoff copies blocks as bytes: fp8 caches included (torch has no fp8 index ops)."""
    src = [(to_cache(torch.randn(8, 4, 1, 16), fp8), to_cache(torch.randn(8, 4, 1, 16), fp8)) for _ in range(2)]
    dst = [(torch.zeros(8, 4, 1, 16).to(fp8), torch.zeros(8, 4, 1, 16).to(fp8)) for _ in range(2)]
    scatter(dst, [5, 0], gather(src, [1, 2]))
    assert checksums(dst, [5, 0]) == checksums(src, [1, 2])
    assert torch.equal(dst[1][1][5].view(torch.uint8), src[1][1][1].view(torch.uint8))
    copy_blocks(src, [3], dst, [7])
    assert torch.equal(dst[0][0][7].view(torch.uint8), src[0][0][3].view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_engine_holds_more_tokens_and_both_backends_agree(tiny_models, dtype):
    """Gemma 3 (sliding windows) with an fp8 cache: the same memory holds 2x (bf16) or 4x (fp32) the blocks;
    prompts prefilled in chunks after a cached prefix decode the same greedy tokens under either backend."""
    prefix = list(range(5, 45))
    prompts = [prefix + [50 + i, 60 + 2 * i, 70 + 3 * i] * (i + 2) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = dict(dtype=dtype, max_num_batched_tokens=16, kv_cache_memory=8 * 2**20)
    auto = LLM(str(tiny_models["gemma3"]), **base)
    outputs = {}
    for backend in ("torch", "auto"):
        llm = LLM(str(tiny_models["gemma3"]), kv_cache_dtype="fp8", attention_backend=backend, **base)
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        assert llm.engine.kv.num_blocks == auto.engine.kv.num_blocks * {"float32": 4, "bfloat16": 2}[dtype]
        assert (llm.engine.runner.decode_kernel is not None) == (backend == "auto")
        llm.generate(prompts[:1], params)  # the prefix is cached for the others
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_idle(llm)
    assert outputs["auto"] == outputs["torch"]


def test_a_float32_engine_on_a_bf16_cache_holds_twice_the_tokens_and_both_backends_agree(tiny_models):
    """Gemma 3 (sliding windows) in float32 with --kv-cache-dtype bfloat16: twice the blocks in the same memory;
    chunked prefills after a cached prefix decode the same greedy tokens under either attention backend."""
    prefix = list(range(5, 45))
    prompts = [prefix + [50 + i, 60 + 2 * i, 70 + 3 * i] * (i + 2) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = dict(dtype="float32", max_num_batched_tokens=16, kv_cache_memory=8 * 2**20)
    fp32 = LLM(str(tiny_models["gemma3"]), **base)
    assert fp32.engine.runner.kv_caches[0][0].dtype == torch.float32  # an asked-for float32 keeps its cache
    outputs = {}
    for backend in ("torch", "auto"):
        llm = LLM(str(tiny_models["gemma3"]), kv_cache_dtype="bfloat16", attention_backend=backend, **base)
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16 and llm.engine.dtype == torch.float32
        assert llm.engine.kv.num_blocks == 2 * fp32.engine.kv.num_blocks
        llm.generate(prompts[:1], params)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_idle(llm)
    assert outputs["auto"] == outputs["torch"]


def test_an_unknown_kv_cache_dtype_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bfloat16, fp8"):
        LLM(str(tiny_models["llama"]), kv_cache_dtype="int4")


def test_auto_keeps_the_model_dtype_except_bf16_under_an_auto_chosen_float32_on_cpu(tiny_models):
    """--kv-cache-dtype auto: a float32 that --dtype auto chose on a CPU (no native bf16) gets a bf16 cache;
    an asked-for float32 keeps its float32 reference, and a GPU or a bf16 model keeps the model's dtype."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert dtypes.resolve_kv_cache_dtype("auto", f32, auto_dtype=True, device_type="cpu") == bf16
    assert dtypes.resolve_kv_cache_dtype("auto", f32, auto_dtype=False, device_type="cpu") == f32
    assert dtypes.resolve_kv_cache_dtype("auto", f32, auto_dtype=True, device_type="cuda") == f32
    assert dtypes.resolve_kv_cache_dtype("auto", bf16, auto_dtype=True, device_type="cpu") == bf16
    assert dtypes.resolve_kv_cache_dtype("fp8", f32, auto_dtype=True) == torch.float8_e4m3fn
    small = dict(max_model_len=64, kv_cache_memory=4 * 2**20, num_threads=1)
    auto = LLM(str(tiny_models["llama"]), **small)  # float32 here without native bf16, bf16 with it
    assert auto.engine.runner.kv_caches[0][0].dtype == bf16 == auto.engine.kv_dtype
    asked = LLM(str(tiny_models["llama"]), dtype="float32", **small)
    assert asked.engine.runner.kv_caches[0][0].dtype == f32
