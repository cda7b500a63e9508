"""A decode step at batch 1, per mode: what one stream (concurrency 1) is bound by.

For each mode the engine decodes one request and the step is timed (median of `--steps`); the weights the
step reads are summed (`inferd.measure.model.weight_bytes`: the linear layers as stored, the LM head's
tiles included), so the JSON says how close each mode comes to the machine's memory bandwidth, probed right
after each mode's steps (a VM's bandwidth drifts by a third within minutes). Modes are loaded one after
another and the whole list is repeated (`--rounds`), so a drift of the machine's speed shows up as a spread
rather than as a difference between modes.

    .venv/bin/python -m benchmarks.batch1_step --modes default,auto,int8,int4,fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import OUT_HELP, machine, record_run
from inferd.config import DEFAULT_MODEL
from inferd.engine.engine import LLM
from inferd.measure.hardware import memory_bandwidth
from inferd.measure.model import weight_bytes
from inferd.sampling import SamplingParams

MODES = {  # name -> LLM settings
    "default": {},  # --dtype auto, --quantization auto
    "auto": {"dtype": "auto", "quantization": "none"},  # the auto dtype on the checkpoint's values
    "fp32": {"dtype": "float32", "quantization": "none"},
    "int8": {"dtype": "auto", "quantization": "int8"},
    "gguf": {"dtype": "auto", "quantization": "gguf"},
    "int4": {"dtype": "auto", "quantization": "int4"},
}
PROMPT = "Tell me a long story about a dragon who guards a library of paged attention kernels. " * 3


def time_mode(model_name: str, settings: dict, steps: int) -> dict:
    llm = LLM(model_name, max_model_len=1024, max_num_seqs=1, num_blocks=64, **settings)
    engine = llm.engine
    engine.add_request("one", PROMPT, SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True))
    for _ in range(8):  # prefill and warm-up
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort("one")
    return {"step_s": statistics.median(times), "weights_bytes": weight_bytes(engine.model, rows=1)}


def mode_summary(mode: str, runs: list[dict]) -> dict:
    step = statistics.median(x["step_s"] for x in runs)
    size = runs[0]["weights_bytes"]
    return {
        "settings": MODES[mode],
        "rounds": runs,
        "median_step_s": step,
        "tokens_per_s": 1 / step,
        "weights_bytes": size,
        # each round's read rate over the bandwidth probed right after it: the VM's bandwidth drifts by a
        # third within minutes, so a probe taken once, apart from the steps, says little about them
        "fraction_of_bandwidth": statistics.median(x["read_gbs"] / x["bandwidth_gbs"] for x in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--modes", default="default,auto,int8,int4,fp32", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            res = time_mode(args.model, MODES[mode], args.steps)
            res["read_gbs"] = res["weights_bytes"] / res["step_s"] / 1e9
            res["bandwidth_gbs"] = memory_bandwidth() / 1e9
            rounds[mode].append(res)
            print(f"round {r + 1} {mode:5s} step {res['step_s'] * 1e3:.1f} ms, weights "
                  f"{res['weights_bytes'] / 1e6:.0f} MB, {res['read_gbs']:.1f} GB/s, "
                  f"probe {res['bandwidth_gbs']:.1f} GB/s", flush=True)  # fmt: skip
    bandwidth = statistics.median(x["bandwidth_gbs"] for runs in rounds.values() for x in runs)
    result = {
        "model": args.model,
        "machine": machine(),
        "memory_read_gbs": bandwidth,  # the median of the probes, one after each mode's steps
        "steps_timed": args.steps,
        "modes": {m: mode_summary(m, runs) for m, runs in rounds.items()},
    }
    path = record_run("batch1_step", result, sys.argv, args.out)
    print(f"memory read bandwidth {bandwidth:.1f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
