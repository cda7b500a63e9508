"""Step events (inferd/engine/events.py): what each step reports, the KV snapshot, the bounded ring."""

from __future__ import annotations

import numpy as np
import pytest

from inferd import LLM, SamplingParams
from inferd.engine.events import CACHED, FREE, OWNER_BASE, SHARED, EventRing, StepEvents, expand_runs, run_length
from tests.conftest import assert_idle, build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("events") / "llama")


def _llm(tiny_llama, **kw) -> LLM:
    settings = dict(max_model_len=128, num_blocks=64, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    settings["attention_backend"] = "torch"  # no native kernel to build
    return LLM(str(tiny_llama), **{**settings, **kw})


def test_rows_of_a_structured_output_name_its_constraint(tiny_llama):
    from inferd.structured.spec import Constraint

    llm = _llm(tiny_llama)
    events = llm.engine.events = StepEvents(kv_interval=0.0, kv_budget=1.0)
    regex = SamplingParams(temperature=0, max_tokens=8, structured=Constraint("regex", "[a-c]{5}"))
    llm.generate([list(range(3, 20)), list(range(5, 30))], [GREEDY, regex])
    rows = [r for e in events.ring.drain() if e["type"] == "step" for r in e["reqs"]]
    marks = {rid: {r[4] for r in rows if r[0] == rid} for rid in {r[0] for r in rows}}
    assert sorted(marks.values(), key=sorted) == [{""}, {"regex"}]
    assert events._constrained == {}  # forgotten once finished
    assert_idle(llm)


def test_rows_name_their_lora_adapter(tiny_llama, tmp_path):
    from tests.engine.lora_adapters import make_adapter

    adapter = make_adapter(tiny_llama, tmp_path / "sql")
    llm = _llm(tiny_llama, lora_modules=[f"sql={adapter}"])
    events = llm.engine.events = StepEvents(kv_interval=0.0, kv_budget=1.0)
    llm.generate([list(range(3, 20)), list(range(5, 30))], GREEDY, lora_name=["sql", None])
    rows = [r for e in events.ring.drain() if e["type"] == "step" for r in e["reqs"]]
    marks = {rid: {r[5] for r in rows if r[0] == rid} for rid in {r[0] for r in rows}}
    assert sorted(marks.values(), key=sorted) == [{""}, {"sql"}]
    assert events._adapters == {}  # forgotten once finished
    assert_idle(llm)


def test_run_length_round_trips():
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 1000):
        codes = rng.integers(0, 3, size).astype(np.uint16)
        runs = run_length(codes)
        assert expand_runs(runs) == codes.tolist()
        assert all(c > 0 for c in runs[1::2])


def test_ring_drops_the_oldest_and_counts():
    ring = EventRing(capacity=3)
    for i in range(5):
        ring.push({"id": i})
    assert ring.dropped == 2
    assert [e["id"] for e in ring.drain()] == [2, 3, 4]
    assert ring.drain() == [] and len(ring) == 0


def test_steps_report_chunks_budget_and_finish(tiny_llama):
    llm = _llm(tiny_llama)
    events = llm.engine.events = StepEvents(kv_interval=0.0, kv_budget=1.0)
    prompt = list(range(3, 3 + 40))  # 40 tokens: three prefill chunks of 16, 16, 8 under the chunk cap
    llm.generate([prompt], GREEDY)
    steps = [e for e in events.ring.drain() if e["type"] == "step"]
    assert [e["id"] for e in steps] == list(range(len(steps)))
    kinds = [(r[1], r[2]) for e in steps for r in e["reqs"]]
    assert kinds[:3] == [(16, "p"), (16, "p"), (8, "p")]
    assert kinds[3:] == [(1, "d")] * 5  # 6 tokens: the first comes from the last prefill chunk
    assert all(e["tokens"] <= e["budget"] == 32 for e in steps)
    assert all(e["dur_ms"] > 0 for e in steps)
    assert steps[-1]["reqs"][0][3] == "f" and steps[-1]["running"] == 0
    assert [r[3] for e in steps[:-1] for r in e["reqs"]] == ["", "", "s", "s", "s", "s", "s"]
    assert len([t for e in steps for t in e["ttft_ms"]]) == 1
    assert len([t for e in steps for t in e["itl_ms"]]) == 5
    # the last step leaves the engine idle: its snapshot shows every block free, the prompt's two full blocks cached
    final = steps[-1]["kv"]
    codes = expand_runs(final["runs"])
    assert len(codes) == 64 and final["owners"] == [] and final["usage"] == 0
    assert codes.count(CACHED) == 2 and codes.count(FREE) == 62
    assert_idle(llm)


def test_snapshot_marks_owners_and_shared_prefix_blocks(tiny_llama):
    llm = _llm(tiny_llama, max_num_batched_tokens=128, long_prefill_token_threshold=0)
    events = llm.engine.events = StepEvents(kv_interval=0.0, kv_budget=1.0)
    prefix = list(range(3, 3 + 32))  # two full blocks, shared by both requests once the first has run
    llm.generate([prefix + [50]], GREEDY)
    engine = llm.engine
    for i, tail in enumerate(([60, 61], [70, 71, 72])):
        engine.add_request(f"r{i}", prefix + tail, GREEDY)
    engine.step()
    snap = [e for e in events.ring.drain() if "kv" in e][-1]["kv"]
    codes = expand_runs(snap["runs"])
    assert snap["owners"] == ["r0", "r1"]
    shared = [c for c in codes if c & SHARED]
    assert len(shared) == 2 and all(c & ~SHARED == OWNER_BASE for c in shared)  # first owner: r0
    assert codes.count(OWNER_BASE + 1) == 1  # r1's own last block
    assert codes.count(OWNER_BASE) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)


def test_snapshots_only_when_changed_and_rate_limited(tiny_llama):
    llm = _llm(tiny_llama)
    events = llm.engine.events = StepEvents(kv_interval=3600.0)
    llm.generate([list(range(3, 43))], GREEDY)
    with_kv = [e for e in events.ring.drain() if "kv" in e]
    assert len(with_kv) == 2  # the first step, and the last one (the engine went idle); none between
    assert not events.push_kv(llm.engine.kv)  # nothing changed since
    events.kv_interval = 0.0
    llm.engine.kv.reset_prefix_cache()
    assert events.push_kv(llm.engine.kv)
    (kv_event,) = events.ring.drain()
    assert kv_event["type"] == "kv" and expand_runs(kv_event["kv"]["runs"]) == [FREE] * 64


def test_no_events_without_a_sink(tiny_llama):
    llm = _llm(tiny_llama)
    assert llm.engine.events is None
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_a_failing_record_never_fails_the_step(tiny_llama):
    llm = _llm(tiny_llama)
    events = llm.engine.events = StepEvents()
    events.ring = None  # any bug in the sink: push fails
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 6 and events.errors == 6
    assert_idle(llm)
