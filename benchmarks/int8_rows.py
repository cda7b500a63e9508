"""bf16 rows through int8 weights, by row count: the int8 kernel against a bf16 matmul on the widened weights.

`Int8Linear` sends bf16 rows either to the native int8 kernel (the rows quantized to int8, integer products:
`vpdpbusd`, or AMX's `TDPBSUD` from 8 rows) or, where that kernel is not built for AVX-512 VNNI and the rows
are many, to torch's bf16 matmul on the weights widened by `int8_unpack`. This times both on the first
decoder layer's int8 linear layers of the model (for Gemma 3 270M: q/k/v, o, gate/up, down), at each row
count, called in turn (`alternated`), medians; on a CPU with AMX also the kernel with AMX switched off (the
`vpdpbusd` blocks an AVX-512 CPU without AMX runs). The JSON gives milliseconds, multiply-adds per second
and widened / kernel per row count.

    .venv/bin/python -m benchmarks.int8_rows
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python -m benchmarks.int8_rows

The second line keeps oneDNN (torch's bf16 matmul) off AMX-BF16 as well: with the kernel's AMX off too, a
Xeon with AMX computes as a CPU with AVX512_BF16 and VNNI but no AMX would (the run records the cap).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import OUT_HELP, alternated, machine, record_run
from inferd.config import DEFAULT_MODEL
from inferd.engine.engine import LLM
from inferd.models.quant import Int8Linear


def first_layer_linears(llm: LLM) -> dict[str, Int8Linear]:
    """The first decoder layer's int8 linear layers with the native kernel, by name."""
    found = {
        name.rsplit(".", 1)[-1]: m
        for name, m in llm.engine.model.named_modules()
        if ".layers.0." in name and isinstance(m, Int8Linear) and m.native is not None
    }
    if not found:
        raise SystemExit("no int8 layer on the native kernel: this needs --quantization int8 (the default) on CPU")
    return found


def paths(layers: dict[str, Int8Linear], rows: int) -> dict:
    """name -> a function running every layer once on `rows` random bf16 rows, one way."""
    torch.manual_seed(rows)
    xs = {n: torch.randn(rows, m.in_features).bfloat16() for n, m in layers.items()}
    native = next(iter(layers.values())).native
    widened = {n: m._widened(torch.bfloat16, scaled=True) for n, m in layers.items()}

    def kernel():
        for n, m in layers.items():
            native.int8_linear(xs[n], m.packed, m.scale, m.bias)

    def kernel_no_amx():
        native.set_amx(False)
        try:
            kernel()
        finally:
            native.set_amx(True)

    def dense():  # as Int8Linear._forward_rows: the weights widened on every call, then the matmul
        for n, m in layers.items():
            F.linear(xs[n], m._widened(torch.bfloat16, scaled=True), None if m.bias is None else m.bias.bfloat16())

    def matmul_only():  # the matmul alone, on weights widened beforehand
        for n, m in layers.items():
            F.linear(xs[n], widened[n], None if m.bias is None else m.bias.bfloat16())

    fns = {"kernel": kernel}
    if hasattr(native, "set_amx") and native.isa().endswith("+amx"):
        fns["kernel_no_amx"] = kernel_no_amx
    return fns | {"widened": dense, "matmul_only": matmul_only}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,512", help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=256, max_num_seqs=1, num_blocks=16, dtype="bfloat16", quantization="int8")
    layers = first_layer_linears(llm)
    native = next(iter(layers.values())).native
    macs_per_row = sum(m.in_features * m.out_features for m in layers.values())
    levels = []
    for rows in [int(r) for r in args.rows.split(",")]:
        ms = alternated(paths(layers, rows), args.repeats)
        level = {
            "rows": rows,
            "ms": ms,
            "gmac_per_s": {k: rows * macs_per_row / v / 1e6 for k, v in ms.items()},
            "widened_over_kernel": ms["widened"] / ms["kernel"],
        }
        if "kernel_no_amx" in ms:
            level["widened_over_kernel_no_amx"] = ms["widened"] / ms["kernel_no_amx"]
        levels.append(level)
        shown = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
        print(f"{rows:4d} rows: {shown}; widened / kernel {level['widened_over_kernel']:.2f}x", flush=True)
    result = {
        "model": args.model,
        "machine": machine(),
        "kernel_isa": native.isa(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
        "layers": {n: [m.out_features, m.in_features] for n, m in layers.items()},
        "repeats": args.repeats,
        "levels": levels,
    }
    path = record_run("int8_rows", result, sys.argv, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
