"""GPU economics: how busy batching keeps the hardware (utilisation vs batch size, measured here), the same
model projected onto GPU profiles by the roofline (labelled as projections), and which precision modes
inferd offers."""

from __future__ import annotations

from dataclasses import fields

from inferd.config import EngineConfig
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext

DEFINITION = (
    "accelerators are the dominant cost. Utilization (keeping the GPU busy with useful batched work), quantization "
    "(lower-precision weights, so more fits per GPU and faster decode), and batching all change "
    "cost-per-million-tokens."
)
# datasheet figures (dense, no sparsity): bf16 FLOP/s and memory bytes/s
GPU_PROFILES = {
    "H100 SXM": {"flops": 989e12, "bandwidth": 3.35e12},
    "L4": {"flops": 121e12, "bandwidth": 0.30e12},
}
HEADLINE = "H100 SXM"


def precision_modes() -> list[str]:
    """The --dtype choices this inferd has (quantized modes appear here when they exist)."""
    meta = next(f.metadata for f in fields(EngineConfig) if f.name == "dtype")
    return [c for c in meta["choices"] if c != "auto"]


def measure(ctx: LabContext) -> Measurement:
    from inferd.labs import decode

    dm = ctx.measurements.get("decode")
    if dm is None:
        dm = ctx.measurements["decode"] = decode.measure(ctx)
    facts, hw = ctx.facts(), ctx.hardware()
    batches = dm.series["batch"]
    context = dm.settings["prompt_len"] + dm.settings["output_len"] // 2
    util = [100 * t * 1e12 / hw.matmul_flops for t in dm.series["tflops"]]
    m = Measurement(settings={"modes": precision_modes(), "profiles": GPU_PROFILES, "context": context})
    m.series = {"batch": batches, "util_pct": util, "tok_s": dm.series["tok_s"]}
    for name, p in GPU_PROFILES.items():
        steps = [facts.roofline_step_s(b, context, p["flops"], p["bandwidth"], 2) for b in batches]  # bf16
        m.series[f"{name} tok_s"] = [b / s for b, s in zip(batches, steps, strict=True)]
    g = GPU_PROFILES[HEADLINE]
    lo, hi = batches[0], batches[-1]
    bytes_tok = facts.kv_bytes_read(context) * 2 / facts.kv_elem_bytes
    flops_tok = facts.flops_per_token(context)
    # the batch at which the projected step stops being bandwidth-bound: b*flops/F = (W + b*kv)/B
    denom = flops_tok / g["flops"] - bytes_tok / g["bandwidth"]
    weights_bf16 = (facts.body_params + facts.lm_head_params) * 2
    m.numbers.update(
        b_lo=lo,
        b_hi=hi,
        util_lo=util[0],
        util_hi=util[-1],
        tok_s_lo=dm.series["tok_s"][0],
        tok_s_hi=dm.series["tok_s"][-1],
        gpu_tok_s_lo=m.series[f"{HEADLINE} tok_s"][0],
        gpu_tok_s_hi=m.series[f"{HEADLINE} tok_s"][-1],
        gpu_mem_ms_b1=weights_bf16 / g["bandwidth"] * 1000,
        gpu_flops_ms_b1=flops_tok / g["flops"] * 1000,
        gpu_ridge_batch=(weights_bf16 / g["bandwidth"]) / denom if denom > 0 else -1.0,  # -1: never
    )
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "util_hi > util_lo",
            yes="Measured here: decode used {util_lo}% of this machine's matmul peak at batch {b_lo} and {util_hi}% "
            "at batch {b_hi} ({tok_s_lo} to {tok_s_hi} tokens/s): the same hardware and the same hour, more "
            "useful work.",
            no="Measured here: decode used {util_lo}% of the matmul peak at batch {b_lo} and {util_hi}% at "
            "batch {b_hi}: batching did not raise utilisation.",
        ),
        m.decide(
            "gpu_mem_ms_b1 > gpu_flops_ms_b1",
            yes="Projected, not measured: on an H100 SXM (datasheet: 989 TFLOP/s bf16, 3.35 TB/s) a batch-1 step "
            "of this model in bf16 needs {gpu_mem_ms_b1} ms to read the weights but {gpu_flops_ms_b1} ms of "
            "compute, so one stream leaves the GPU's compute almost idle. Projected decode throughput: "
            "{gpu_tok_s_lo} tokens/s at batch {b_lo}, {gpu_tok_s_hi} at batch {b_hi}.",
            no="Projected, not measured: on an H100 SXM a batch-1 step of this model needs {gpu_mem_ms_b1} ms of "
            "reads and {gpu_flops_ms_b1} ms of compute: compute-bound even at batch 1.",
        ),
        m.decide(
            "gpu_ridge_batch > 0",
            yes="By the same roofline, batching keeps paying until a batch of about {gpu_ridge_batch}, where the "
            "step turns compute-bound.",
            no="By the same roofline this model never turns compute-bound ({gpu_ridge_batch}: no such batch): each "
            "request's KV-cache reads grow as fast as its FLOPs, so the step stays bandwidth-bound at any batch.",
        ),
    ]
    intro = [
        "Utilisation here is the FLOP/s a decode step achieves over the FLOP/s a large matmul reaches on the "
        "same hardware (measured in the decode lab). The GPU figures are roofline projections from datasheet "
        "numbers, ideal kernels and no overheads: an upper bound, labelled as such.",
        f"Quantization: inferd's precision modes are --dtype {', '.join(m.settings['modes'])}. Lower precision "
        "halves (bf16) or quarters (int8) the bytes each decode step reads, which is what single-stream decode "
        "speed follows, and frees memory for KV cache.",
    ]
    why = [
        "Why it matters: an accelerator costs the same per hour busy or idle. Batching raises the useful work "
        "per hour, quantization cuts the bytes per token, and both lower cost per million tokens (next lab)."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2)
    s = m.series
    a.plot(s["batch"], s["util_pct"], "o-")
    a.set(
        xlabel="batch size", ylabel="% of measured matmul peak", title="Utilisation vs batch (measured)", xscale="log"
    )
    b.plot(s["batch"], s["tok_s"], "o-", label="this machine (measured)")
    for name in GPU_PROFILES:
        b.plot(s["batch"], s[f"{name} tok_s"], "--", label=f"{name} (projected, roofline)")
    b.set(xlabel="batch size", ylabel="decode tokens/s", title="Decode throughput", xscale="log", yscale="log")
    b.legend()


LAB = Lab("gpu-economics", "GPU economics", DEFINITION, measure, explain, plot)
