"""Prefill attention: the native kernel (AMX-BF16 or AVX512_BF16) against torch's SDPA, one layer and a whole prefill.

1. One layer of Gemma 3 270M's attention (4 query heads on one KV head, head_dim 256, causal, bf16) at each
   prompt length: the kernel reading K/V from a paged cache against `scaled_dot_product_attention` on the
   same tensors, alternated, medians of `--repeats`.
2. A whole prefill (one request, `max_tokens=1`) through two engines in one process, `--attention-backend
   torch` (SDPA) and the default (the kernel), alternated, medians of `--repeats`.

Only where the CPU has AMX-BF16 or AVX512_BF16 (elsewhere the kernel is absent and the script says so); the run
records which the kernel took (`kernel_isa`).

    .venv/bin/python benchmarks/prefill_attention.py   # a run in results/prefill_attention-<kind>.json
    .venv/bin/python benchmarks/prefill_attention.py --lengths 128,290 --repeats 5 --quantization int8
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find benchmarks.common
from benchmarks.common import alternated, kernel_args, machine, record_run  # noqa: E402
from inferd import LLM, SamplingParams  # noqa: E402
from inferd.models import cpu_kernels  # noqa: E402


def one_layer(length: int, repeats: int, heads: int = 4, head_dim: int = 256, block_size: int = 16) -> dict:
    kernel = cpu_kernels.prefill_attention_kernel()
    g = torch.Generator().manual_seed(length)
    blocks = -(-length // block_size)
    q = torch.randn(length, heads, head_dim, generator=g).bfloat16()
    k_cache = torch.randn(blocks + 8, block_size, 1, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(blocks + 8, block_size, 1, head_dim, generator=g).bfloat16()
    table = torch.randperm(blocks + 8, generator=g)[:blocks]
    keys = k_cache[table].flatten(0, 1)[:length].transpose(0, 1)[None]
    values = v_cache[table].flatten(0, 1)[:length].transpose(0, 1)[None]
    q4 = q.transpose(0, 1)[None]
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ms = alternated(
        {
            "native": lambda: kernel(q, k_cache, v_cache, table, 0, scale, 0, 0.0, out),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q4, keys, values, is_causal=True, scale=scale, enable_gqa=True
            ),
        },
        repeats,
    )
    flops = 2 * length * length * heads * head_dim  # both products, causal half
    return {
        "tokens": length,
        "native_ms": ms["native"],
        "sdpa_ms": ms["sdpa"],
        "speedup": ms["sdpa"] / ms["native"],
        "native_gflops": flops / ms["native"] / 1e6,
        "sdpa_gflops": flops / ms["sdpa"] / 1e6,
    }


def whole_prefill(lengths: list[int], repeats: int, quantization: str | None) -> list[dict]:
    engines = {b: LLM(quantization=quantization, attention_backend=b).engine for b in ("torch", "auto")}
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(engine, n: int) -> None:
        engine.add_request(f"p{n}-{rng.random()}", [rng.randrange(1000, 200_000) for _ in range(n)], params)
        while engine.has_unfinished_requests():
            engine.step()

    rows = []
    for n in lengths:
        ms = alternated({b: (lambda e=e, n=n: prefill(e, n)) for b, e in engines.items()}, repeats)
        rows.append({"tokens": n, "sdpa_ms": ms["torch"], "native_ms": ms["auto"], "speedup": ms["torch"] / ms["auto"]})
    return rows


def main() -> int:
    args = kernel_args(__doc__, [128, 290, 460, 1024])
    if cpu_kernels.prefill_attention_kernel() is None:
        why = "this CPU has no AMX-BF16 or AVX512_BF16, or the kernel did not build"
        print(f"{why}: nothing to compare", file=sys.stderr)
        return 1
    layers = [one_layer(n, args.repeats) for n in args.lengths]
    for r in layers:
        times = f"native {r['native_ms']:.3f} ms, SDPA {r['sdpa_ms']:.3f} ms ({r['speedup']:.2f}x)"
        print(f"one layer, {r['tokens']} tokens: {times}")
    quantization = args.quantization
    prefills = whole_prefill([n for n in args.lengths if n <= 512], args.repeats, quantization)
    for r in prefills:
        times = f"native {r['native_ms']:.1f} ms, SDPA {r['sdpa_ms']:.1f} ms ({r['speedup']:.2f}x)"
        print(f"prefill, {r['tokens']} tokens: {times}")
    record_run(
        "prefill_attention",
        {
            "machine": machine(),
            "kernel_isa": cpu_kernels.prefill_attention_isa(),
            "quantization": quantization,
            "repeats": args.repeats,
            "one_layer": layers,
            "whole_prefill": prefills,
        },
        sys.argv,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
