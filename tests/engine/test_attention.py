"""Paged attention backends agree: the native CPU decode kernel against the PyTorch reference."""

from __future__ import annotations

import functools
import platform

import pytest
import torch

from inferd.cpu import cpu_flags
from inferd.models import cpu_kernels as ck
from inferd.models.attention import AttentionMetadata, DecodeGroup, paged_attention
from inferd.models.cpu_kernels import paged_decode_kernel, paged_decode_threads

needs_kernel = pytest.mark.skipif(platform.system() != "Linux", reason="the native kernel is built on Linux")


def _case(
    seed: int,
    heads: int,
    kv_heads: int,
    batch: int = 7,
    block_size: int = 4,
    head_dim: int = 32,
    longest: int = 40,
    first_len: int | None = None,
    lens: torch.Tensor | None = None,
):
    """`lens`: every request's length (batch of them, each below `longest`), else random; `first_len`: the first's."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(64, batch * -(-longest // block_size))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    seq_lens = torch.randint(1, longest, (batch,), generator=g)
    if lens is not None:
        seq_lens = lens.clone()
    if first_len is not None:
        seq_lens[0] = first_len
    width = int((seq_lens.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim, generator=g)
    k_new = torch.randn(batch, kv_heads, head_dim, generator=g)
    v_new = torch.randn(batch, kv_heads, head_dim, generator=g)
    last = seq_lens - 1
    slots = tables.gather(1, (last // block_size)[:, None]).squeeze(1) * block_size + last % block_size
    return q, k_new, v_new, k_cache, v_cache, tables, seq_lens, slots


def _run(kernel, case, window, softcap, scale=0.3):
    q, k_new, v_new, k_cache, v_cache, tables, seq_lens, slots = case
    group = DecodeGroup(0, q.shape[0], tables, seq_lens, k_cache.shape[1])
    meta = AttentionMetadata(slots, k_cache.shape[1], decode_groups=[group], decode_kernel=kernel)
    return paged_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), meta, scale, window, softcap)


@needs_kernel
def test_kernel_builds_on_this_machine():
    assert paged_decode_kernel() is not None, "the native decode kernel must build where CI runs"


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (6, 6)])
@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_kernel_matches_reference(heads, kv_heads, window, softcap):
    case = _case(heads * 10 + kv_heads, heads, kv_heads)
    ref = _run(None, case, window, softcap)
    got = _run(paged_decode_kernel(), case, window, softcap)
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_a_few_long_requests_split_their_tokens_over_threads(threads, dtype, window):
    """Fewer (request, kv head) pairs than threads: each pair's tokens are split into parts of at least 128
    (here up to 7 of them), softmaxed apart and merged; the answer is the one softmax over all tokens."""
    case = _case(3, 4, 1, batch=2, block_size=16, longest=1000, first_len=1000)  # and one of any length
    case = [t.to(dtype) if t.is_floating_point() else t for t in case]
    ref = _run(None, [t.float() if t.is_floating_point() else t for t in case], window, 20.0)
    got = _run(functools.partial(paged_decode_kernel(), threads=threads), case, window, 20.0)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert torch.allclose(got.float(), ref, **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_score_far_above_the_rest_is_found_at_every_length(dtype):
    """The softmax subtracts each head's largest score: lengths 1-40 put the newest token's (here ~380, the
    others near 0) in and past the kernel's runs of 16 scores, so a largest score missed anywhere would
    overflow exp into inf and NaN. The answer is then that token's values, for every head."""
    q, k_new, v_new, k_cache, v_cache, tables, seq_lens, slots = _case(5, 4, 1, batch=40, longest=41,
                                                                       lens=torch.arange(1, 41))  # fmt: skip
    direction = torch.nn.functional.normalize(q[:, :1], dim=-1)  # every head of a request asks the same
    q = direction.expand(-1, 4, -1) * 6.0
    k_new = direction * 200.0
    case = [t.to(dtype) if t.is_floating_point() else t for t in (q, k_new, v_new, k_cache, v_cache, tables,
                                                                  seq_lens, slots)]  # fmt: skip
    got = _run(paged_decode_kernel(), case, None, None).float().view(40, 4, -1)
    assert torch.isfinite(got).all()
    expected = case[2].float().expand(-1, 4, -1)  # v_new, as the kernel's dtype holds it
    assert torch.allclose(got, expected, atol=2e-2, rtol=1e-2)


@needs_kernel
def test_kernel_splits_work_over_torchs_threads():
    """Built without OpenMP, at::parallel_for's inline region is ignored and the kernel runs on one thread."""
    assert paged_decode_threads() == torch.get_num_threads()


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [32, 24])  # 32: the AVX512_BF16 dot-product path where the CPU has it
def test_bf16_kernel_matches_the_fp32_reference_on_the_same_values(window, head_dim):
    case = _case(7, 4, 2, head_dim=head_dim)
    rounded = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in case]
    ref = _run(None, [t.float() if t.is_floating_point() else t for t in rounded], window, 20.0)
    got = _run(paged_decode_kernel(), rounded, window, 20.0)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=1e-2)  # only the output's rounding to bf16 differs


def test_reference_decode_groups_trim_the_window():
    case = _case(0, 4, 1)
    tables, mask = DecodeGroup(0, 7, case[5], case[6], 4).view(8)
    assert tables.shape[1] <= 8 // 4 + 1  # only the blocks inside the window are gathered
    assert int(mask.sum(-1).max()) <= 8


@functools.cache
def _decode_build(isa: str):
    """The decode kernel as built here (`native`), or forced down to AVX2 (no AVX-512) on a CPU with more."""
    if isa == "native":
        return paged_decode_kernel()
    module = ck._build("inferd_test_paged_decode_avx2", ck._SOURCE, "paged decode kernel (avx2)", ["-mno-avx512f"])
    return None if module is None else module.paged_decode


@needs_kernel
@pytest.mark.parametrize(
    "isa", ["native", pytest.param("avx2", marks=[pytest.mark.slow, pytest.mark.cpu_feature])]
)  # avx2 on an AVX-512 CPU: the 8-lane loops (it skips itself on a CPU without AVX-512)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_in_registers_match_the_reference_at_a_head_dim_of_64(isa, dtype):
    """D = 64: the weighted sum of values runs in registers (16 lanes with AVX-512, 8 with AVX2), over runs of
    16 tokens and heads four at a time (6 heads: a group of 4 and one of 2)."""
    if isa == "avx2" and not {"avx2", "avx512f"} <= cpu_flags():
        pytest.skip("the forced AVX2 build is another path only on a CPU with AVX2 and AVX-512")
    kernel = _decode_build(isa)
    assert kernel is not None, f"the decode kernel must build for {isa}"
    case = _case(11, 6, 1, head_dim=64, block_size=16, longest=90)
    case = [t.to(dtype) if t.is_floating_point() else t for t in case]
    ref = _run(None, [t.float() if t.is_floating_point() else t for t in case], None, None)
    got = _run(kernel, case, None, None)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert torch.allclose(got.float(), ref, **tol)
