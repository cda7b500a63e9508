"""The step record is all a runner needs, and a request's progress follows check_stop.

A second ModelRunner, holding no scheduler and no KV manager, replays the pickled step records of a
run (chunked prefill, prefix hits, preemption, seeded sampling) and samples exactly the same tokens.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from inferd import LLM, SamplingParams
from inferd.engine.runner import ModelRunner
from inferd.engine.scheduler import check_stop
from inferd.engine.step import RunnerOutput, SchedulerOutput
from inferd.request import Request, RequestStatus
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import hf_greedy, prompt_set

PROMPTS = prompt_set(VOCAB, lengths=(9, 17, 33, 40, 57))


def _record(llm: LLM) -> list[tuple[bytes, RunnerOutput]]:
    """Wrap the engine's runner so every step record (pickled, as another process would get it) is kept."""
    records: list[tuple[bytes, RunnerOutput]] = []
    execute = llm.engine.runner.execute

    def recording(sched: SchedulerOutput) -> RunnerOutput:
        data = pickle.dumps(sched)
        out = execute(sched)
        records.append((data, out))
        return out

    llm.engine.runner.execute = recording
    return records


def test_a_runner_fed_only_step_records_reproduces_the_engine(tiny_models):
    folder = tiny_models["gemma3"]
    llm = LLM(str(folder), max_model_len=128, dtype="float32", num_blocks=24, block_size=8, max_num_batched_tokens=24)
    records = _record(llm)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[2], PROMPTS[3]]  # repeats: prefix hits
    outs = llm.generate(prompts, [greedy] * len(PROMPTS) + [greedy, seeded])
    llm.engine.step()  # hands the last finished ids to the runner
    assert llm.engine.scheduler.num_preemptions > 0, "the run must preempt"
    for prompt, out in zip(prompts[:2], outs, strict=False):
        assert out.outputs[0].token_ids == hf_greedy(folder, tuple(prompt), 24).token_ids

    engine = llm.engine
    replay = ModelRunner(engine.model, engine.kv.num_blocks, engine.kv.block_size, engine.dtype, engine.device)
    seen = {"preempted": 0, "one_token_prefill": 0, "decode": 0}
    for data, expected in records:
        sched = pickle.loads(data)
        got = replay.execute(sched)
        assert (got.request_ids, got.token_ids) == (expected.request_ids, expected.token_ids)
        seen["preempted"] += len(sched.preempted_ids)
        seen["one_token_prefill"] += sum(c.is_prefill and c.num_tokens == 1 for c in sched.chunks)
        seen["decode"] += sum(not c.is_prefill for c in sched.chunks)
    assert all(seen.values()), seen
    assert replay.requests == {}, "finished requests leave no state in the runner"
    assert_idle(llm)


def test_records_carry_only_new_blocks_and_mark_a_prefix_hit_as_prefill(tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), max_model_len=256, dtype="float32", num_blocks=64, block_size=4)
    records = _record(llm)
    prompt = PROMPTS[2]  # 33 tokens: 8 full blocks of 4, and one token left to compute
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    records.clear()
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    chunks = [c for data, _ in records for c in pickle.loads(data).chunks]
    hit = chunks[0]
    assert (hit.num_tokens, hit.start, hit.is_prefill, hit.samples) == (1, 32, True, True)
    assert hit.token_ids == prompt[-1:]
    assert len(hit.new_block_ids) == 9  # the whole table of a request new to the runner: 8 hits + 1
    decodes = chunks[1:]
    assert all(not c.is_prefill and c.samples and c.num_tokens == 1 for c in decodes)
    # five decodes at positions 33..37; a running request gets a block only when it enters one (position 36)
    assert [c.start for c in decodes] == [33, 34, 35, 36, 37]
    assert [len(c.new_block_ids) for c in decodes] == [0, 0, 0, 1, 0]
    table = hit.new_block_ids + [b for c in decodes for b in c.new_block_ids]
    assert len(set(table)) == len(table) == 10
    assert_idle(llm)


def _req(output: list[int], **params) -> Request:
    r = Request("r", "r", 0, [5, 6, 7], SamplingParams(**params), frozenset({1}))
    r.output_token_ids = output
    return r


@pytest.mark.parametrize(
    "output,params,max_model_len,expected",
    [
        ([9], {}, 100, None),
        ([9, 1], {}, 100, (RequestStatus.FINISHED_STOPPED, None)),  # eos: no stop reason
        ([9, 1], {"ignore_eos": True}, 100, None),
        ([9, 4], {"stop_token_ids": [4]}, 100, (RequestStatus.FINISHED_STOPPED, 4)),
        ([1], {"min_tokens": 2, "max_tokens": 8}, 100, None),  # stops count only from min_tokens on
        ([9, 4], {"min_tokens": 2, "stop_token_ids": [4]}, 100, (RequestStatus.FINISHED_STOPPED, 4)),
        ([9, 9], {"max_tokens": 2}, 100, (RequestStatus.FINISHED_LENGTH, None)),
        ([9, 1], {"max_tokens": 2}, 100, (RequestStatus.FINISHED_STOPPED, None)),  # eos wins over length
        ([9, 9], {"max_tokens": 8}, 5, (RequestStatus.FINISHED_LENGTH, None)),  # the context is full
        ([9], {"max_tokens": 8}, 5, None),
    ],
)
def test_check_stop(output, params, max_model_len, expected):
    assert check_stop(_req(output, **params), max_model_len) == expected


def _imports_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint(' '.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return set(result.stdout.split())


def test_the_runner_never_imports_the_scheduler_or_the_kv_manager():
    loaded = _imports_after("import inferd.engine.runner")
    assert "inferd.engine.runner" in loaded
    assert not loaded & {"inferd.engine.scheduler", "inferd.engine.kv_cache", "inferd.request"}


def test_building_the_cli_parser_does_not_import_torch():
    loaded = _imports_after("import inferd.cli; inferd.cli.build_parser()")
    assert "inferd.cli" in loaded
    assert "torch" not in loaded and not any(m.startswith("inferd.models") for m in loaded)
