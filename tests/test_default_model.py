"""The real default model (Gemma 3 270M from the PyPI GGUF). Slow: converts the GGUF once, then loads it."""

from __future__ import annotations

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.scheduler import SchedulerOutput
from inferd.request import Request
from tests.conftest import assert_idle

pytestmark = pytest.mark.slow

PROMPT = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, kv_cache_memory=256 * 1024**2)


def test_default_model_knows_paris(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
    assert_idle(llm)


def _engine_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill step of our model."""
    engine = llm.engine
    req = Request("logits", "logits", 0, token_ids, SamplingParams(), engine.eos_token_ids)
    assert engine.kv.allocate_slots(req, len(token_ids))
    try:
        step = engine.runner.prepare(SchedulerOutput({req.request_id: len(token_ids)}, [req]))
        with torch.inference_mode():
            hidden = engine.model(step.input_ids, step.positions, engine.runner.kv_caches, step.meta)
            return engine.model.compute_logits(hidden).float()
    finally:
        engine.kv.free(req)


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
