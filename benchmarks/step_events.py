"""What the dashboard's step events cost a step: the engine with events off and on, in alternating rounds.

Each round runs the same batch (`--requests` prompts of `--prompt-len` tokens, `--output-len` tokens each)
through the offline engine, once with `engine.events = None` and once with a `StepEvents` sink (as
`inferd serve` attaches it). Reported: the median step time of each, and -- the number that does not
drown in the noise of a shared machine -- the time spent inside `StepEvents.record` per step, and the
cost of one KV snapshot at the cache's size. `record`'s CPU time (time.thread_time) is reported beside its
wall time: on a loaded machine the wall time counts the waits for a core too. Model: a tiny random one by
default (the step is then as short as it gets, so the overhead's share is the worst case), or `--model`.

    .venv/bin/python -m benchmarks.step_events                       # results/step_events.json
    .venv/bin/python -m benchmarks.step_events --model gemma3-270m --num-blocks 32768
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine, write_result
from inferd import LLM, SamplingParams
from inferd.engine.events import StepEvents, kv_snapshot


def _tiny_model(folder: Path) -> str:
    from tests.conftest import build_tiny_model

    return str(build_tiny_model("llama", folder / "llama"))


class _TimedEvents(StepEvents):
    """StepEvents that measures its own record() calls."""

    def __init__(self) -> None:
        super().__init__()
        self.record_times: list[float] = []
        self.record_cpu: list[float] = []  # the step thread's CPU time: what a shared machine's waits don't inflate

    def record(self, *args) -> None:
        t, c = time.perf_counter(), time.thread_time()
        super().record(*args)
        self.record_cpu.append(time.thread_time() - c)
        self.record_times.append(time.perf_counter() - t)


def _round(llm: LLM, prompts: list[list[int]], params: SamplingParams, events: StepEvents | None) -> list[float]:
    engine = llm.engine
    engine.events = events
    llm.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"b-{i}", p, params)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if events is not None:
            events.ring.drain()  # the server's hub drains continuously
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: a tiny random llama built in a temp folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--out", default="step_events")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny_model(Path(tmp))
        llm = LLM(model, max_model_len=args.prompt_len + args.output_len + 16, num_blocks=args.num_blocks)
        vocab = llm.engine.vocab_size
        prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        _round(llm, prompts, params, None)  # warm-up
        off, on, record, record_cpu = [], [], [], []
        for _ in range(args.rounds):
            off += _round(llm, prompts, params, None)
            events = _TimedEvents()
            on += _round(llm, prompts, params, events)
            record += events.record_times
            record_cpu += events.record_cpu
        # one snapshot of a cache with every request's blocks in it, at --num-blocks
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"s-{i}", p, params)
        llm.engine.step()
        in_use = sum(len(b) for b in llm.engine.kv.req_blocks.values())
        snap_times = []
        for _ in range(20):
            t = time.perf_counter()
            kv_snapshot(llm.engine.kv)
            snap_times.append(time.perf_counter() - t)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    result = {
        "model": args.model or "tiny random llama (tests/conftest.py)",
        "workload": vars(args),
        "machine": machine(),
        "steps_per_round": len(off) // args.rounds,
        "median_step_ms_events_off": round(off_ms, 4),
        "median_step_ms_events_on": round(on_ms, 4),
        "median_record_us_per_step": round(statistics.median(record) * 1e6, 2),
        "mean_record_us_per_step": round(statistics.mean(record) * 1e6, 2),
        "median_record_cpu_us_per_step": round(statistics.median(record_cpu) * 1e6, 2),
        "mean_record_cpu_us_per_step": round(statistics.mean(record_cpu) * 1e6, 2),
        "record_share_of_step": round(statistics.mean(record) / statistics.mean(on), 5),
        "kv_snapshot_us": round(statistics.median(snap_times) * 1e6, 1),
        "kv_snapshot_blocks_in_use": in_use,
    }
    path = write_result(args.out, result)
    print({k: v for k, v in result.items() if k not in ("machine", "workload")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
