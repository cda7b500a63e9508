"""Token-exact greedy agreement with transformers, for every architecture and under every scheduling mode."""

from __future__ import annotations

import pytest

from inferd import LLM, SamplingParams
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import hf_greedy, prompt_set

NEW_TOKENS = 32
PROMPTS = prompt_set(VOCAB)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)

# name -> engine settings. Each must still produce exactly the reference tokens.
MODES = {
    "default": dict(num_blocks=256),
    "chunked": dict(num_blocks=256, max_num_batched_tokens=16),
    "chunked-threshold": dict(num_blocks=256, long_prefill_token_threshold=7, max_num_batched_tokens=64),
    "preempting": dict(num_blocks=22, block_size=16),
    "small-blocks-preempting-chunked": dict(num_blocks=64, block_size=4, max_num_batched_tokens=24),
    "no-prefix-caching": dict(num_blocks=256, enable_prefix_caching=False),
}


def _llm(folder, **settings) -> LLM:
    return LLM(str(folder), max_model_len=256, dtype="float32", **settings)


@pytest.fixture(scope="module")
def references(tiny_models):
    return {arch: [hf_greedy(folder, tuple(p), NEW_TOKENS) for p in PROMPTS] for arch, folder in tiny_models.items()}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny_model, references, mode):
    arch = tiny_model.name
    llm = _llm(tiny_model, **MODES[mode])
    outs = llm.generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, references[arch], strict=True):
        assert out.outputs[0].token_ids == ref.token_ids, f"{arch}/{mode}: prompt of {len(out.prompt_token_ids)}"
        assert out.outputs[0].finish_reason == "length"
    if "preempting" in mode:
        assert llm.engine.scheduler.num_preemptions > 0, "this mode must actually preempt"
    assert_idle(llm)


def test_logprobs_match_transformers(tiny_model, references):
    llm = _llm(tiny_model, num_blocks=256)
    outs = llm.generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, references[tiny_model.name], strict=True):
        got = out.outputs[0].logprobs
        assert len(got) == NEW_TOKENS
        for step, (lp, ref_lp, ref_top) in enumerate(zip(got, ref.logprobs, ref.top_ids, strict=True)):
            assert abs(lp.logprob - ref_lp) < 1e-3, f"step {step}"
            assert lp.rank == 1
            assert [t for t, _ in lp.top][:3] == ref_top[:3]
            assert lp.top[0][0] == lp.token_id and abs(lp.top[0][1] - lp.logprob) < 1e-6


def test_batch_invariance(tiny_models):
    """Each prompt alone gives the same tokens as inside the batch."""
    llm = _llm(tiny_models["gemma3"], num_blocks=256)
    batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert batch == alone
    assert_idle(llm)
