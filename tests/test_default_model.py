"""The real default model (Gemma 3 270M from the PyPI GGUF). Slow: converts the GGUF once, then loads it."""

from __future__ import annotations

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.step import NewRequest, ScheduledChunk, SchedulerOutput
from tests.conftest import assert_idle

pytestmark = pytest.mark.slow

PROMPT = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def llm():
    # the reference: the GGUF's values in fp32 (by default a quantized GGUF runs in int8 on CPU)
    return LLM(max_model_len=1024, kv_cache_memory=256 * 1024**2, dtype="float32", quantization="none")


def test_default_model_knows_paris(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
    assert_idle(llm)


def test_the_default_mode_serves_the_gguf_in_int8_and_still_knows_paris():
    from inferd.models.cpu_kernels import int8_module

    if int8_module() is None:
        pytest.skip("the native int8 kernel did not build here, so auto keeps the GGUF's values in the dtype")
    default = LLM(max_model_len=256, kv_cache_memory=64 * 1024**2)
    assert default.engine.quantization == "int8", default.engine.quant_choice
    assert "Q8_0" in default.engine.quant_choice.reason  # what the file stores, read from the GGUF
    # a few rows read the file's own blocks: every body layer but the 9 down projections the file keeps in Q6_K
    from inferd.models.cpu_kernels import gguf_module

    compact = gguf_module() is not None and gguf_module().compact_available()
    small = [m for m in default.engine.model.modules() if getattr(m, "small", None) is not None]
    assert len(small) == (18 * 4 - 9 if compact else 0)
    out = default.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
    assert_idle(default)


def test_gguf_serves_the_files_own_blocks_and_matches_the_reference_logits(llm):
    """--quantization gguf on the default model: every linear layer, the LM head's tiles included, on the file's
    blocks; a prompt's logits within the activations' rounding of the fp32 reference's, the same next token."""
    from inferd.models.cpu_kernels import gguf_module
    from inferd.models.gguf_blocks import GGUFLinear

    if gguf_module() is None:
        pytest.skip("the native GGUF kernel did not build here")
    blocks = LLM(max_model_len=256, kv_cache_memory=64 * 1024**2, dtype="float32", quantization="gguf")
    layers = [m for m in blocks.engine.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 18 * 4 + len(blocks.engine.model.lm_head.tiles)
    assert not [m for m in blocks.engine.model.modules() if type(m).__name__ == "Int8Linear"]
    ids = blocks.engine.tokenizer(PROMPT)["input_ids"]
    ours, ref = _engine_logits(blocks, ids)[-1], _engine_logits(llm, ids)[-1]
    assert ours.argmax() == ref.argmax()
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()  # a prefill of this length takes the block kernel
    out = blocks.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
    assert_idle(blocks)


def _engine_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill step of our model."""
    runner, bs = llm.engine.runner, llm.engine.kv.block_size
    blocks = list(range(-(-len(token_ids) // bs)))  # the engine is idle: any blocks will do
    sched = SchedulerOutput(
        chunks=[ScheduledChunk("logits", token_ids, 0, is_prefill=True, samples=True, new_block_ids=blocks)],
        new_requests=[NewRequest("logits", token_ids, SamplingParams(), frozenset())],
    )
    runner.update_states(sched)
    try:
        step = runner.prepare(sched)
        with torch.inference_mode():
            hidden = llm.engine.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
            return llm.engine.model.compute_logits(hidden).float()
    finally:
        runner.update_states(SchedulerOutput(finished_ids=["logits"]))


def test_logits_match_transformers_reading_the_same_gguf(llm):
    from transformers import AutoModelForCausalLM

    from inferd.models.loader import default_gguf_path

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _engine_logits(llm, ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3
    assert_idle(llm)


def test_a_lora_adapter_on_the_default_model_matches_transformers_and_peft(tmp_path):
    """A small random adapter (rank 4 on q/v and down) made with peft on the converted default model: inferd's
    greedy tokens under it are transformers + peft's, in fp32, and the adapter changes them. int8 (the default
    mode) takes it too."""
    from inferd.config import DEFAULT_MODEL
    from inferd.models.loader import resolve_model
    from tests.engine.lora_adapters import make_adapter, peft_greedy

    folder = resolve_model(DEFAULT_MODEL)
    adapter = make_adapter(folder, tmp_path / "a", ("q_proj", "v_proj", "down_proj"), r=4, alpha=4, seed=7)
    lora = LLM(max_model_len=256, kv_cache_memory=64 * 1024**2, dtype="float32", quantization="none",
               lora_modules=[f"a={adapter}"])  # fmt: skip
    prompt = lora.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8)
    (out,) = lora.generate([prompt], params, lora_name="a")
    (base,) = lora.generate([prompt], params)
    assert out.outputs[0].token_ids == peft_greedy(folder, adapter, prompt, 8)
    assert out.outputs[0].token_ids != base.outputs[0].token_ids
    assert_idle(lora)
    del lora
    int8 = LLM(max_model_len=256, kv_cache_memory=64 * 1024**2, lora_modules=[f"a={adapter}"])
    (got,) = int8.generate([prompt], params, lora_name="a")
    (plain,) = int8.generate([prompt], params)
    assert int8.engine.quantization == "int8" and got.outputs[0].token_ids != plain.outputs[0].token_ids
    assert_idle(int8)
