"""Sampling: seeds, top-k/top-p/min-p, penalties, n, stop conditions, SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.sampler import Sampler
from inferd.errors import InvalidRequestError
from inferd.request import Request
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set

PROMPTS = prompt_set(VOCAB, lengths=(5, 12, 30, 47))


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"]), max_model_len=256, num_blocks=128, dtype="float32")


def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], p)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.3, top_p=0.9, max_tokens=30, ignore_eos=True)
    batch = llm.generate(PROMPTS, [unseeded, p, unseeded, unseeded])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[1]], p)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone
    assert_idle(llm)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0, top_k=1), dict(temperature=0.8, top_p=1e-6), dict(temperature=2.0, min_p=1.0)],
    ids=["top_k=1", "tiny-top_p", "min_p=1"],
)
def test_degenerate_sampling_equals_greedy(llm, params):
    greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    sampled = _tokens(llm.generate(PROMPTS, SamplingParams(**params, max_tokens=20, ignore_eos=True)))
    assert sampled == greedy


def test_n_sequences_differ_and_are_seeded(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3
    assert seqs == [tuple(c.token_ids) for c in llm.generate([PROMPTS[0]], p)[0].outputs]
    assert_idle(llm)


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    toks = greedy.outputs[0].token_ids
    stop_at = toks[6]
    first = toks.index(stop_at)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    c = out.outputs[0]
    assert c.token_ids == toks[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    # min_tokens masks the stop token until enough tokens exist
    p = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2)
    c = llm.generate([PROMPTS[2]], p)[0].outputs[0]
    assert len(c.token_ids) >= first + 2
    assert stop_at not in c.token_ids[: first + 2]


def test_stop_strings_cut_text(llm):
    base = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = base.text
    stop = text[8:11]
    assert stop and stop in text
    c = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert c.text == text[: text.index(stop)] and c.finish_reason == "stop" and c.stop_reason == stop
    p = SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate([PROMPTS[3]], p)[0].outputs[0].text == text[: text.index(stop) + len(stop)]
    assert_idle(llm)


def _req(output, prompt=(3, 4), **params) -> Request:
    r = Request("r", "r", 0, list(prompt), SamplingParams(**params), frozenset({1}))
    r.output_token_ids = list(output)
    return r


def test_penalties_follow_the_openai_and_vllm_formulas():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5, 3.0]])
    reqs = [_req([2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)]
    got = sampler._apply_penalties(logits.clone(), reqs)
    expected = logits.clone()
    expected[0, 2] -= 0.5 + 2 * 0.25
    expected[0, 3] -= 0.5 + 0.25
    assert torch.allclose(got, expected)
    rep = sampler._apply_penalties(logits.clone(), [_req([4], prompt=(1,), repetition_penalty=2.0)])
    assert rep[0, 4] == 1.5 and rep[0, 1] == -2.0 and rep[0, 0] == 2.0


def test_repetition_penalty_changes_greedy_output(llm):
    plain = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    pen = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=5.0)
    )[0]
    toks = pen.outputs[0].token_ids
    assert toks != plain.outputs[0].token_ids
    assert len(set(toks)) >= len(set(plain.outputs[0].token_ids))


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=21), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_out_of_range_sampling_values_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
