"""`inferd doctor`: what this machine runs and why: the CPU's features, which native kernels built (or why not),
and the path each part of a step takes here.

The engine chooses kernels and dtypes at run time from the CPU's flags, and falls back to the PyTorch reference
when a kernel cannot be built. That fallback keeps inferd correct everywhere but can be several times slower,
and it is silent unless one reads the start-up log. This command says it in one place, and exits 1 when a kernel
that should be there is missing, so an image or a wheel install can check itself (`inferd doctor` in a
Dockerfile, or in a test of the installed package).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

#: the CPU features the kernels and the dtype choice look at, in the order they are shown
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8",
            "amx_bf16")  # fmt: skip


def report() -> dict:
    """Everything `inferd doctor` prints, as a plain record (`--json`)."""
    import torch

    from inferd import cpu
    from inferd.models import cpu_kernels, dtypes, huge_pages, quant
    from inferd.models.gguf_blocks import COMPACT_MAX_ROWS

    flags = cpu.cpu_flags()
    built = cpu_kernels.build_all()
    kernels = {}
    for name, ok in built.items():
        entry: dict = {"built": ok}
        module = cpu_kernels.MODULES[name]()
        if ok and hasattr(module, "isa"):
            entry["isa"] = module.isa()
        if not ok:
            entry["why"] = cpu_kernels.BUILD_ERRORS.get(name, "unknown (see the log)")
        kernels[name] = entry
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice = dtypes.resolve_dtype("auto", device)
    weights = quant.resolve_quantization("auto", device, {"Q4_K": 1})  # what a quantized GGUF gets here
    weights_path = f"{weights.name or 'the dtype'} for a quantized checkpoint (a GGUF); a float one keeps its dtype"
    prefill = kernels["prefill_attention"].get("isa") if cpu_kernels.prefill_attention_kernel() else None
    int8 = kernels["int8_linear"].get("isa")
    int4 = kernels["int4_linear"].get("isa")
    gguf = kernels["gguf_linear"].get("isa")
    paths = {
        "dtype (--dtype auto)": f"{choice.name} ({choice.reason})",
        "weights (--quantization auto)": weights_path,
        "decode attention": "native paged kernel" if built["paged_decode"] else "PyTorch reference",
        "prefill attention (bf16)": f"native kernel ({prefill})"
        if prefill
        else "PyTorch SDPA" + ("" if not built["prefill_attention"] else " (this CPU has no AMX-BF16 or AVX512_BF16)"),
        "int8 weights": f"native kernel ({int8})" if int8 else "PyTorch reference",
        "int4 weights": f"native kernel ({int4})" if int4 else "unavailable (int4 needs its native kernel)",
        "GGUF blocks (--quantization gguf)": f"native kernel ({gguf})" if gguf else "unavailable (needs its kernel)",
        f"GGUF int8 layers, 1-{COMPACT_MAX_ROWS} rows": "the file's own blocks, compact (AVX-512 VNNI)"
        if gguf and cpu_kernels.gguf_module().compact_available()
        else "int8 (the compact tiles need AVX-512 VNNI)",
        "RMS norm, rotary, gated activations": "native kernels" if built["norm_rope"] else "PyTorch reference",
        "LoRA adapters' products": "native kernel" if built["lora"] else "PyTorch matmuls",
        "quantized weights' pages": huge_pages.describe(),
    }
    if device.type == "cuda":
        paths = {
            "dtype (--dtype auto)": paths["dtype (--dtype auto)"],
            "weights (--quantization auto)": weights_path,
            "device": torch.cuda.get_device_name(),
        }
    disabled = bool(os.environ.get("INFERD_DISABLE_CPU_KERNELS"))
    missing = [name for name, entry in kernels.items() if not entry["built"]]
    return {
        "cpu": {
            "model": cpu.cpu_identity()["model"] or platform.processor() or platform.machine(),
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            "features": {f: f in flags for f in FEATURES},
            "max_isa": cpu.isa_cap(),  # INFERD_MAX_CPU_ISA: run as a lesser kind (features above it off)
        },  # fmt: skip
        "torch": {
            "version": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
            "isa": torch.backends.cpu.get_cpu_capability(),  # ATen's vector kernels: AVX512, AVX2 ...
        },
        "inferd": str(Path(__file__).parent),
        "kernels": kernels,
        "paths": paths,
        "ok": device.type == "cuda" or disabled or not missing,
        "missing": missing,
    }


def _print(found: dict) -> None:
    cpu = found["cpu"]
    print(f"CPU     {cpu['model']} ({cpu['machine']}, {cpu['cores']} cores)")
    print("        " + " ".join(f if has else f"-{f}" for f, has in cpu["features"].items()))
    if cpu["max_isa"]:
        print(f"        capped at {cpu['max_isa']} (INFERD_MAX_CPU_ISA): the features above it are off")
    torch_ = found["torch"]
    cuda = "yes" if torch_["cuda"] else "no"
    print(f"torch   {torch_['version']}, {torch_['isa']}, {torch_['threads']} threads, cuda {cuda}")
    print(f"inferd  {found['inferd']}")
    print("kernels")
    for name, entry in found["kernels"].items():
        state = f"built ({entry['isa']})" if entry["built"] and "isa" in entry else "built"
        print(f"  {name:<18} {state if entry['built'] else 'MISSING: ' + entry['why']}")
    print("paths")
    for part, path in found["paths"].items():
        print(f"  {part:<37} {path}")
    if not found["ok"]:
        print(f"native kernels missing: {', '.join(found['missing'])}; those parts run the slower PyTorch reference")


def _run(args: argparse.Namespace) -> int:
    found = report()
    if args.json:
        json.dump(found, sys.stdout, indent=2)
        print()
    else:
        _print(found)
    return 0 if found["ok"] else 1


def register(sub) -> None:
    p = sub.add_parser("doctor", help="which native kernels built on this CPU, which paths run, and why")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)
