"""Speculative decoding (n-gram prompt lookup): the proposer on plain lists, and the engine giving exactly the
tokens greedy decoding gives without it, with drafts proposed and accepted along the way, in mixed batches,
under stop strings, max_tokens and preemption, with no block left behind."""

from __future__ import annotations

import pytest

from inferd import LLM, SamplingParams
from inferd.config import make_engine_config
from inferd.engine.spec_decode import DraftPlanner, SpecStats, StepCost, ngram_propose
from inferd.errors import ConfigError
from tests.conftest import VOCAB, assert_idle
from tests.engine.echo_model import echo_model
from tests.engine.hf_reference import prompt_set


def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # suffix (6, 7) occurs at 1 and 6: the latest (6) wins, so the draft is what followed it
    assert ngram_propose(tokens, k=3, n_min=2, n_max=4) == [3, 4, 6]
    # a longer suffix is tried first: (1, 6, 7) occurs at 0 (followed by 3, 2); (6, 7) last at 5 (by 4, 1)
    assert ngram_propose([1, 6, 7, 3, 2, 6, 7, 4, 1, 6, 7], k=2, n_min=2, n_max=3) == [3, 2]
    assert ngram_propose([1, 6, 7, 3, 2, 6, 7, 4, 1, 6, 7], k=2, n_min=2, n_max=2) == [4, 1]
    assert ngram_propose(tokens, k=1, n_min=2, n_max=2) == [3]
    assert ngram_propose([1, 2, 3, 4], k=3, n_min=2, n_max=4) == []  # no earlier occurrence
    assert ngram_propose([7, 7], k=3, n_min=2, n_max=4) == []  # too short to hold a match before the suffix
    # a match close to the end continues its repetition: a run, and a cycle of three
    assert ngram_propose([7, 7, 7], k=3, n_min=1, n_max=4) == [7, 7, 7]
    assert ngram_propose([4, 1, 2, 3, 1, 2, 3, 1, 2], k=5, n_min=2, n_max=4) == [3, 1, 2, 3, 1]


