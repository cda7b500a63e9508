"""Model facts against the engine that holds the model: weight bytes as stored, KV bytes as allocated."""

from __future__ import annotations

import pytest

from inferd import LLM
from inferd.measure.model import kv_bytes_per_token, model_facts, weight_bytes
from tests.conftest import build_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("facts") / "llama")


def test_facts_match_the_engines_allocation_and_weights(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_blocks=16, attention_backend="torch", dtype="float32")
    engine = llm.engine
    facts = model_facts(engine.model, engine.dtype, engine.kv_dtype)
    cfg = engine.model.config
    # 3 layers of q, k, v, o, gate, up, down (hidden 64, intermediate 128, 2 of 4 heads for K/V) and the head
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 64 * 64 * 2 + 2 * 64 * (2 * head_dim) + 3 * 64 * 128
    assert facts.body_params == 3 * per_layer
    assert facts.weight_bytes == weight_bytes(engine.model) == (3 * per_layer + 384 * 64) * 4
    block = engine.kv.block_size
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    assert facts.kv_bytes_per_token == allocated / (16 * block)
    assert facts.kv_bytes_per_token == kv_bytes_per_token(3, 2, head_dim, 4)
    assert facts.kv_bytes_read(10) == 10 * facts.kv_bytes_per_token  # no sliding layers: every key is read
    sampled, unsampled = facts.flops_per_token(10), facts.flops_per_token(10, sampled=False)
    assert sampled - unsampled == 2 * 384 * 64
    assert facts.prefill_flops(2) == facts.flops_per_token(1, False) + facts.flops_per_token(2, False) + 2 * 384 * 64
    weights = (facts.body_params + facts.lm_head_params) * 2
    assert facts.roofline_step_s(1, 10, 1e30, 1e9, 2) == (weights + facts.kv_bytes_read(10) // 2) / 1e9  # fp32 KV
    assert facts.prefill_intensity(2) == facts.prefill_flops(2) / (facts.weight_bytes + 2 * facts.kv_bytes_per_token)


def test_quantized_weights_count_as_stored(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_blocks=16, attention_backend="torch", quantization="int8")
    facts = model_facts(llm.engine.model, llm.engine.dtype)
    # one byte a weight plus a float32 scale a row; the shapes (and so the FLOPs) are the float model's
    params = facts.body_params + facts.lm_head_params
    assert params < facts.weight_bytes < params * 1.2
