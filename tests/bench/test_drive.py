"""When the engine driver (`inferd.bench.drive`) lets requests in: open loop at their times, closed loop under a
concurrency, after a number of steps, and static batches that start only when full (or overdue, or when nothing
more will come)."""

from __future__ import annotations

from inferd.bench.drive import Job, SharedPrefixes, _Feeder


def _jobs(times: list[float]) -> list[Job]:
    return [Job([5, 6], 2, at=t) for t in times]


def test_open_loop_arrives_at_each_jobs_time():
    f = _Feeder(_jobs([0.0, 0.5, 1.0]), None, None, 0.5)
    assert f.arrivals(0.1, 0, 0) == [(0, 0.0)]
    assert f.arrivals(0.6, 3, 1) == [(1, 0.5)]  # arrival time is the job's, not the loop's
    assert f.next_time() == 1.0


def test_closed_loop_keeps_the_concurrency():
    f = _Feeder(_jobs([0.0] * 5), 2, None, 0.5)
    assert [i for i, _ in f.arrivals(0.0, 0, 0)] == [0, 1]
    assert f.arrivals(0.1, 1, 2) == []
    assert [i for i, _ in f.arrivals(0.2, 2, 1)] == [2]


def test_static_batch_waits_until_full_overdue_or_last():
    f = _Feeder(_jobs([0.0, 0.0, 0.0, 5.0, 5.0]), None, 4, 0.5)
    f.queue.extend(f.arrivals(0.0, 0, 0))
    assert f.admit(0.1, engine_idle=True) == []  # 3 of 4, more to come, not overdue
    assert len(f.admit(0.6, engine_idle=True)) == 3  # overdue: goes as it is
    f.queue.extend(f.arrivals(5.0, 9, 0))
    assert f.admit(5.0, engine_idle=False) == []  # a batch still runs: nobody joins it
    assert len(f.admit(5.0, engine_idle=True)) == 2  # nothing more will come


def test_a_step_triggered_job_arrives_after_that_many_steps_or_when_nothing_else_runs():
    f = _Feeder([Job([5], 2), Job([6], 2, at_step=3)], None, None, 0.5)
    assert [i for i, _ in f.arrivals(0.0, 0, 0)] == [0]
    assert f.arrivals(0.1, 2, 1) == []
    assert [i for i, _ in f.arrivals(0.2, 3, 1)] == [1]
    stalled = _Feeder([Job([6], 2, at_step=3)], None, None, 0.5)
    assert [i for i, _ in stalled.arrivals(0.0, 0, 0)] == [0]  # no step would ever come


def test_arriving_jobs_keep_prompt_order_with_poisson_times():
    from inferd.bench.drive import Run, StepLog, arriving

    jobs = arriving([[5], [6], [7]], [2, 3, 4], rate=10.0, seed=1)
    assert [j.prompt for j in jobs] == [[5], [6], [7]] and [j.max_tokens for j in jobs] == [2, 3, 4]
    assert 0 == jobs[0].at < jobs[1].at < jobs[2].at == arriving([[1]] * 3, 1, 10.0, seed=1)[2].at  # the first at 0
    run = Run([], [StepLog(0, 0.1, 2, 0, 0), StepLog(0.1, 0.1, 3, 1, 0)], 0.2)
    assert run.slot_use(4) == (0.5 + 1.0) / 2


def test_shared_prefixes_give_each_prefix_its_users_questions_and_the_blocks_they_need():
    w = SharedPrefixes(prefixes=3, users=2, prefix_len=40, question_len=8)
    prompts = w.prompts(0, 500)
    assert len(prompts) == 6 and all(len(p) == 48 for p in prompts)
    assert len({tuple(p[:40]) for p in prompts}) == 3
    assert len({tuple(p[40:]) for p in prompts}) == 6
    assert prompts == w.prompts(0, 500) and prompts != w.prompts(1, 500)
    assert w.max_len == 80  # 48 tokens, two out, in whole blocks (and a spare one)
    assert w.blocks_holding(1.0) == 10  # the floor: two requests at max_len
    assert SharedPrefixes(10, 1, 160, 8).blocks_holding(0.5) == 50
