"""`--scheduling-policy priority`: waiting requests in (priority, arrival) order, a later class preempted for an
earlier one that finds no room, KV pressure preempting the latest class first; every output as without it."""

from __future__ import annotations

import pytest

from inferd import LLM, SamplingParams
from inferd.errors import InvalidRequestError
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _llm(folder, **settings) -> LLM:
    return LLM(str(folder), dtype="float32", **{"max_model_len": 256, "num_blocks": 128, **settings})


def _run(llm: LLM, jobs: list[tuple[str, list[int], int]], add_after: dict[int, list] | None = None):
    """Add `jobs` (id, prompt, priority), step to the end (adding `add_after[step]` jobs at that step); the
    order requests finished in, and each one's tokens."""
    engine, order, tokens = llm.engine, [], {}
    for rid, prompt, prio in jobs:
        engine.add_request(rid, prompt, PARAMS, priority=prio)
    step = 0
    while engine.has_unfinished_requests():
        for rid, prompt, prio in (add_after or {}).get(step, []):
            engine.add_request(rid, prompt, PARAMS, priority=prio)
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    return order, tokens


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_models):
    llm = _llm(tiny_models["llama"], scheduling_policy="priority", max_num_seqs=1)
    prompts = prompt_set(VOCAB, lengths=(9, 11, 13, 15))
    order, _ = _run(llm, [("late", prompts[0], 2), ("mid", prompts[1], 1), ("first", prompts[2], 0),
                          ("also-mid", prompts[3], 1)])  # fmt: skip
    assert order == ["first", "mid", "also-mid", "late"]
    assert_idle(llm)


def test_an_earlier_class_preempts_a_running_later_one(tiny_models):
    """Two low-priority requests fill the batch; a high-priority arrival takes the newest one's place at once,
    and every request still gets the tokens it gets alone."""
    folder = tiny_models["llama"]
    prompts = prompt_set(VOCAB, lengths=(20, 30, 25))
    llm = _llm(folder, scheduling_policy="priority", max_num_seqs=2)
    jobs = [("low-a", prompts[0], 5), ("low-b", prompts[1], 5)]
    order, tokens = _run(llm, jobs, add_after={3: [("high", prompts[2], 0)]})
    assert llm.engine.scheduler.num_preemptions >= 1
    assert order.index("high") < order.index("low-b")  # low-b, the newest of the class, gave way
    alone = _llm(folder)
    for rid, prompt in [("low-a", prompts[0]), ("low-b", prompts[1]), ("high", prompts[2])]:
        assert tokens[rid] == alone.generate([prompt], PARAMS)[0].outputs[0].token_ids, rid
    assert_idle(llm)


def test_kv_pressure_preempts_the_latest_class_not_the_newest_arrival(tiny_models):
    """Both fit at first and outgrow the cache together: FCFS would preempt the newest (the high-priority
    request); the priority policy preempts the low-priority one."""
    folder = tiny_models["llama"]
    prompts = prompt_set(VOCAB, lengths=(40, 40))
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    results = {}
    for policy in ("fcfs", "priority"):
        llm = _llm(folder, scheduling_policy=policy, num_blocks=12, block_size=16, max_model_len=160)
        engine = llm.engine
        engine.add_request("low", prompts[0], params, priority=5 if policy == "priority" else 0)
        engine.step()
        engine.add_request("high", prompts[1], params)
        preempted = {"low": 0, "high": 0}
        tokens = {}
        while engine.has_unfinished_requests():
            for rid in preempted:
                req = engine.scheduler.requests.get(rid)
                if req is not None:
                    preempted[rid] = req.num_preemptions
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        results[policy] = (preempted, tokens)
        assert_idle(llm)
    assert results["fcfs"][0]["high"] > 0  # the newest arrival gave way
    assert results["priority"][0] == {"low": results["priority"][0]["low"], "high": 0}
    assert results["priority"][0]["low"] > 0
    assert results["priority"][1] == results["fcfs"][1]  # the same tokens either way


def test_priority_needs_the_priority_policy(tiny_models):
    llm = _llm(tiny_models["llama"])
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        llm.generate([[5, 6, 7]], PARAMS, priority=1)
    assert llm.generate([[5, 6, 7]], PARAMS, priority=0)[0].finished
    assert_idle(llm)


def _run_ranked(llm: LLM, jobs: list[tuple[str, list[int], dict, float]]) -> list[str]:
    """Add each job (id, prompt, priority/ttft_deadline, arrival) and step to the end: the finishing order."""
    engine, order = llm.engine, []
    for rid, prompt, hints, arrival in jobs:
        engine.add_request(rid, prompt, PARAMS, arrival_time=arrival, **hints)
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    return order


def test_aging_bounds_how_long_later_classes_overtake_a_waiting_request(tiny_models):
    """With priority_aging_s=10, a class-2 request that has waited 25 s ranks as a class-0 request arriving 5 s
    ago would (20 s of handicap), so it goes before a class-0 request that arrived after that, and after one that
    arrived before; strict classes put it last."""
    prompts = prompt_set(VOCAB, lengths=(9, 11, 13))
    now = 1000.0
    jobs = [
        ("old-low", prompts[0], {"priority": 2}, now - 25),
        ("new-high", prompts[1], {"priority": 0}, now - 1),
        ("older-high", prompts[2], {"priority": 0}, now - 8),
    ]
    aged = _llm(tiny_models["llama"], scheduling_policy="priority", priority_aging_s=10, max_num_seqs=1)
    assert _run_ranked(aged, jobs) == ["older-high", "old-low", "new-high"]
    strict = _llm(tiny_models["llama"], scheduling_policy="priority", max_num_seqs=1)
    assert _run_ranked(strict, jobs) == ["older-high", "new-high", "old-low"]
    assert_idle(aged)


