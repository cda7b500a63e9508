"""Resuming a sequence from the tokens another replica already sent (`SamplingParams.resume_token_ids`).

The resumed request takes them as its first output tokens: greedy and seeded sampled requests then go on
exactly as the uninterrupted run did, drafts or not, and the outputs hold only the new tokens and text.
"""

from __future__ import annotations

import pytest

from inferd import LLM, SamplingParams
from inferd.errors import InvalidRequestError
from inferd.structured.spec import Constraint
from tests.conftest import VOCAB, assert_idle
from tests.engine.echo_model import echo_model
from tests.engine.hf_reference import prompt_set

PROMPTS = prompt_set(VOCAB, lengths=(5, 12, 30))
KW = dict(max_model_len=256, num_blocks=128, dtype="float32")


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"]), **KW)


def _resumed(params: SamplingParams, tokens: list[int], k: int) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "resume_token_ids": tokens[:k]})


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0),
        dict(temperature=1.0, seed=7),
        dict(temperature=0.8, top_p=0.9, top_k=50, seed=123, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=1.0, seed=3, repetition_penalty=1.3, min_tokens=20),
    ],
    ids=["greedy", "seeded", "seeded-penalties", "seeded-min-tokens"],
)
def test_a_resumed_request_continues_the_full_run_exactly(llm, params):
    k = 9
    full = SamplingParams(**params, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, full)
    for prompt, out, at in zip(PROMPTS, outs, (1, k, 31), strict=True):
        tokens = out.outputs[0].token_ids
        (rest,) = llm.generate([prompt], _resumed(full, tokens, at))
        assert rest.outputs[0].token_ids == tokens[at:]  # only the new ones, and max_tokens counted the resumed
        assert rest.outputs[0].finish_reason == "length"
        assert rest.metrics.num_generation_tokens == len(tokens) - at
    # the same in a batch beside other requests, all resumed at different places
    batch = llm.generate(PROMPTS, [_resumed(full, o.outputs[0].token_ids, k + i) for i, o in enumerate(outs)])
    assert [b.outputs[0].token_ids for b in batch] == [o.outputs[0].token_ids[k + i :] for i, o in enumerate(outs)]
    assert_idle(llm)


def test_resumed_text_is_what_was_not_sent_yet(llm):
    """The text of a resumed request is the full run's text after what the first part sent, stop strings and
    their hold-back included: the stop string is found across the boundary."""
    full = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], full)
    text, tokens = out.outputs[0].text, out.outputs[0].token_ids
    assert len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    with_stop = SamplingParams(**{**full.__dict__, "stop": [stop]})
    (stopped,) = llm.generate([PROMPTS[1]], with_stop)
    assert stopped.outputs[0].finish_reason == "stop"
    n = len(stopped.outputs[0].token_ids)
    for k in sorted({1, n // 2, n - 2, n - 1}):
        (rest,) = llm.generate([PROMPTS[1]], _resumed(with_stop, tokens, k))
        head = llm.engine.tokenizer.decode(tokens[:k])  # what the first part's text holds at most
        assert rest.outputs[0].finish_reason == "stop" and rest.outputs[0].stop_reason == stop
        assert rest.outputs[0].token_ids == stopped.outputs[0].token_ids[k:]
        assert stopped.outputs[0].text.endswith(rest.outputs[0].text)
        assert len(rest.outputs[0].text) >= len(stopped.outputs[0].text) - len(head)


def test_seeded_resume_with_drafts_is_exact(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.3))
    plain = LLM(folder, **KW)
    spec = LLM(folder, speculative_method="ngram", num_speculative_tokens=4, speculative_draft_policy="all", **KW)
    prompts = [(p * 4)[:60] for p in prompt_set(VOCAB, lengths=(7, 11))]
    full = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    outs = plain.generate(prompts, full)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        for k in (3, 17):
            (rest,) = spec.generate([prompt], _resumed(full, tokens, k))
            assert rest.outputs[0].token_ids == tokens[k:]
    assert_idle(spec)


def test_structured_resume_replays_the_grammar(llm):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured=Constraint("regex", "[a-c]{3,30}"))
    (out,) = llm.generate([PROMPTS[0]], params)
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 4
    (rest,) = llm.generate([PROMPTS[0]], _resumed(params, tokens, 2))
    assert rest.outputs[0].token_ids == tokens[2:]


def test_bad_resumes_are_refused(llm):
    bad = [
        (dict(resume_token_ids=[1, -1]), "non-negative"),
        (dict(resume_token_ids=[1, 2], n=2), "n=1"),
        (dict(resume_token_ids=[1, 2, 3], max_tokens=3), "nothing is left"),
    ]
    for fields, words in bad:
        with pytest.raises(InvalidRequestError, match=words) as e:
            SamplingParams(**fields)
        assert e.value.param == "resume"
    with pytest.raises(InvalidRequestError, match="resume token ids must be in") as e:
        llm.generate([PROMPTS[0]], SamplingParams(resume_token_ids=[VOCAB + 5], max_tokens=4))
    with pytest.raises(InvalidRequestError, match="fill the context"):
        llm.generate([PROMPTS[0]], SamplingParams(resume_token_ids=[1] * 251, max_tokens=None))
    # an a-c regex: a token outside it cannot have been sent
    grammar = Constraint("regex", "[a-c]{3,30}")
    outside = llm.engine.tokenizer.encode("zzz")
    with pytest.raises(InvalidRequestError, match="not allowed by the request's grammar"):
        llm.generate([PROMPTS[0]], SamplingParams(resume_token_ids=outside, structured=grammar, max_tokens=8))
    assert_idle(llm)


@pytest.mark.cpu_feature
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_int8_outputs_computed_again_are_bit_identical(tiny_models, family):
    """With int8 weights (and activations rounded to int8 per group of 32) a prefill's attention rounds
    differently from decoding's, and the rounding magnifies it. Output tokens computed again, a resumed
    stream's delivered tokens and a preempted request's outputs, are therefore computed as one-query rows, as
    decoding first computed them: the logprobs that follow are bit-identical to the uninterrupted run's.
    (Prefix caching is off: a cached prompt head would have its tail computed as a chunk of its own.)"""
    kw = dict(KW, quantization="int8", enable_prefix_caching=False, max_num_seqs=8)
    llm = LLM(str(tiny_models[family]), **kw)
    if llm.engine.runner.decode_kernel is None:
        pytest.skip("the native paged decode kernel did not build for this CPU: recomputed outputs go as a prefill")
    prompts = prompt_set(VOCAB, lengths=(9, 20, 33))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)

    def logprobs(out) -> list[float]:
        return [p.logprob for p in out.outputs[0].logprobs]

    alone = [llm.generate([p], params)[0] for p in prompts]
    for prompt, out in zip(prompts, alone, strict=True):
        tokens = out.outputs[0].token_ids
        for k in (3, 17):
            (rest,) = llm.generate([prompt], _resumed(params, tokens, k))
            assert rest.outputs[0].token_ids == tokens[k:]
            assert logprobs(rest) == logprobs(out)[k:]
    # a pool too small for all six: preempted requests recompute prompt and outputs, and go on bit-identically
    tight = LLM(str(tiny_models[family]), **dict(kw, num_blocks=22))
    six = prompts * 2
    outs = tight.generate(six, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [logprobs(o) for o in outs] == [logprobs(o) for o in alone * 2]
    assert_idle(llm)
    assert_idle(tight)