def test_the_speculative_config_is_read_as_vllm_spells_it_and_checked():
    spec = make_engine_config(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 5, "disable_by_batch_size": 8}'
    ).speculative
    assert (spec.speculative_method, spec.num_speculative_tokens, spec.prompt_lookup_min) == ("ngram", 3, 1)
    assert (spec.prompt_lookup_max, spec.speculative_disable_by_batch_size) == (5, 8)
    for bad, match in [
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"method": "eagle"}, "speculative_method must be one of ngram"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1"),
        ({"draft_model": "x"}, "unknown speculative config keys"),
        ("{method: ngram}", "not JSON"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_engine_config(speculative_config=bad).validate()


def test_step_cost_interpolates_and_extends_what_it_measured():
    cost = StepCost()
    assert cost(4) is None
    cost.observe(1, 0.010)
    assert cost(1) == cost(9) == 0.010  # one size seen: others look as cheap until tried
    cost.observe(9, 0.014)
    assert cost(5) == pytest.approx(0.012) and cost(17) == pytest.approx(0.018)  # the last slope, extended
    cost.observe(9, 0.024)  # a moving average, not the last step
    assert cost(9) == pytest.approx(0.014 + 0.2 * 0.010)


def _planner(costs: dict[int, float], kept: int = 95, drafts: int = 100) -> DraftPlanner:
    """A planner that measured steps of these row counts, with `kept` of the engine's last drafts accepted."""
    planner = DraftPlanner(SpecStats(num_drafts=drafts - kept, num_accepted_tokens=kept))
    for rows, seconds in costs.items():
        planner.observe_step(rows, seconds)
    return planner


def test_the_planner_keeps_drafts_while_they_pay_and_best_first():
    proposed = {"a": [1, 2, 3, 4, 5, 6, 7, 8], "b": [1, 2, 3, 4, 5, 6, 7, 8]}
    # bound by weight bytes (a step of 17 rows costs what one of 2 does): every draft goes in
    assert _planner({2: 0.020, 18: 0.021}).plan(proposed, 2) == proposed
    # bound by compute (each row costs what a request's step does): no draft pays for its row
    assert _planner({2: 0.020, 18: 0.180}).plan(proposed, 2) == {}
    # in between, a request that keeps its drafts gets more of them than one whose drafts fail
    planner = _planner({2: 0.020, 18: 0.060})
    for _ in range(5):
        planner.observe_drafts("a", 4, 4)
        planner.observe_drafts("b", 4, 0)
    assert planner.acceptance("a") > 0.95 and planner.acceptance("b") < 0.4
    assert planner.plan(proposed, 2) == {"a": proposed["a"]}
    # a middling rate alone: the first drafts pay, the third would not (0.6, 0.36, then 0.21 of a token)
    assert _planner({1: 0.010, 9: 0.030}, kept=60).plan({"c": [1, 2, 3, 4, 5, 6, 7, 8]}, 1) == {"c": [1, 2]}
    planner.forget(["a"])
    assert planner.acceptance("b") == planner.acceptance("new")  # its record went with it
    assert _planner({}).plan(proposed, 2) == proposed  # nothing measured yet: every draft, to learn


def test_the_cost_policy_is_exact_and_drafts_at_batch_one(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.0))
    kw = dict(max_model_len=256, num_blocks=128, dtype="float32")
    plain, spec = LLM(folder, **kw), LLM(folder, speculative_method="ngram", num_speculative_tokens=8, **kw)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for one in _repetitive_prompts():
        assert _tokens(spec.generate([one], params)) == _tokens(plain.generate([one], params))
    stats = spec.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert spec.engine.proposer.planner.cost(1) is not None  # it measured the steps it planned with
    assert_idle(spec)


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat a phrase, so the lookup finds drafts from the first step on."""
    return [(p * 4)[:60] for p in prompt_set(VOCAB, lengths=(7, 11, 13))]


@pytest.fixture(scope="module", params=[0.0, 0.3], ids=["echo", "mostly-rejected"])
def pair(request, tiny_models, tmp_path_factory):
    folder = echo_model(tiny_models["llama"], tmp_path_factory.mktemp("echo") / "llama", request.param)
    kw = dict(max_model_len=256, num_blocks=128, dtype="float32")
    plain = LLM(str(folder), **kw)
    # every draft verified (vLLM's way): what these tests check does not hang on the cost model's timings
    spec = LLM(str(folder), speculative_method="ngram", num_speculative_tokens=4, speculative_draft_policy="all", **kw)
    return plain, spec, request.param


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_are_those_of_plain_decoding(pair):
    plain, spec, residual_scale = pair
    prompts = _repetitive_prompts() + prompt_set(VOCAB, lengths=(5, 30))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stats0 = spec.engine.stats()
    for one in prompts:  # one at a time: the batch stays under the size that turns drafts off
        assert _tokens(spec.generate([one], params)) == _tokens(plain.generate([one], params))
    stats = spec.engine.stats()
    drafted = stats.spec_num_draft_tokens - stats0.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
    if residual_scale == 0:  # a run of one token: every draft holds, a step gives 5 tokens
        assert drafted > 0 and accepted == drafted
        old = stats0.spec_accepted_per_pos + (0,) * (4 - len(stats0.spec_accepted_per_pos))
        per_pos = [a - b for a, b in zip(stats.spec_accepted_per_pos, old, strict=True)]
        assert len(per_pos) == 4 and per_pos[0] >= per_pos[3] > 0 and sum(per_pos) == accepted
    else:  # drafts the model disagrees with are dropped, and the output is still exact
        assert drafted > accepted
    assert_idle(spec)


def test_max_tokens_stop_strings_and_eos_end_where_plain_decoding_ends(pair):
    plain, spec, _ = pair
    prompts = _repetitive_prompts()
    for params in (
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=33),
    ):
        for one in prompts:
            a, b = spec.generate([one], params)[0].outputs[0], plain.generate([one], params)[0].outputs[0]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    # a stop string found inside a step's accepted drafts: the tokens after it are not output
    text = plain.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = text.outputs[0].text[12:15]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    a, b = spec.generate([prompts[0]], params)[0].outputs[0], plain.generate([prompts[0]], params)[0].outputs[0]
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, "stop", stop)
    assert_idle(spec)


def test_a_mixed_batch_keeps_every_request_exact(pair):
    """Drafting greedy rows beside penalised and logprob ones (which take no drafts) in the same steps, and a
    seeded sampled one (which drafts, and still draws plain decoding's tokens: its noise is per position)."""
    plain, spec, residual_scale = pair
    prompts = _repetitive_prompts() + prompt_set(VOCAB, lengths=(9,))
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, presence_penalty=0.5, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
    ]
    before = spec.engine.stats().spec_num_draft_tokens
    got, want = _tokens(spec.generate(prompts, params)), _tokens(plain.generate(prompts, params))
    assert got == want and len(got[3]) == 30
    assert spec.engine.stats().spec_num_draft_tokens > before or residual_scale > 0
    assert_idle(spec)


