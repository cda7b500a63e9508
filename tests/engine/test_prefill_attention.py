"""The native prefill attention kernel (AMX-BF16 or AVX512_BF16) against the PyTorch reference on the same bf16
values.

Where the CPU has AMX-BF16 or AVX512_BF16 the kernel must be there and agree with SDPA computed in fp32 on the
same rounded values; elsewhere it must be absent (the runner keeps SDPA) and refuse to run with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.models import cpu_kernels, dtypes
from inferd.models.attention import AttentionMetadata, PrefillChunk, paged_attention
from tests.conftest import assert_idle, cpu_feature

HAS_AMX_BF16 = {"amx_bf16", "amx_tile"} <= dtypes.cpu_flags()
HAS_AVX512_BF16 = {"avx512_bf16", "avx512bw", "avx512vl"} <= dtypes.cpu_flags()
HAS_PREFILL = HAS_AMX_BF16 or HAS_AVX512_BF16  # the CPUs the kernel runs on


def _case(seed, heads, kv_heads, head_dim, block_size, chunks):
    """A flat batch of prefill chunks [(num_tokens, context_len)], each request's context already in the cache."""
    g = torch.Generator().manual_seed(seed)
    per_request = [-(-(n + ctx) // block_size) for n, ctx in chunks]
    num_blocks = sum(per_request) + 5
    order = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    prefills, slots, start, used = [], [], 0, 0
    for (n, ctx), blocks in zip(chunks, per_request, strict=True):
        table = order[used : used + blocks]
        used += blocks
        prefills.append(PrefillChunk(start, n, ctx, table))
        slots += [int(table[p // block_size]) * block_size + p % block_size for p in range(ctx, ctx + n)]
        start += n
    total = start
    q = torch.randn(total, heads, head_dim, generator=g)
    k = torch.randn(total, kv_heads, head_dim, generator=g)
    v = torch.randn(total, kv_heads, head_dim, generator=g)
    return [t.to(torch.bfloat16) for t in (q, k, v, k_cache, v_cache)], prefills, torch.tensor(slots)


def _run(kernel, tensors, prefills, slots, window, softcap, dtype):
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in tensors)
    meta = AttentionMetadata(slots, k_cache.shape[1], prefills=prefills, prefill_kernel=kernel)
    return paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, window, softcap)


def test_the_kernel_is_there_exactly_where_the_cpu_has_amx_bf16_or_avx512_bf16():
    assert (cpu_kernels.prefill_attention_kernel() is not None) == HAS_PREFILL
    want = "amx-bf16" if HAS_AMX_BF16 else "avx512-bf16" if HAS_AVX512_BF16 else "none"
    assert cpu_kernels.prefill_attention_isa() == want


CHUNKS = [(70, 0), (17, 37), (33, 0), (16, 100), (2, 5)]  # (new tokens, tokens computed before)


needs_prefill = cpu_feature(not HAS_PREFILL, "the prefill kernel needs AMX-BF16 or AVX512_BF16, which this CPU lacks")

CASES = [
    pytest.param(heads, kv_heads, head_dim, block_size, window, softcap)
    for heads, kv_heads, head_dim in [(4, 1, 256), (4, 2, 64), (2, 2, 32)]
    for block_size in (4, 16)
    for window in (None, 5, 40)
    for softcap in (None, 20.0)
]
ARGS = "heads,kv_heads,head_dim,block_size,window,softcap"
#: bf16 keeps 8 significant bits: the attention output of one bf16 path, as a whole, within one unit of its last
#: place (2**-8) of the fp32 reference, each value within 2e-2 + 1e-2 of its size
BF16_REL_NORM = 2**-8


def _error(got, ref) -> float:
    return float((got.float() - ref).norm() / ref.norm())


@needs_prefill
@pytest.mark.parametrize(ARGS, CASES)
def test_kernel_matches_the_fp32_reference_on_the_same_values(heads, kv_heads, head_dim, block_size, window, softcap):
    tensors, prefills, slots = _case(heads + head_dim + block_size, heads, kv_heads, head_dim, block_size, CHUNKS)
    ref = _run(None, tensors, prefills, slots, window, softcap, torch.float32)
    got = _run(cpu_kernels.prefill_attention_kernel(), tensors, prefills, slots, window, softcap, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # the exps are rounded to bf16 before the values are summed (as torch's bf16 flash attention does)
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=1e-2)
    bf16_sdpa = _run(None, tensors, prefills, slots, window, softcap, torch.bfloat16)
    assert _error(got, ref) <= 2 * _error(bf16_sdpa, ref) + 1e-5
    assert _error(got, ref) <= BF16_REL_NORM


@pytest.mark.parametrize(ARGS, CASES)
def test_bf16_sdpa_matches_the_fp32_reference(heads, kv_heads, head_dim, block_size, window, softcap):
    """The path every CPU without AMX-BF16 prefills with (and the reference the kernel is held to)."""
    tensors, prefills, slots = _case(heads + head_dim + block_size, heads, kv_heads, head_dim, block_size, CHUNKS)
    ref = _run(None, tensors, prefills, slots, window, softcap, torch.float32)
    got = _run(None, tensors, prefills, slots, window, softcap, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=1e-2)
    assert _error(got, ref) <= BF16_REL_NORM


@cpu_feature(HAS_PREFILL, "this CPU has AMX-BF16 or AVX512_BF16: the kernel runs there (checked below)")
def test_kernel_refuses_to_run_without_amx_bf16_or_avx512_bf16():
    """The module builds on every CPU, and where there is neither it refuses to run at all."""
    kernel = cpu_kernels._prefill_attention_module().prefill_attention
    q = torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    cache = torch.zeros(4, 4, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs AMX-BF16 .* or AVX512_BF16"):
        kernel(q, cache, cache, torch.zeros(2, dtype=torch.long), 0, 1.0, 0, 0.0, q.clone())


@needs_prefill
def test_kernel_rejects_what_it_cannot_run():
    kernel = cpu_kernels._prefill_attention_module().prefill_attention
    q = torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    cache = torch.zeros(4, 4, 1, 32, dtype=torch.bfloat16)
    table = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="table is too short"):
        kernel(q, cache, cache, table, 6, 1.0, 0, 0.0, q.clone())
    with pytest.raises(RuntimeError, match="q and out bfloat16"):
        kernel(q.float(), cache, cache, table, 0, 1.0, 0, 0.0, q.clone())
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        kernel(q[..., :24].contiguous(), cache[..., :24].contiguous(), cache[..., :24].contiguous(), table, 0, 1.0, 0,
               0.0, q[..., :24].contiguous())  # fmt: skip


def test_bf16_engine_with_chunks_and_cached_prefixes_agrees_with_sdpa(tiny_models):
    """Gemma 3 (sliding-window layers) in bf16, prompts prefilled in chunks of 16 after a shared prefix cached:
    every chunk after the first attends over earlier context. Greedy tokens agree with the SDPA backend."""
    prefix = list(range(5, 45))
    prompts = [prefix + [50 + i, 60 + 2 * i, 70 + 3 * i] * (i + 2) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "auto"):
        llm = LLM(
            str(tiny_models["gemma3"]),
            dtype="bfloat16",
            attention_backend=backend,
            max_num_batched_tokens=16,
            enable_prefix_caching=True,
        )
        assert (llm.engine.runner.prefill_kernel is not None) == (backend == "auto" and HAS_PREFILL)
        llm.generate(prompts[:1], params)  # the prefix is cached for the others
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_idle(llm)
    assert outputs["auto"] == outputs["torch"]
