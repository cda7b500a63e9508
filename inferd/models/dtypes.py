"""Which dtype a model runs in: `--dtype auto` picks bf16 where the hardware computes it natively.

On a CPU with AVX512_BF16 or AMX-BF16 a bf16 matmul runs several times faster than fp32 (and the weights
and the KV cache take half the bytes); on an AVX2-only CPU bf16 is emulated and far slower than fp32, so
`auto` stays in fp32 there. On CUDA `auto` is bf16 where the GPU supports it, else fp16.

The CPU's flags come from `cpu_flags()` (`inferd.cpu`: Linux /proc/cpuinfo, read once); tests replace it
here to check the choice for another CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inferd.cpu import cpu_flags
from inferd.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: --kv-cache-dtype, vLLM's names: "fp8" is e4m3 (3 mantissa bits, up to 448), e5m2 has the range (57344)
KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
NATIVE_FP16_FLAGS = ("amx_fp16", "avx512_fp16")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in, and why (logged at start, shown on the server's /v1/models)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and the evidence."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, "the GPU supports bf16" if ok else "the GPU has no bf16"
    if device.type != "cpu":
        return False, f"no bf16 check for {device.type}"
    flags = cpu_flags()
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return True, f"the CPU has {', '.join(found)}"
    return False, f"the CPU has none of {', '.join(NATIVE_BF16_FLAGS)}"


def resolve_dtype(name: str, device: torch.device) -> DtypeChoice:
    """'auto' or a dtype name -> the dtype to run in; warns when bf16/fp16 would be emulated on this CPU."""
    if name == "auto":
        ok, why = native_bf16(device)
        if ok:
            return DtypeChoice(torch.bfloat16, f"auto: {why}")
        if device.type == "cuda":
            return DtypeChoice(torch.float16, f"auto: {why}")
        return DtypeChoice(torch.float32, f"auto: {why}")
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    dtype = DTYPES[name]
    if dtype == torch.bfloat16:
        ok, why = native_bf16(device)
        if not ok:
            logger.warning("dtype bfloat16 asked for, but %s: bf16 is emulated and much slower than float32", why)
    if dtype == torch.float16 and device.type == "cpu" and not any(f in cpu_flags() for f in NATIVE_FP16_FLAGS):
        logger.warning("dtype float16 on a CPU without %s: emulated, much slower than float32", NATIVE_FP16_FLAGS)
    return DtypeChoice(dtype, "asked for")


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, auto_dtype: bool = False, device_type: str = "cpu"
) -> torch.dtype:
    """'auto', bfloat16 or an fp8 format -> the KV cache's storage dtype. 'auto' is the model's dtype, except
    bfloat16 under the float32 that `--dtype auto` (`auto_dtype`) chose on a CPU without native bf16.

    bfloat16 halves a float32 cache's bytes: attention widens its rows as it reads them, a shift. On a Zen 3 (AVX2)
    it held twice the tokens in the same memory, ran a batch of 32 decodes' attention 1.28-1.38x faster at 268-1000
    tokens, and scored the float32 cache's perplexity (docs/performance.md); llama.cpp keeps an f16 cache by default
    too. An asked-for `--dtype float32` keeps a float32 cache: the reference. fp8 halves a bf16
    cache's bytes (a quarter of fp32's): twice the tokens in the same memory, and half the bytes a decode step's
    attention reads. Values are stored unscaled (vLLM's default scale of 1.0), rounded to nearest and clamped to the
    format's finite range; attention widens them back to the model's dtype.
    """
    if name == "auto":
        return torch.bfloat16 if auto_dtype and dtype == torch.float32 and device_type == "cpu" else dtype
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name]