def test_seeded_sampled_tokens_are_those_of_plain_decoding(pair):
    """A seeded request's noise is drawn per output position, and a draft is kept where it equals the token
    drawn there: drafts change how many tokens a step yields, never which."""
    plain, spec, residual_scale = pair
    prompts = _repetitive_prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    before = spec.engine.stats()
    got = _tokens(spec.generate(prompts, params))
    assert got == _tokens(plain.generate(prompts, params))
    assert spec.engine.stats().spec_num_accepted_tokens > before.spec_num_accepted_tokens or residual_scale > 0
    assert_idle(spec)


def test_no_drafts_once_the_batch_is_larger_than_the_limit(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.0))
    kw = dict(max_model_len=256, num_blocks=128, dtype="float32", speculative_method="ngram")
    spec = LLM(folder, speculative_disable_by_batch_size=2, **kw)
    prompts = _repetitive_prompts() * 2  # six requests of equal length, running together to the end
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert spec.engine.stats().spec_num_drafts == 0
    spec.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert spec.engine.stats().spec_num_drafts > 0
    assert_idle(spec)


def test_preempted_drafting_requests_resume_exactly(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.0))
    kw = dict(max_model_len=128, num_blocks=14, block_size=16, dtype="float32", max_num_seqs=4)
    spec = LLM(folder, speculative_method="ngram", speculative_disable_by_batch_size=4, **kw)
    plain = LLM(folder, **kw)
    prompts = _repetitive_prompts() + [prompt_set(VOCAB, lengths=(40,))[0]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert _tokens(spec.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.stats().spec_num_accepted_tokens > 0
    assert_idle(spec)


# -- sampled requests: rejection sampling ------------------------------------------------------------
def _chi_square(counts: dict[int, int], probs: list[float], n: int) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` over the tokens expected at least 5 times (the rest pooled),
    and its degrees of freedom."""
    big = [t for t, p in enumerate(probs) if p * n >= 5]
    rest_p = 1 - sum(probs[t] for t in big)
    stat = sum((counts.get(t, 0) - probs[t] * n) ** 2 / (probs[t] * n) for t in big)
    if rest_p * n >= 5:
        rest = n - sum(counts.get(t, 0) for t in big)
        stat += (rest - rest_p * n) ** 2 / (rest_p * n)
        return stat, len(big)
    return stat, len(big) - 1


# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails 1 run in 1,000, and
# the seeds are fixed, so a pass is reproducible
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8, min_p=0.05)],
    ids=["t1", "topk", "topp-minp"],
)
def test_rejection_sampling_keeps_each_tokens_distribution(params):
    """Drafts [2, 4] against known logits, 20,000 times: the first token (the kept draft, or the draw after
    its rejection) follows the first position's sampling distribution, and the second token, given the first
    draft was kept, the second position's."""
    import torch

    from inferd.engine.sampler import Sampler

    class State:
        def __init__(self, p):
            self.params, self.generator = p, None

    logits = torch.tensor([[2.0, 1.0, 1.5, 0.2, 0.8, -1.0, 0.5], [0.1, 1.2, 0.3, 2.0, 1.9, 0.0, -0.5],
                           [1.0, 0.0, 0.5, 0.3, 0.2, 0.1, 0.9]])  # fmt: skip
    state = State(SamplingParams(**params))
    sampler = Sampler(torch.device("cpu"), seed=1234)
    expected = Sampler._probs(logits, [state] * 3)
    expected = (expected / expected.sum(dim=-1, keepdim=True)).tolist()
    n = 20_000
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    for _ in range(n):
        kept, token = sampler.verify_drafts(logits, state, [2, 4])
        out = [*kept, token]
        first[out[0]] = first.get(out[0], 0) + 1
        if kept[:1] == [2]:
            second[out[1]] = second.get(out[1], 0) + 1
    assert set(first) <= {t for t, p in enumerate(expected[0]) if p > 0}  # top-k / top-p / min-p hold
    stat, df = _chi_square(first, expected[0], n)
    assert stat < CHI2_999[df], (stat, df, first)
    stat, df = _chi_square(second, expected[1], sum(second.values()))
    assert stat < CHI2_999[df], (stat, df, second)


def test_sampled_requests_take_drafts_and_seeds_reproduce(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.0))
    kw = dict(max_model_len=256, num_blocks=128, dtype="float32")
    spec = LLM(folder, speculative_method="ngram", speculative_disable_by_batch_size=64, **kw)
    prompts = _repetitive_prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    before = spec.engine.stats()
    a = _tokens(spec.generate(prompts, params))
    after = spec.engine.stats()
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    assert all(len(t) == 30 for t in a)
    assert _tokens(spec.generate(prompts, params)) == a  # a seeded request's tokens do not depend on the run
    assert_idle(spec)