def test_deadline_policy_serves_the_earliest_ttft_deadline_first(tiny_models):
    prompts = prompt_set(VOCAB, lengths=(9, 11, 13, 15))
    llm = _llm(tiny_models["llama"], scheduling_policy="deadline", ttft_deadline_s=5.0, max_num_seqs=1)
    now = 1000.0
    order = _run_ranked(llm, [
        ("batch", prompts[0], {"ttft_deadline": 60.0}, now - 2),  # due at +58
        ("default", prompts[1], {}, now - 1),  # due at +4 (the policy's 5 s)
        ("urgent", prompts[2], {"ttft_deadline": 0.5}, now),  # due at +0.5
        ("soon", prompts[3], {"ttft_deadline": 2.0}, now),  # due at +2
    ])  # fmt: skip
    assert order == ["urgent", "soon", "default", "batch"]
    with pytest.raises(InvalidRequestError, match="priority scheduling policy"):
        llm.engine.add_request("p", prompts[0], PARAMS, priority=1)
    fcfs = _llm(tiny_models["llama"])
    with pytest.raises(InvalidRequestError, match="deadline scheduling policy"):
        fcfs.engine.add_request("d", prompts[0], PARAMS, ttft_deadline=1.0)
    with pytest.raises(InvalidRequestError, match="from 0 up"):
        llm.engine.add_request("neg", prompts[0], PARAMS, ttft_deadline=-1.0)
    assert_idle(llm)
    assert_idle(fcfs)


def test_a_later_ranked_prefill_sits_out_the_step_that_admits_an_earlier_ranked_arrival(tiny_models):
    """A batch job's long prompt is being prefilled 64 tokens a step when an interactive request arrives: the
    next step computes the interactive request's whole prompt and none of the batch prompt (a short step),
    instead of waiting out the batch prompt (fcfs: three more steps); every output is as without it."""
    folder = tiny_models["llama"]
    prompts = prompt_set(VOCAB, lengths=(240, 20))
    first_step, batch_chunk = {}, {}
    tokens = {}
    for policy in ("fcfs", "priority"):
        llm = _llm(folder, scheduling_policy=policy, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512)
        engine = llm.engine
        engine.add_request("batch", prompts[0], PARAMS, priority=5 if policy == "priority" else 0)
        engine.step()  # the batch prompt's first chunk
        engine.add_request("urgent", prompts[1], PARAMS)
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            outs = engine.step()
            urgent, batch = engine.scheduler.requests.get("urgent"), engine.scheduler.requests.get("batch")
            if policy not in first_step and urgent is not None and urgent.num_computed_tokens > 0:
                first_step[policy] = step
                batch_chunk[policy] = batch.num_computed_tokens - 64 if batch is not None else None
            for out in outs:
                if out.finished:
                    tokens[(policy, out.request_id)] = out.outputs[0].token_ids
        assert_idle(llm)
    assert first_step["priority"] == 1 and batch_chunk["priority"] == 0  # the batch's second chunk waited a step
    assert first_step["fcfs"] > 1
    assert tokens[("priority", "urgent")] == tokens[("fcfs", "urgent")]
    assert tokens[("priority", "batch")] == tokens[("fcfs", "batch")]


@pytest.mark.parametrize("policy", ["priority", "deadline"])
def test_the_step_that_admits_an_earlier_class_admits_no_later_class_beside_it(tiny_models, policy):
    """A batch prompt is being prefilled when an interactive request and another batch request arrive: the next
    step computes the interactive prompt beside the decodes only (the running batch prompt sits it out, the
    waiting one is not admitted though the budget has room), and the step after goes on with the batch prompt
    (the waiting batch request behind it, as fcfs would). Requests of one class are admitted together as before."""
    llm = _llm(tiny_models["llama"], scheduling_policy=policy, max_num_batched_tokens=64, max_model_len=512)
    engine, (long, short, other) = llm.engine, prompt_set(VOCAB, lengths=(240, 20, 16))
    batch = {"priority": 5} if policy == "priority" else {"ttft_deadline": 60.0}
    urgent = {"priority": 0} if policy == "priority" else {"ttft_deadline": 0.5}
    engine.add_request("batch", long, PARAMS, **batch)
    engine.step()
    engine.add_request("urgent", short, PARAMS, **urgent)
    engine.add_request("later", other, PARAMS, **batch)
    engine.step()
    requests = engine.scheduler.requests
    computed = {rid: requests[rid].num_computed_tokens for rid in ("batch", "urgent", "later")}
    assert computed == {"batch": 64, "urgent": 20, "later": 0}
    engine.step()
    assert requests["batch"].num_computed_tokens > 64
    while engine.has_unfinished_requests():
        engine.step()
    # one class: admitted together in one step, within the budget
    for rid, prompt in zip("abc", prompt_set(VOCAB, lengths=(16, 16, 16)), strict=True):
        engine.add_request(rid, prompt, PARAMS, **batch)
    engine.step()
    assert all(engine.scheduler.requests[rid].num_computed_tokens == 16 for rid in "abc")
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)
