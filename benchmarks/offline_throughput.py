"""Offline throughput: inferd's engine against Hugging Face transformers `generate` on the same prompts.

Workload: 64 requests, prompt lengths uniform in 32-512, output lengths uniform in 32-256,
ignore_eos, the default model. inferd runs them with max_num_seqs=32, in --dtype (auto by default) and
--quantization; transformers runs fp32 static batches of 32 (left padding), each batch until its longest
requested output, counting only the tokens each request asked for. Also: a decode step at batch 32 in
model FLOP/s against the machine's matmul peak, and where its time goes (`step_parts`: attention, linear
layers, LM head, other ops, and the time outside every op the profiler names).

    .venv/bin/python -m benchmarks.offline_throughput            # a run in results/offline_throughput-<kind>.json
    .venv/bin/python -m benchmarks.offline_throughput --quick    # 16 requests, for a smoke test
    .venv/bin/python -m benchmarks.offline_throughput --skip-hf --dtype bfloat16 --quantization int8 --out x.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.common import OUT_HELP, PREFIX_CACHE_RESET, machine, median_time, record_run
from inferd import LLM, SamplingParams
from inferd.config import DEFAULT_MODEL, engine_choices, engine_default
from inferd.measure.hardware import best_time, matmul_peak, memory_bandwidth
from inferd.measure.model import ModelFacts, model_facts


def make_workload(n: int, seed: int, vocab_lo: int = 1000, vocab_hi: int = 200_000):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(32, 512))])
        outputs.append(rng.randint(32, 256))
    return prompts, outputs


def run_inferd(llm: LLM, prompts, outputs) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.reset_prefix_cache()  # a run repeats the last one's prompts: none may be served from its cache
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    return {"seconds": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed}


def run_hf(folder, prompts, outputs, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    t = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch, wants = prompts[start : start + batch_size], outputs[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(wants),
                min_new_tokens=max(wants),  # ignore_eos: every sequence runs to the batch's longest request
                do_sample=False,
                pad_token_id=pad,
            )
    elapsed = time.perf_counter() - t
    counted = sum(outputs)
    return {"seconds": elapsed, "output_tokens": counted, "output_tokens_per_s": counted / elapsed}


def facts(llm: LLM) -> ModelFacts:
    """The engine's model in bytes and FLOPs: weights as stored (int8, int4 or the dtype), the KV cache in
    its own dtype."""
    engine = llm.engine
    return model_facts(engine.model, engine.dtype, engine.kv_dtype)


def fill_decode_batch(engine, prompts, max_tokens: int) -> list[str]:
    """Add one greedy request per prompt and step until every prefill is done: what follows are decode steps
    of the whole batch. Returns the request ids (to abort them after)."""
    ids = [f"decode-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    return ids


#: a step's parts by the ops the profiler names them with: the native kernels' ranges (`named_in_profiles`) and
#: torch's matmuls (float linear layers; a float LM head's vocabulary tiles count here too)
PARTS = {
    "attention": ("inferd::paged_decode_cpu",),
    "linears": ("inferd::int8_linear", "inferd::gguf_linear", "inferd::gguf_linear_dense", "inferd::int8_unpack")
    + ("inferd::gguf_linear_compact",)
    + ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise")
    + ("aten::_weight_int8pack_mm",),  # int8 layers without the native kernel
    "lm_head": ("inferd::int8_argmax",),
    # the norms, q/k norm and rotary, the gated activation and a float head's argmax: rows too few at decode
    # batches to split over threads (but the activation's, from 8 rows)
    "small_kernels": tuple(f"inferd::{k}" for k in ("rms_norm", "add_rms_norm", "qk_norm_rope", "gated_act"))
    + ("inferd::argmax_update",),
}
THREADED = ("attention", "linears", "lm_head")  # the parts whose kernels split their work over every thread


def step_parts(engine, steps: int = 5) -> tuple[dict, list[dict]]:
    """Where decode steps' time goes, from `steps` steps under torch's profiler: each part's self time
    (PARTS), the other ops the profiler records, and `unnamed`, the wall time outside every recorded op:
    Python and scheduling. Shares are of the profiled wall time (the profiler's own cost included). Also the
    step's top ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    seconds = {part: sum(ops.get(op, 0.0) for op in names) for part, names in PARTS.items()}
    named = {op for names in PARTS.values() for op in names}
    seconds["other_ops"] = sum(t for op, t in ops.items() if op not in named)
    seconds["unnamed"] = max(0.0, wall - sum(ops.values()))
    parts = {k: {"ms_per_step": 1e3 * t / steps, "share": t / wall} for k, t in seconds.items()}
    top = [
        {"op": e.key, "self_ms": e.self_cpu_time_total / 1000 / steps, "calls": e.count // steps} for e in events[:12]
    ]
    return parts, top


def second_thread_idle(parts: dict) -> float:
    """The share of a step outside the THREADED parts, when every thread but the one running Python has
    nothing to do: an upper bound, since it counts the gated activation's rows split from 8 on as idle and
    leaves out the threaded kernels' imbalance (claiming work as threads free up keeps that small)."""
    return max(0.0, 1 - sum(parts[k]["share"] for k in THREADED))


def step_peak(engine, n: int = 3072, rows: int = 512) -> tuple[str, Callable[[], float]]:
    """(what, a function measuring its FLOP/s) for the matmul the step's linear layers run: the int8 kernel on
    `rows` rows where they are int8 (its integer products outrun the dtype's matmul: twice the products an
    instruction without AMX), else an n x n matmul in the step's dtype. A peak the step's own layers cannot
    reach would read as a fraction above 1. The int8 layer is built once, measured each call."""
    from torch import nn

    from inferd.models.quant import Int8Linear

    int8 = next((m for m in engine.model.modules() if isinstance(m, Int8Linear)), None)
    if int8 is None:
        return f"{str(engine.dtype).removeprefix('torch.')} matmul", lambda: float(matmul_peak(n, engine.dtype)["peak"])
    with torch.no_grad():
        layer = Int8Linear.from_linear(nn.Linear(n, n, bias=False), int8.native)
    x = torch.randn(rows, n).to(engine.dtype)
    return "int8 kernel", lambda: 2 * rows * n * n / best_time(lambda: layer(x), engine.device, 5)


def decode_step_efficiency(llm: LLM, prompts, batch: int, rounds: int = 7) -> dict:
    """Fill the batch, finish every prefill, then time decode steps and profile one. Both ceilings are
    reported: FLOP/s against the matmul peak, and bytes read (every weight once, each request's K and V)
    against the measured memory bandwidth; a step is bound by whichever it is nearer.

    The ceilings are measured in rounds alternating with the steps (a few steps, the peak matmul, the
    bandwidth): a shared VM's speed drifts by up to 2x within minutes, and a peak measured apart from the
    steps once made a 47 ms step read as 65% of the peak in one run and 40% in another. Each round's step is
    set against that round's ceilings, and the fractions are the medians over rounds."""
    engine = llm.engine
    model = facts(llm)
    ids = fill_decode_batch(engine, prompts[:batch], max_tokens=64)
    running = list(engine.scheduler.running)
    step_flops = sum(model.flops_per_token(r.num_tokens, sampled=True) for r in running)
    kv_bytes = sum(model.kv_bytes_read(r.num_tokens) for r in running)
    step_bytes = model.weight_bytes + kv_bytes
    engine.step()  # warm-up
    path, measure_peak = step_peak(engine)  # the step's own layers set its peak
    per_round = []
    for _ in range(rounds):
        step = median_time(engine.step, runs=3, warmup=0)
        peak = measure_peak() / 1e9
        bandwidth = memory_bandwidth() / 1e9
        per_round.append(
            {
                "step_seconds": step,
                "peak_gflops": peak,
                "peak_path": path,
                "bandwidth_gbs": bandwidth,
                "fraction_of_peak": step_flops / step / 1e9 / peak,
                "fraction_of_bandwidth": step_bytes / step / 1e9 / bandwidth,
            }
        )
    seconds = statistics.median(r["step_seconds"] for r in per_round)
    parts, top = step_parts(engine)
    for rid in ids:
        engine.abort(rid)
    engine.check_idle()
    return {
        "batch": len(running),
        "step_seconds": seconds,
        "step_gflop": step_flops / 1e9,
        "gflops": step_flops / seconds / 1e9,
        "peak_gflops": statistics.median(r["peak_gflops"] for r in per_round),
        "peak_path": path,
        "fraction_of_peak": statistics.median(r["fraction_of_peak"] for r in per_round),
        "step_bytes_read": step_bytes,
        "kv_bytes_read": kv_bytes,
        "read_gbs": step_bytes / seconds / 1e9,
        "bandwidth_gbs": statistics.median(r["bandwidth_gbs"] for r in per_round),
        "fraction_of_bandwidth": statistics.median(r["fraction_of_bandwidth"] for r in per_round),
        "rounds": per_round,
        "lm_head_share_of_flops": len(running) * 2 * model.lm_head_params / step_flops,
        "parts": parts,
        "second_thread_idle": second_thread_idle(parts),
        "profile_top_ops": top,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3, help="inferd runs (the median is reported)")
    ap.add_argument("--hf-runs", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cpu-linear", default="onednn", choices=["onednn", "dense"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="inferd's dtype")
    ap.add_argument(
        "--quantization",
        default=engine_default("quantization"),
        choices=engine_choices("quantization"),
        help="inferd's weight-only quantization (default: the engine's)",
    )
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "cpu-kernel", "torch"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--quick", action="store_true", help="16 requests, one run each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.runs, args.hf_runs = 16, 1, 1

    info = machine()
    prompts, outputs = make_workload(args.num_requests, args.seed)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=2 * 1024**3,
        cpu_linear=args.cpu_linear,
    )
    run_inferd(llm, prompts[:4], [8] * 4)  # warm-up
    inferd_runs = [run_inferd(llm, prompts, outputs) for _ in range(args.runs)]
    inferd_tps = statistics.median(r["output_tokens_per_s"] for r in inferd_runs)
    decode = decode_step_efficiency(llm, prompts, args.max_num_seqs)
    result = {
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": [32, 512],
            "output_len": [32, 256],
            "total_prompt_tokens": sum(map(len, prompts)),
            "total_output_tokens": sum(outputs),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "dtype": args.dtype,
            "dtype_chosen": llm.engine.dtype_choice.name,
            "quantization": args.quantization,
            "quantization_chosen": llm.engine.quantization or "none",
            "attention_backend": args.attention_backend,
            "kv_cache_dtype": str(llm.engine.kv_dtype).removeprefix("torch."),
            "cpu_linear": args.cpu_linear,
            "prefix_cache": PREFIX_CACHE_RESET,
        },
        "machine": info,
        "matmul_peak_gflops": {
            "dtype": llm.engine.dtype_choice.name,
            "path": decode["peak_path"],
            "peak": decode["peak_gflops"],
        },
        "memory_bandwidth_gbs": decode["bandwidth_gbs"],
        "inferd": {"runs": inferd_runs, "median_output_tokens_per_s": inferd_tps},
        "decode_step_batch32": decode,
    }
    if not args.skip_hf:
        folder = llm.engine.model_folder
        del llm
        hf_runs = [run_hf(folder, prompts, outputs, args.max_num_seqs) for _ in range(args.hf_runs)]
        hf_tps = statistics.median(r["output_tokens_per_s"] for r in hf_runs)
        result["transformers"] = {"runs": hf_runs, "median_output_tokens_per_s": hf_tps}
        result["ratio_inferd_over_transformers"] = inferd_tps / hf_tps
    path = record_run("offline_throughput", result, sys.argv, args.out)
    line = f"inferd {inferd_tps:.1f} out tok/s"
    if "transformers" in result:
        hf_tps = result["transformers"]["median_output_tokens_per_s"]
        line += f" | transformers {hf_tps:.1f} | ratio {result['ratio_inferd_over_transformers']:.2f}x"
    share = decode["fraction_of_peak"]
    line += f" | decode b{decode['batch']}: {decode['step_seconds'] * 1e3:.1f} ms, {decode['gflops']:.0f} GFLOP/s"
    line += f" = {share:.0%} of the {decode['peak_path']}'s peak {decode['peak_gflops']:.0f} (paired per round)"
    line += f", {decode['read_gbs']:.1f} GB/s = {decode['fraction_of_bandwidth']:.0%} of {decode['bandwidth_gbs']:.1f}"
    print(line)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
