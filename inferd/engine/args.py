"""Engine settings as command-line flags, shared by `inferd generate`, `inferd serve` and benchmarks."""

from __future__ import annotations

import argparse

from inferd.config import DEFAULT_MODEL, parse_memory
from inferd.engine.engine import make_engine_config


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="default alias, Hugging Face folder, .gguf file or hub id")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1 ...")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's, <= 8192)")
    g.add_argument("--kv-cache-memory", default="2GiB", help="memory for the KV cache, e.g. 2GiB or 512MiB")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, help="cap on one prefill chunk (0: none)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    g.add_argument("--cpu-linear", default="onednn", choices=["onednn", "dense"], help="fp32 matmul backend on CPU")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu-kernel", "torch"],
        help="decode attention: native CPU kernel where it builds (auto), or the PyTorch reference",
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: one per core)")


def engine_config_from_args(args: argparse.Namespace, **extra):
    return make_engine_config(
        args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_threads=args.num_threads,
        cpu_linear=args.cpu_linear,
        attention_backend=args.attention_backend,
        kv_cache_memory=parse_memory(args.kv_cache_memory),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=not args.no_prefix_caching,
        **extra,
    )
