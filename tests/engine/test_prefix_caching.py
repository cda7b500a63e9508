"""Prefix caching: the same tokens with it on and off, real hits, and no leaks under any interleaving."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd import LLM, SamplingParams
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _shared_prefix_prompts() -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, VOCAB, (45,), generator=g).tolist()  # 2 full blocks of 16 + a partial one
    suffixes = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 19, 33)]
    return prefix, [prefix + s for s in suffixes] + [prefix[:32], prefix[:40]]


def _run_waves(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """First prompt alone (fills the cache), then the rest, then the first again (a whole-prompt hit)."""
    first = llm.generate([prompts[0]], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    again = llm.generate([prompts[0]], GREEDY)
    return [o.outputs[0].token_ids for o in first + rest + again]


@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy", "preempting"])
def test_caching_on_and_off_match_transformers(tiny_model, num_blocks):
    _, prompts = _shared_prefix_prompts()
    ref = [hf_greedy(tiny_model, tuple(p), 24).token_ids for p in prompts + [prompts[0]]]
    on = LLM(str(tiny_model), max_model_len=128, dtype="float32", num_blocks=num_blocks)
    off = LLM(str(tiny_model), max_model_len=128, dtype="float32", num_blocks=num_blocks, enable_prefix_caching=False)
    assert _run_waves(on, prompts) == ref
    assert _run_waves(off, prompts) == ref
    stats = on.engine.kv.stats
    if num_blocks == 256:
        # two full prefix blocks for each later prompt, one for prefix[:32] (its last token is recomputed)
        assert stats.hits == 32 * 5 + 16
    else:
        assert stats.hits > 0
    assert off.engine.kv.stats.hits == 0
    if num_blocks == 14:
        assert on.engine.scheduler.num_preemptions > 0
    assert_idle(on)
    assert_idle(off)


def test_whole_prompt_hit_recomputes_only_the_last_token(tiny_models):
    llm = LLM(str(tiny_models["gemma3"]), max_model_len=128, dtype="float32", num_blocks=64)
    prompt = list(range(3, 3 + 48))  # exactly 3 blocks
    first = llm.generate([prompt], GREEDY)[0]
    before = llm.engine.kv.stats.hits
    second = llm.generate([prompt], GREEDY)[0]
    assert llm.engine.kv.stats.hits - before == 32  # the third block holds the last token: recomputed
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert second.metrics.num_cached_tokens == 32


def test_preempted_request_hits_its_own_blocks(tiny_models):
    llm = LLM(str(tiny_models["qwen2"]), max_model_len=128, dtype="float32", num_blocks=13, block_size=16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (40,), generator=g).tolist() for _ in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.kv.stats.hits > 0  # nothing is shared between prompts: hits come from resumption
    assert_idle(llm)


def test_cache_salt_keeps_tenants_apart(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=128, dtype="float32", num_blocks=64)
    engine = llm.engine
    prompt = list(range(3, 60))
    for rid, salt in [("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")]:
        before = engine.kv.stats.hits
        engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        hits = engine.kv.stats.hits - before
        assert hits == (48 if rid == "c" else 0), rid
    assert_idle(llm)


@pytest.fixture(scope="module")
def fuzz_llm(tiny_models):
    return LLM(
        str(tiny_models["gemma3"]),
        max_model_len=96,
        dtype="float32",
        num_blocks=12,
        block_size=8,
        max_num_batched_tokens=32,
    )


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 20)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 15), st.just(0), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=actions)
def test_random_add_step_abort_leaves_every_block_free_or_cached(fuzz_llm, actions):
    engine = fuzz_llm.engine
    live: list[str] = []
    for kind, a, b, c in actions:
        if kind == "add":
            rid = engine.new_request_id()
            prompt = [3 + a] * 8 + list(range(10, 10 + b))  # four families of shared prefixes
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=c, ignore_eos=True))
            live.append(rid)
        elif kind == "step":
            for _ in range(a):
                engine.step()
        elif live:
            engine.abort(live.pop(a % len(live)))
    for rid in live:
        engine.abort(rid)
    assert_idle(fuzz_llm)


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_in_full(tiny_models):
    """What a benchmark's repeated runs rely on: after `LLM.reset_prefix_cache` a prompt seen before hits nothing
    and gives the same tokens."""
    llm = LLM(str(tiny_models["gemma3"]), max_model_len=128, dtype="float32", num_blocks=64)
    prompt = list(range(3, 3 + 48))
    first = llm.generate([prompt], GREEDY)[0]
    assert llm.reset_prefix_cache() is True
    before = llm.engine.kv.stats.hits
    again = llm.generate([prompt], GREEDY)[0]
    assert llm.engine.kv.stats.hits == before
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.generate([prompt], GREEDY)  # cached again once computed: the reset forgot, it did not switch caching off
    assert llm.engine.kv.stats.hits - before == 32
    assert_idle(llm)
