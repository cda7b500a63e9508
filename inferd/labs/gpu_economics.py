"""GPU economics: decode utilisation against batch size here, and the model projected onto GPUs by the roofline."""

from __future__ import annotations

from inferd.config import engine_choices
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext

# datasheet figures (dense, no sparsity): bf16 FLOP/s and memory bytes/s; the first is the one the text names
GPU_PROFILES = {"H100 SXM": (989e12, 3.35e12), "L4": (121e12, 0.30e12)}


def measure(ctx: LabContext) -> Measurement:
    dec, facts, hw = ctx.measured("decode"), ctx.facts, ctx.hardware
    batches, context = dec.series["batch"], dec.settings["prompt_len"] + dec.settings["output_len"] // 2
    s = {"batch": batches, "util": [100 * t * 1e12 / hw.matmul_flops for t in dec.series["tflops"]]}
    s["this machine (measured)"] = here = dec.series["tok_s"]
    for name, (flops, bandwidth) in GPU_PROFILES.items():  # bf16 weights and KV
        s[f"{name} (projected)"] = [b / facts.roofline_step_s(b, context, flops, bandwidth, 2) for b in batches]
    m = Measurement(series=s, settings={"modes": [c for c in engine_choices("dtype") if c != "auto"]})
    m.ends("batch", "util")
    gpu, (flops, bandwidth) = s["H100 SXM (projected)"], GPU_PROFILES["H100 SXM"]
    m.numbers |= {"tok_s_lo": here[0], "tok_s_hi": here[-1], "gpu_lo": gpu[0], "gpu_hi": gpu[-1]}
    m.numbers["gpu_mem_ms_b1"] = (facts.body_params + facts.lm_head_params) * 2 / bandwidth * 1000  # bf16 weights
    m.numbers["gpu_flops_ms_b1"] = facts.flops_per_token(context) / flops * 1000
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "util_hi > util_lo",
            yes="Measured here: decode used {util_lo}% of this machine's matmul peak at batch {batch_lo} and "
            "{util_hi}% at batch {batch_hi} ({tok_s_lo} to {tok_s_hi} tokens/s): the same hour, more useful work.",
            no="Measured here: decode used {util_lo}% of the matmul peak at batch {batch_lo} and {util_hi}% at "
            "batch {batch_hi}: batching did not raise utilisation.",
        ),
        m.decide(
            "gpu_mem_ms_b1 > gpu_flops_ms_b1",
            yes="Projected, not measured: on an H100 SXM (989 TFLOP/s bf16, 3.35 TB/s) a batch-1 step of this model "
            "reads its weights in {gpu_mem_ms_b1} ms and computes in {gpu_flops_ms_b1} ms, leaving compute idle; "
            "decode would run at {gpu_lo} tokens/s at batch {batch_lo}, {gpu_hi} at batch {batch_hi}.",
            no="Projected, not measured: on an H100 SXM a batch-1 step of this model needs {gpu_mem_ms_b1} ms of "
            "reads and {gpu_flops_ms_b1} ms of compute: compute-bound even at batch 1.",
        ),
    ]
    intro = "Utilisation: a decode step's FLOP/s over a large matmul's here. GPU figures: roofline projections from "
    intro += f"datasheets, an upper bound. inferd's precision modes: --dtype {', '.join(m.settings['modes'])}."
    why = "Why it matters: an accelerator costs the same busy or idle; batching and quantization raise its output."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ys = {k: v for k, v in m.series.items() if k.endswith(")")}
    axes = dict(xlabel="batch size", ylabel="decode tokens/s", xscale="log", yscale="log")
    lines(fig, m.series["batch"], ys, title="Decode throughput, measured and projected", **axes)


LAB = Lab("gpu-economics", "GPU economics", measure, explain, plot)
