"""The tiled LM head: full logits as one matmul gives them, and a fused greedy argmax equal to torch.argmax
over the full row, ties included (the first maximal index)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd import LLM, SamplingParams
from inferd.models.cpu_kernels import argmax_update_kernel
from inferd.models.lm_head import LMHead
from tests.conftest import assert_idle

# the argmax fold in torch ops and in the native kernel (norm_rope_cpu.cpp); both must equal torch.argmax
FOLDS = pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])


def _fold(head: LMHead, native: bool) -> LMHead:
    head.native_argmax = argmax_update_kernel() if native else None
    assert head.native_argmax is not None or not native, "the native kernels build on Linux"
    return head


def _head(vocab: int, hidden: int, tile: int, dtype=torch.float32) -> tuple[LMHead, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden).to(dtype)
    return LMHead(weight, tile), weight


@pytest.mark.parametrize("tile", [1, 7, 64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FOLDS
def test_logits_and_argmax_match_the_full_matmul(tile, dtype, native):
    head, weight = _head(100, 16, tile, dtype)
    _fold(head, native)
    x = torch.randn(9, 16).to(dtype)
    full = F.linear(x, weight)
    torch.testing.assert_close(head(x), full)
    assert torch.equal(head.argmax(x), full.argmax(dim=-1))
    assert len(head.tiles) == -(-100 // tile)


@pytest.mark.parametrize("tile", [3, 5, 8, 50])
@FOLDS
def test_ties_resolve_to_the_first_index_across_tiles(tile, native):
    vocab, hidden = 40, 8
    weight = torch.randn(vocab, hidden)
    # the same best row at 4, 9, 17 and 33 (different tiles for most tile sizes); x aligned with it
    best = torch.randn(hidden) * 5
    for row in (4, 9, 17, 33):
        weight[row] = best
    x = torch.stack([best, best * 2, -best])
    head = _fold(LMHead(weight, tile), native)
    full = F.linear(x, weight)
    expected = full.argmax(dim=-1)
    assert expected[0] == 4 and expected[1] == 4
    assert torch.equal(head.argmax(x), expected)
    # an all-equal row: index 0, as torch.argmax gives
    assert head.argmax(torch.zeros(1, hidden)).item() == F.linear(torch.zeros(1, hidden), weight).argmax().item() == 0


@FOLDS
def test_argmax_applies_the_transform_before_comparing(native):
    head, weight = _head(50, 8, 16)
    x = torch.randn(4, 8) * 30  # large logits: the softcap saturates them, ties become likely in bf16

    def cap(t):
        return torch.tanh(t / 2.0) * 2.0

    for dtype in (torch.float32, torch.bfloat16):
        h = _fold(LMHead(weight.to(dtype), 16), native)
        xd = x.to(dtype)
        assert torch.equal(h.argmax(xd, cap), cap(F.linear(xd, weight.to(dtype))).argmax(dim=-1))


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 words [rows, ceil(vocab / 32)] in xgrammar's layout from bool [rows, vocab]."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("tile", [7, 32, 96, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FOLDS
def test_argmax_under_a_bitmask_equals_masking_the_full_row(tile, dtype, native):
    vocab, hidden = 1000, 16  # not a multiple of 32: the last word is partial
    head, weight = _head(vocab, hidden, tile, dtype)
    _fold(head, native)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, hidden, generator=g) * 20).to(dtype)  # large logits: ties in bf16
    allowed = torch.rand(7, vocab, generator=g) < torch.tensor([0.02, 0.5, 0.97, 1.0, 0, 0, 0])[:, None]
    allowed[3, :] = True  # everything: whole words of ones
    allowed[4, 517] = True  # one token
    allowed[5, 960:] = True  # only the last tile's tail
    allowed[6, ::32] = True  # one token a word
    full = F.linear(x, weight).float().masked_fill(~allowed, float("-inf"))
    assert torch.equal(head.argmax(x, mask=_bitmask(allowed)), full.argmax(dim=-1))
    # a tie among allowed tokens goes to the first allowed one, in whichever tile it is
    best = weight[0].float() * 0 + 3
    tied = weight.clone()
    for row in (4, 9, 600, 900):
        tied[row] = best.to(dtype)
    head = _fold(LMHead(tied, tile), native)
    only = torch.zeros(2, vocab, dtype=torch.bool)
    only[0, [9, 600, 900]] = True
    only[1, [900, 600]] = True
    assert head.argmax(best.to(dtype).expand(2, hidden).contiguous(), mask=_bitmask(only)).tolist() == [9, 600]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_fold_over_many_chunks_finds_the_first_maximal_index(dtype):
    """The kernel maxes a row in chunks of 4,096 in parallel, then searches one chunk: rows long enough for
    several chunks and a partial last one, with ties inside a chunk and across chunks."""
    fold = argmax_update_kernel()
    assert fold is not None, "the native kernels build on Linux"
    n = 3 * 4096 + 17
    logits = torch.randn(5, n).to(dtype)
    logits[1, [5000, 4097, 12000]] = 9  # ties across two chunks: the first is 4097
    logits[2, [8191, 8192]] = 9  # at a chunk's last and the next chunk's first index
    logits[3, n - 1] = 9  # in the partial last chunk
    logits[4] = 0  # all equal: index 0
    best_val = torch.full((5,), float("-inf"))
    best_idx = torch.zeros(5, dtype=torch.long)
    fold(logits, best_val, best_idx, 100, torch.empty(0, dtype=torch.int32))
    assert torch.equal(best_idx, logits.argmax(dim=-1) + 100)
    assert best_idx[1:4].tolist() == [4197, 8291, n + 99]
    # an earlier tile's best that ties or beats this one stays
    kept_val, kept_idx = torch.full((5,), 9.0), torch.full((5,), 7, dtype=torch.long)
    fold(logits, kept_val, kept_idx, 100, torch.empty(0, dtype=torch.int32))
    assert kept_idx.tolist() == [7] * 5


def test_tiles_view_the_weight_without_copying():
    weight = torch.randn(30, 4)
    head = LMHead(weight, 8)
    assert all(t.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for t in head.tiles)


@pytest.mark.parametrize("vocab", [96, 101])  # whole tiles of 16 rows, and a last tile padded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_int8_tiles_give_the_tiles_logits_in_one_call(vocab, dtype):
    from inferd.models.cpu_kernels import int8_module
    from inferd.models.quant import join_int8_tiles, quantize_model

    head, _ = _head(vocab, 64, 32)
    quantize_model(head, "int8", torch.device("cpu"))
    _fold(head, True)
    assert int8_module() is not None and join_int8_tiles(head)
    kernel, packed, _ = head.joined
    assert all(  # the tiles view the joined buffer: nothing is held twice
        t.packed.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr() for t in head.tiles
    )
    joined = head.joined
    calls = []

    class Counted:  # the joined module, counting the fused argmax's calls
        int8_linear = staticmethod(joined[0].int8_linear)

        @staticmethod
        def int8_argmax(*args):
            calls.append(args[0].shape[0])
            return joined[0].int8_argmax(*args)

    for rows in (1, 4, 9, 33):  # logits: up to JOINED_MAX_ROWS in one call, then tile by tile; argmax: one call
        x = (torch.randn(rows, 64) * 3).to(dtype)
        head.joined = None
        tiled_logits, tiled_argmax = head(x), head.argmax(x)
        head.joined = (Counted, *joined[1:])
        assert torch.equal(head(x), tiled_logits) and torch.equal(head.argmax(x), tiled_argmax)
        assert torch.equal(tiled_argmax, tiled_logits.argmax(dim=-1))
        assert calls[-1] == rows  # the argmax folded in the kernel, with no logits
        capped = head.argmax(x, lambda t: t * 2)  # a transform: the logits are made after all
        assert calls[-1] == rows and len(calls) == [1, 4, 9, 33].index(rows) + 1
        assert torch.equal(capped, tiled_argmax)
    head.joined = joined
    head.tiles[0].bias = torch.nn.Parameter(torch.zeros(32), requires_grad=False)
    assert not join_int8_tiles(head) and head.joined is None  # the joined call takes no bias


def test_greedy_rows_skip_full_logits_and_agree_with_the_full_path(tiny_models, monkeypatch):
    """A batch mixing argmax-only requests with logprob and sampled requests: the argmax-only rows give the
    tokens the full-logits path gives (logprobs=1 forces that path)."""
    llm = LLM(str(tiny_models["llama"]), max_model_len=128, num_blocks=64, dtype="float32")
    prompts = ["The quick brown fox", "Paged attention stores", "def add(a, b):", "Question: What is"]
    fast = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    slow = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    calls = {"greedy": 0}
    real = llm.engine.model.greedy_tokens

    def counting(hidden, mask=None):
        calls["greedy"] += 1
        return real(hidden, mask)

    assert llm.engine.model.lm_head.native_argmax is argmax_update_kernel()  # the native fold, where it builds
    monkeypatch.setattr(llm.engine.model, "greedy_tokens", counting)
    mixed = llm.generate(prompts * 3, [fast] * 4 + [slow] * 4 + [sampled] * 4)
    assert calls["greedy"] > 0
    for a, b in zip(mixed[:4], mixed[4:8], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 12 for o in mixed[8:])
    assert_idle(llm)


def test_a_tied_head_stays_shared_with_the_embedding_in_bf16(tiny_models):
    llm = LLM(str(tiny_models["gemma3"]), max_model_len=64, num_blocks=16, dtype="bfloat16")
    model = llm.engine.model
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16
    assert model.lm_head.tiles[0].weight.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()


def test_a_bf16_head_on_onednn_gives_the_dense_logits(tiny_models):
    """On a CPU with native bf16 the loader puts the LM head's tiles on oneDNN's blocked layout (the tied
    dense view stays for the embedding); logits and the greedy argmax agree with the dense matmul."""
    from inferd.models.layers import bf16_onednn_available

    llm = LLM(str(tiny_models["gemma3"]), max_model_len=64, num_blocks=16, dtype="bfloat16")
    head = llm.engine.model.lm_head
    packed = [t._packed is not None for t in head.tiles]
    assert all(packed) if bf16_onednn_available() else not any(packed)
    embed = llm.engine.model.model.embed_tokens.weight
    x = torch.randn(5, embed.shape[1]).to(torch.bfloat16)
    dense = F.linear(x, embed)
    torch.testing.assert_close(head(x), dense, atol=0.05, rtol=0.02)
    assert torch.equal(head.argmax(x), head(x).argmax(dim=-1))


def test_the_bf16_body_goes_on_onednn_only_where_avx512_bf16_has_no_amx():
    from inferd.models.layers import bf16_body_on_onednn, bf16_onednn_available

    zen5 = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
    assert bf16_body_on_onednn(zen5) == bf16_onednn_available()
    assert not bf16_body_on_onednn(zen5 | {"amx_tile", "amx_bf16"})
    assert not bf16_body_on_onednn(frozenset({"avx2"}))


@pytest.mark.cpu_feature  # it skips itself where the CPU packs no bf16 body (AMX, or no AVX512_BF16)
def test_a_bf16_body_on_onednn_gives_the_dense_outputs(tiny_models):
    """Where the loader packs the body's linear layers too, each gives what its dense weights give (the
    checkpoint's values, read again in fp32 and rounded to bf16), one row and many."""
    from inferd.models.layers import FusedLinear, Linear, bf16_body_on_onednn

    if not bf16_body_on_onednn():
        pytest.skip("the body stays dense on this CPU (AMX, or no AVX512_BF16)")
    llm = LLM(str(tiny_models["gemma3"]), max_model_len=64, num_blocks=16, dtype="bfloat16")
    dense = LLM(str(tiny_models["gemma3"]), max_model_len=64, num_blocks=16, dtype="bfloat16", cpu_linear="dense")
    pairs = [
        (m, dense.engine.model.get_submodule(name))
        for name, m in llm.engine.model.named_modules()
        if isinstance(m, Linear | FusedLinear) and not name.startswith("lm_head")
    ]
    assert pairs and all(m._packed is not None and m.weight.numel() == 0 for m, _ in pairs)
    for packed, ref in pairs:
        for rows in (1, 7):
            x = torch.randn(rows, ref.in_features).to(torch.bfloat16)
            torch.testing.assert_close(packed(x), ref(x), atol=0.02, rtol=0.02)
