"""`LLM.reconfigure`: an idle engine takes new scheduling and speculative settings without reloading the model,
and says when any other setting needs a new one."""

from __future__ import annotations

import dataclasses

import pytest

from inferd import LLM, SamplingParams
from inferd.config import make_engine_config

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BASE = {"dtype": "float32", "max_model_len": 256, "num_blocks": 64}


@pytest.fixture(scope="module")
def folder(tiny_models) -> str:
    return str(tiny_models["llama"])


def test_scheduling_and_speculative_settings_are_taken_in_place(folder):
    llm = LLM(folder, **BASE)
    model, before = llm.engine.model, llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], PARAMS)[0].outputs[0].token_ids
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3}
    config = make_engine_config(folder, **BASE, max_num_seqs=3, **spec)
    assert llm.reconfigure(config)
    assert llm.engine.model is model  # not reloaded
    assert llm.engine.config == config and llm.engine.scheduler.config.max_num_seqs == 3
    assert llm.engine.proposer is not None
    after = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], PARAMS)[0].outputs[0].token_ids
    assert after == before  # greedy: drafting changes how many steps, never which tokens
    assert llm.engine.stats().spec_num_drafts > 0
    assert llm.reconfigure(make_engine_config(folder, **BASE))  # and back
    assert llm.engine.proposer is None and llm.engine.scheduler.config.max_num_seqs == 32


def test_the_same_settings_change_nothing(folder):
    llm = LLM(folder, **BASE)
    config, scheduler = llm.engine.config, llm.engine.scheduler.config
    assert llm.reconfigure(dataclasses.replace(config))
    assert llm.engine.config is config and llm.engine.scheduler.config is scheduler


@pytest.mark.parametrize(
    "change",
    [{"num_blocks": 32}, {"dtype": "bfloat16"}, {"max_model_len": 128}, {"scheduling_policy": "priority"}],
)
def test_other_settings_need_a_reload(folder, change):
    llm = LLM(folder, **BASE)
    config = llm.engine.config
    assert not llm.reconfigure(make_engine_config(folder, **(BASE | change)))
    assert llm.engine.config is config  # untouched


def test_refused_while_requests_run(folder):
    llm = LLM(folder, **BASE)
    llm.engine.add_request("r", [5, 6, 7], PARAMS)
    spec = make_engine_config(folder, **BASE, speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(RuntimeError, match="while requests run"):
        llm.reconfigure(spec)
