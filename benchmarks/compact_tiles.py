"""A GGUF's compact tiles at batch 1: one engine's decode steps with them and without, alternated.

Under `--quantization auto` the default model's int8 body layers take the GGUF's own blocks (compact tiles, fewer
bytes) for 1-3 rows (`inferd.models.gguf_blocks.CompactBlocks`). Separate engines timed a round apart cannot
tell a difference of a few percent from this VM's drift, so one engine decodes one request and switches the
layers' compact blocks on and off every `--steps` steps, `--cycles` times; each cycle's ratio is the median
step with them over the median step without, and the run's figure is the median of the cycles' ratios. Both
sides read their weights from the same huge-page mapping. The JSON also records the bytes a step reads each way.

    .venv/bin/python -m benchmarks.compact_tiles [--cycles 12] [--steps 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import OUT_HELP, machine, record_run
from inferd.engine.engine import LLM
from inferd.measure.model import weight_bytes
from inferd.models.quant import Int8Linear
from inferd.sampling import SamplingParams

PROMPT_TOKENS = list(range(1000, 1300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--steps", type=int, default=25, help="decode steps timed each way per cycle")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()

    llm = LLM(max_model_len=2048, max_num_seqs=1)
    engine = llm.engine
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear) and m.small is not None]
    if not layers:
        raise SystemExit("no layer holds compact tiles here (they need a GGUF, --quantization auto and AVX-512 VNNI)")
    blocks = [m.small for m in layers]
    tokens = args.cycles * 2 * (args.steps + 1) + 16
    engine.add_request("one", PROMPT_TOKENS, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    for _ in range(8):  # prefill and warm-up
        engine.step()

    def median_step(on: bool) -> float:
        for layer, small in zip(layers, blocks, strict=True):
            layer.small = small if on else None
        engine.step()  # the first step after a switch is not timed
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    cycles = []
    for c in range(args.cycles):
        with_, without = median_step(True), median_step(False)
        cycles.append({"compact_step_s": with_, "int8_step_s": without, "ratio": with_ / without})
        print(f"cycle {c + 1}: compact {with_ * 1e3:.2f} ms, int8 {without * 1e3:.2f} ms, {with_ / without:.3f}x")
    engine.abort("one")
    for layer, small in zip(layers, blocks, strict=True):
        layer.small = small
    result = {
        "machine": machine(),
        "layers_with_compact_tiles": len(layers),
        "steps_per_side": args.steps,
        "step_bytes": {"compact": weight_bytes(engine.model, rows=1), "int8": weight_bytes(engine.model)},
        "cycles": cycles,
        "median_compact_step_s": statistics.median(x["compact_step_s"] for x in cycles),
        "median_int8_step_s": statistics.median(x["int8_step_s"] for x in cycles),
        "median_ratio": statistics.median(x["ratio"] for x in cycles),
    }
    path = record_run("compact_tiles", result, sys.argv, args.out)
    print(f"compact / int8 step: {result['median_ratio']:.3f}x (median of {args.cycles} cycles); wrote {path}")


if __name__ == "__main__":
    main()
