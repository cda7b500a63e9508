"""Bad input raises an InferdError that says what to change, and nothing leaks."""

from __future__ import annotations

import json

import pytest

from inferd import LLM, SamplingParams
from inferd.errors import ConfigError, InvalidRequestError, ModelLoadError
from tests.conftest import assert_idle


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), max_model_len=128, num_blocks=16, block_size=16)


def test_prompt_longer_than_context(llm):
    with pytest.raises(InvalidRequestError, match="shorten the prompt or raise --max-model-len") as e:
        llm.generate([[5] * 128])
    assert e.value.param == "prompt"
    assert_idle(llm)


def test_max_tokens_beyond_context(llm):
    with pytest.raises(InvalidRequestError, match="lower max_tokens to at most 118") as e:
        llm.generate([[5] * 10], SamplingParams(max_tokens=200))
    assert e.value.param == "max_tokens"


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 28 and out.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_empty_prompt_and_bad_token_ids(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        llm.generate([[5, 10_000]])


def test_failed_batch_submission_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5] * 10, [5] * 500])
    assert not llm.engine.has_unfinished_requests()
    assert_idle(llm)


def test_abort_frees_every_block(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"x{i}", [7] * (20 + i), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.usage > 0
    for i in range(4):
        engine.abort(f"x{i}")
    engine.abort("never-existed")
    assert_idle(llm)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    engine.abort("dup")
    assert_idle(llm)


def test_unknown_architecture(tmp_path, tiny_models):
    folder = tmp_path / "weird"
    folder.mkdir()
    src = tiny_models["llama"]
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*inferd runs"):
        LLM(str(folder), max_model_len=64, num_blocks=8)


def test_missing_files(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ModelLoadError, match="could not fetch"):
        LLM("no-such-org/no-such-model-xyz")


def test_kv_cache_smaller_than_context(tiny_models):
    with pytest.raises(ConfigError, match="raise --kv-cache-memory or lower --max-model-len"):
        LLM(str(tiny_models["llama"]), max_model_len=512, num_blocks=4)


def test_request_filling_the_whole_cache_runs(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=64, num_blocks=4, block_size=16)
    llm.generate([[5] * 30], SamplingParams(max_tokens=34))  # exactly 4 blocks: fits
    assert_idle(llm)
