"""The KV cache's dtype (`--kv-cache-dtype`): what each holds and what it costs or saves a decode step.

The model runs in `--dtype auto` (bf16 where the CPU has native bf16, float32 elsewhere); its queries stay in
that dtype. The caches compared: the model's dtype (`auto`), bf16 under a float32 model (half its bytes,
widened as read), and fp8 (e4m3, e5m2).
1. Capacity: the tokens the default 2 GiB KV cache holds for each cache dtype (the engine's own block size).
2. The decode attention kernel alone: Gemma 3 270M's 18 layers (4 query heads on one KV head, head_dim 256),
   a batch of 32 requests of each `--lengths` tokens, every cache holding the same values, alternated, medians
   of `--repeats`; with the bytes each reads per second.
3. A whole decode step at batch 32: engines with each cache in one process, each filled with the same 32
   requests (prompts 32-512 tokens), their steps alternated, medians of `--repeats`.

    .venv/bin/python benchmarks/kv_cache_dtype.py   # a run in results/kv_cache_dtype-<kind>.json
    .venv/bin/python benchmarks/kv_cache_dtype.py --lengths 268 --repeats 5 --quantization none
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find benchmarks.common
from benchmarks.common import alternated, kernel_args, machine, record_run  # noqa: E402
from benchmarks.offline_throughput import fill_decode_batch, make_workload  # noqa: E402
from inferd import LLM  # noqa: E402
from inferd.engine.runner import ModelRunner  # noqa: E402
from inferd.models import cpu_kernels  # noqa: E402
from inferd.models.attention import to_cache  # noqa: E402
from inferd.models.dtypes import KV_CACHE_DTYPES  # noqa: E402

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def caches_for(dtype: torch.dtype) -> dict[str, tuple[dict, torch.dtype]]:
    """name -> (engine settings, storage dtype) of each cache compared for a model in `dtype`: its own first."""
    caches = {NAMES[dtype]: ({"dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": "auto"}, dtype)}
    if dtype == torch.float32:
        caches["bf16"] = ({"kv_cache_dtype": "bfloat16"}, torch.bfloat16)
    return caches | {name: ({"kv_cache_dtype": name}, KV_CACHE_DTYPES[name]) for name in ("fp8_e4m3", "fp8_e5m2")}


def capacity(llm: LLM, caches: dict, memory: int = 2 * 1024**3) -> dict[str, int]:
    engine = llm.engine
    block = engine.kv.block_size
    return {
        name: memory // ModelRunner.bytes_per_block(engine.model, block, dtype) * block
        for name, (_, dtype) in caches.items()
    }


def decode_kernel(
    length: int, repeats: int, qdtype: torch.dtype, caches: dict, batch: int = 32, layers: int = 18, heads: int = 4,
    head_dim: int = 256,
):  # fmt: skip
    kernel = cpu_kernels.paged_decode_kernel()
    g = torch.Generator().manual_seed(length)
    bs = 16
    per_request = -(-length // bs)
    num_blocks = batch * per_request + 4
    shape = (num_blocks, bs, 1, head_dim)
    values = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)]
    stored = {
        name: [(to_cache(k, dtype), to_cache(v, dtype)) for k, v in values] for name, (_, dtype) in caches.items()
    }
    q = torch.randn(batch, heads, head_dim, generator=g).to(qdtype)
    tables = torch.randperm(num_blocks, generator=g)[: batch * per_request].view(batch, per_request)
    lens = torch.full((batch,), length)
    scale = head_dim**-0.5

    def run(name: str) -> None:
        for k, v in stored[name]:
            kernel(q, k, v, tables, lens, scale, 0, 0.0)

    ms = alternated({name: (lambda n=name: run(n)) for name in caches}, repeats)
    read = {name: 2 * batch * length * layers * head_dim * dtype.itemsize for name, (_, dtype) in caches.items()}
    own = NAMES[qdtype]
    return {
        "tokens": length,
        "batch": batch,
        "layers": layers,
        "queries": own,
        "ms": ms,
        "read_gbs": {name: read[name] / ms[name] / 1e6 for name in ms},
        f"speedup_over_{own}": {name: ms[own] / ms[name] for name in ms},
    }


def decode_step(repeats: int, quantization: str | None, caches: dict, batch: int = 32) -> dict:
    prompts, _ = make_workload(batch, seed=0)
    engines = {}
    for name, (settings, _) in caches.items():
        engine = LLM(quantization=quantization, max_model_len=1024, max_num_seqs=batch, **settings).engine
        engines[name] = (engine, fill_decode_batch(engine, prompts, max_tokens=4 * repeats + 8))
    ms = alternated({name: e.step for name, (e, _) in engines.items()}, repeats)
    for engine, ids in engines.values():
        for rid in ids:
            engine.abort(rid)
    own = next(iter(caches))
    return {"batch": batch, "prompt_tokens": sum(map(len, prompts)), "ms": ms,
            f"speedup_over_{own}": {name: ms[own] / ms[name] for name in ms}}  # fmt: skip


def main() -> int:
    args = kernel_args(__doc__, [64, 268, 1000])
    if cpu_kernels.paged_decode_kernel() is None:
        print("the native decode kernel did not build: nothing to compare", file=sys.stderr)
        return 1
    quantization = args.quantization
    llm = LLM(quantization=quantization)
    qdtype = llm.engine.dtype
    caches = caches_for(qdtype)
    tokens = capacity(llm, caches)
    del llm
    print("tokens in 2 GiB: " + ", ".join(f"{k} {v}" for k, v in tokens.items()))
    kernel = [decode_kernel(n, args.repeats, qdtype, caches) for n in args.lengths]
    for r in kernel:
        print(f"decode attention, 32 x {r['tokens']} tokens, 18 layers: "
              + ", ".join(f"{k} {v:.2f} ms ({r['read_gbs'][k]:.1f} GB/s)" for k, v in r["ms"].items()))  # fmt: skip
    step = decode_step(args.repeats, quantization, caches)
    print("decode step, batch 32: " + ", ".join(f"{k} {v:.1f} ms" for k, v in step["ms"].items()))
    record_run(
        "kv_cache_dtype",
        {
            "machine": machine(),
            "quantization": quantization,
            "dtype": NAMES[qdtype],
            "repeats": args.repeats,
            "tokens_in_2gib": tokens,
            "decode_kernel": kernel,
            "decode_step": step,
        },
        sys.argv,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
