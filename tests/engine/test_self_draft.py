"""Self-drafting (`self_draft`): the model drafts with its own body and an LM head cut to its most frequent
tokens, into slots the scheduler allocates past each drafting request's chunk. The tokens are plain decoding's
(greedy and seeded), at the edges of max_tokens, the context and stop strings too, with no block left behind."""

from __future__ import annotations

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.config import SELF_DRAFT_MAX_RUNNING
from inferd.engine.draft_head import DraftHead, cut_head
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set

KW = dict(max_model_len=128, num_blocks=96, block_size=8, dtype="float32")


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _pair(folder, **spec):
    """Plain and self-drafting engines; drafting in batches of up to 4 (its default is SELF_DRAFT_MAX_RUNNING)."""
    plain = LLM(str(folder), **KW)
    spec = {"num_speculative_tokens": 3, "speculative_disable_by_batch_size": 4, **spec}
    return plain, LLM(str(folder), speculative_method="self_draft", **spec, **KW)


def test_the_cut_head_computes_the_models_own_logits_of_its_tokens(tiny_model):
    llm = LLM(str(tiny_model), **KW)
    model = llm.engine.model
    ids = torch.tensor([0, 5, 17, 200, VOCAB - 1])
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        full = model.lm_head(hidden)
        torch.testing.assert_close(cut_head(model, ids)(hidden), full[:, ids])
    head = DraftHead(model, size=4)
    head.observe([5, 5, 5, 9, 9, 7, 3, 3, 3, 3, 1])
    assert head.ready  # 11 tokens counted, a head of 4 rows: built on first use
    picked = head.argmax(hidden)
    assert head.ids.tolist() == [3, 5, 7, 9] and set(picked) <= {3, 5, 7, 9}
    with torch.no_grad():
        assert picked == [[3, 5, 7, 9][i] for i in full[:, [3, 5, 7, 9]].argmax(dim=-1).tolist()]


@pytest.mark.parametrize("vocab", [VOCAB, VOCAB // 3], ids=["whole-vocabulary", "a-third"])
def test_greedy_tokens_are_those_of_plain_decoding(tiny_model, vocab):
    plain, drafting = _pair(tiny_model, draft_vocab_size=vocab)
    prompts = prompt_set(VOCAB, lengths=(5, 9, 30, 47))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for one in prompts:  # one at a time, then together: drafts run at batch 1 and at the running limit
        assert _tokens(drafting.generate([one], params)) == _tokens(plain.generate([one], params))
    assert _tokens(drafting.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    stats = drafting.engine.stats()
    assert stats.spec_num_draft_tokens > 40
    if vocab == VOCAB:  # a draft is the model's own argmax: only float ties between the two passes differ
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    else:  # drafts outside the cut vocabulary are rejected, and the output is still exact
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_idle(drafting)


def test_seeded_sampled_and_mixed_requests_are_those_of_plain_decoding(tiny_models):
    plain, drafting = _pair(tiny_models["llama"], draft_vocab_size=VOCAB)
    prompts = prompt_set(VOCAB, lengths=(6, 11, 21, 33))
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, presence_penalty=0.5, max_tokens=30, ignore_eos=True),  # no drafts
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),  # no drafts
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    for _ in range(3):  # the head is built once it has counted as many tokens as the vocabulary holds
        drafting.generate(prompts, params)
    before = drafting.engine.stats().spec_num_accepted_tokens
    assert _tokens(drafting.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert drafting.engine.stats().spec_num_accepted_tokens > before
    assert_idle(drafting)


def test_max_tokens_the_context_and_stop_strings_end_where_plain_decoding_ends(tiny_models):
    plain, drafting = _pair(tiny_models["gemma3"], draft_vocab_size=VOCAB)
    long_prompt = prompt_set(VOCAB, lengths=(110,))[0]  # 18 tokens of context left: drafts run into the end
    prompts = prompt_set(VOCAB, lengths=(8, 19))
    for max_tokens in (1, 2, 7, 18, 33):
        for one in [*prompts, long_prompt]:
            params = SamplingParams(temperature=0, max_tokens=min(max_tokens, 128 - len(one)), ignore_eos=True)
            a, b = drafting.generate([one], params)[0].outputs[0], plain.generate([one], params)[0].outputs[0]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    text = plain.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = text.outputs[0].text[10:13]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    a, b = drafting.generate([prompts[0]], params)[0].outputs[0], plain.generate([prompts[0]], params)[0].outputs[0]
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, "stop")
    assert drafting.engine.stats().spec_num_accepted_tokens > 0
    assert_idle(drafting)


def test_by_default_drafts_only_alone_and_never_under_kv_pressure(tiny_models):
    """By default a step drafts only with SELF_DRAFT_MAX_RUNNING running request(s): one request alone drafts
    (up to its last token, in a pool too small for six), six together run to the end without drafts, and the
    tight pool preempts exactly as plain decoding's does."""
    folder = tiny_models["qwen3"]
    tight = dict(KW, num_blocks=24, max_num_seqs=8)
    drafting = LLM(str(folder), speculative_method="self_draft", draft_vocab_size=128, **tight)  # built at 128
    plain = LLM(str(folder), **tight)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = prompt_set(VOCAB, lengths=(12,) * 6)
    assert len(prompts) > SELF_DRAFT_MAX_RUNNING
    alone = [prompt_set(VOCAB, lengths=(40,))[0]] * 2  # the first counts tokens, the second drafts
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    for one in alone:
        assert _tokens(drafting.generate([one], long)) == _tokens(plain.generate([one], long))
    assert drafting.engine.stats().spec_num_accepted_tokens > 0
    before = drafting.engine.stats().spec_num_drafts
    assert _tokens(drafting.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert drafting.engine.stats().spec_num_drafts == before
    assert drafting.engine.scheduler.num_preemptions == plain.engine.scheduler.num_preemptions > 0
    assert_idle(drafting)
