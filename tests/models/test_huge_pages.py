"""Quantized weights moved into huge-page mappings (`inferd.models.huge_pages`): the same values, each layer a
view of one mapping, and the same tokens from the model."""

from __future__ import annotations

import sys

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.models import huge_pages, loader
from inferd.models.quant import Int4Linear, Int8Linear


def test_pack_copies_every_tensor_into_one_aligned_mapping():
    tensors = [
        torch.randint(-128, 127, (37, 5), dtype=torch.int8),
        torch.randn(3, 7),
        torch.randn(11).to(torch.bfloat16),
        torch.empty(0, dtype=torch.uint8),
        torch.randint(0, 255, (1000,), dtype=torch.uint8),
    ]
    views = huge_pages.pack(tensors)
    storage = views[0].untyped_storage().data_ptr()
    for t, v in zip(tensors, views, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
        assert v.data_ptr() % huge_pages.ALIGN == 0
        assert v.untyped_storage().data_ptr() == storage  # one mapping under all of them
    if sys.platform.startswith("linux"):
        assert storage <= views[0].data_ptr() and views[0].data_ptr() % huge_pages.HUGE_PAGE == 0


def test_where_no_mapping_or_advice_is_allowed_ordinary_memory_serves(monkeypatch):
    import mmap

    class Refused:
        def __init__(self, *args, **kwargs):
            raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as m:
        m.setattr(mmap, "mmap", Refused)
        buf = huge_pages.empty_bytes(1000)
        assert buf.numel() == 1000 and buf.dtype == torch.uint8

    real = mmap.mmap

    class NoAdvice(real):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")  # a kernel without transparent huge pages

    monkeypatch.setattr(mmap, "mmap", NoAdvice)
    tensors = [torch.arange(300, dtype=torch.int32), torch.randn(7)]
    assert all(torch.equal(v, t) for v, t in zip(huge_pages.pack(tensors), tensors, strict=True))


def test_cat_is_torch_cat():
    parts = [torch.randint(0, 255, (n, 4, 64), dtype=torch.uint8) for n in (3, 1, 5)]
    joined = huge_pages.cat(parts)
    assert torch.equal(joined, torch.cat(parts))


@pytest.mark.skipif(
    huge_pages.thp_mode() not in ("always", "madvise"),
    reason=f"transparent huge pages are {huge_pages.thp_mode() or 'absent'} here: only madvise or always grants them",
)
def test_a_mapping_gets_huge_pages_where_the_kernel_grants_them():
    buf = huge_pages.empty_bytes(4 * huge_pages.HUGE_PAGE)
    buf.fill_(1)  # the pages exist once written
    assert huge_pages.in_huge_pages(buf)
    assert huge_pages.describe(buf) == "2 MiB pages"
    if huge_pages.thp_mode() == "madvise":  # malloc'd memory, not advised: 4 KiB pages (under always it may not be)
        plain = torch.ones(4 * huge_pages.HUGE_PAGE // 4)
        assert not huge_pages.in_huge_pages(plain) and huge_pages.describe(plain).startswith("4 KiB pages")


@pytest.mark.parametrize("quantization", ["int8", "int4"])  # gguf: test_gguf_blocks.py loads through the same path
def test_loaded_quantized_weights_are_views_of_one_mapping_with_the_same_values(tiny_models, quantization, monkeypatch):
    kw = dict(max_model_len=64, num_blocks=32, block_size=8, dtype="float32", quantization=quantization)
    llm = LLM(str(tiny_models["llama"]), **kw)
    with monkeypatch.context() as m:
        m.setattr(loader, "weights_to_huge_pages", lambda model: 0)
        kept = LLM(str(tiny_models["llama"]), **kw)  # the weights where quantization left them

    def weights(model) -> dict[str, torch.Tensor]:
        found = {}
        for name, m in model.named_modules():
            if isinstance(m, Int8Linear | Int4Linear):
                found[name] = m.packed if isinstance(m, Int8Linear) else m.qweight
        return found

    moved, before = weights(llm.engine.model), weights(kept.engine.model)
    assert moved.keys() == before.keys() and all(torch.equal(moved[k], before[k]) for k in moved)
    head_tiles = {name for name in moved if ".tiles." in name or name.startswith("lm_head")}
    body = [t for name, t in moved.items() if name not in head_tiles]
    assert body and len({t.untyped_storage().data_ptr() for t in body}) == 1
    assert all(t.untyped_storage().data_ptr() != before[k].untyped_storage().data_ptr() for k, t in moved.items())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The quick brown fox", "def add(a, b):"]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens == [o.outputs[0].token_ids for o in kept.generate(prompts, params)]


def test_doctor_says_which_pages_quantized_weights_get():
    from inferd import doctor

    line = doctor.report()["paths"]["quantized weights' pages"]
    mode = huge_pages.thp_mode()
    assert line.startswith("2 MiB pages" if mode in ("always", "madvise") else ("4 KiB" if mode else "ordinary"))
