"""Native CPU kernels, compiled on first use with torch's C++ extension builder (g++ and ninja).

The build is cached per CPU, source and the headers of `kernels/` (it is compiled with -march=native, which
also picks the int8/int4 kernels' instruction set: AVX-512 VNNI, AVX2 or portable), so only the first start
on a machine pays the ~1 minute compile. If anything about the build fails, inferd logs why and falls
back to the PyTorch reference path, which gives the same results, only slower (int4, which has none, is
then a ConfigError).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from inferd.cpu import compiler_flags

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "paged_decode_cpu.cpp"
_INT8_SOURCE = Path(__file__).parent / "kernels" / "int8_linear_cpu.cpp"
_INT4_SOURCE = Path(__file__).parent / "kernels" / "int4_linear_cpu.cpp"
_NORM_SOURCE = Path(__file__).parent / "kernels" / "norm_rope_cpu.cpp"
_PREFILL_SOURCE = Path(__file__).parent / "kernels" / "prefill_attention_cpu.cpp"
_LORA_SOURCE = Path(__file__).parent / "kernels" / "lora_cpu.cpp"
_GGUF_SOURCE = Path(__file__).parent / "kernels" / "gguf_linear_cpu.cpp"


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    return hashlib.sha256((flags + model).encode()).hexdigest()[:10]


def _source_hash(source: Path, flags: Sequence[str] = ()) -> str:
    """In the module's name, so two checkouts with different kernel sources (or headers in the kernels'
    folder, which every build may include, or compiler flags) never load each other's build."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:10]


def _toolchain() -> str:
    """What else torch writes into an extension's build arguments: its version and its headers' folder, and
    Python's. In the module's name too, so two environments on one machine (a checkout's and a CI clone's)
    with the same sources each keep their own build, rather than rebuilding one module in turn."""
    import sysconfig

    import torch

    return f"{torch.__version__} {Path(torch.__file__).parent} {sysconfig.get_paths()['include']}"


@contextlib.contextmanager
def _build_lock(name: str):
    """One build of `name` at a time across processes, held with flock so the OS releases it when its holder
    dies. torch's own lock is a plain file that a killed build (Ctrl-C, a test killing a starting server)
    leaves behind, and every later start would wait on it; under our lock no live build can hold torch's,
    so a leftover one is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    with open(folder.parent / f"{name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if (folder / "lock").exists():
            logger.warning("removing a kernel build lock left by a build that died: %s", folder / "lock")
            (folder / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def _paged_decode_module():
    return _build("inferd_paged_decode", _SOURCE, "CPU paged attention kernel")


def paged_decode_kernel() -> Callable | None:
    """The compiled `paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)`."""
    module = _paged_decode_module()
    return None if module is None else module.paged_decode


def paged_decode_threads() -> int:
    """How many threads the kernel's work split reaches (torch's thread count when it was built with OpenMP)."""
    module = _paged_decode_module()
    return 0 if module is None else module.parallel_threads()


@functools.cache
def _prefill_attention_module():
    return _build("inferd_prefill_attention", _PREFILL_SOURCE, "CPU prefill attention kernel (AMX-BF16, AVX512_BF16)")


def prefill_attention_kernel() -> Callable | None:
    """The compiled `prefill_attention(q, k_cache, v_cache, block_table, context_len, scale, window, softcap,
    out)` (bfloat16, writes out), or None where the CPU has neither AMX-BF16 (granted by the OS) nor AVX512_BF16,
    or the build failed. The module's `isa()` says which its products run on."""
    module = _prefill_attention_module()
    return module.prefill_attention if module is not None and module.available() else None


def prefill_attention_isa() -> str:
    """What the prefill kernel's products run on here: `amx-bf16`, `avx512-bf16`, or `none` (SDPA stays)."""
    module = _prefill_attention_module()
    return "none" if module is None else module.isa()


@functools.cache
def int8_module():
    """The compiled int8 module: `int8_pack(q)` (the tiled layout), `int8_linear(x, packed, scale, bias)`,
    `int8_unpack(packed, N, K, dtype)` and `isa()`, the instruction set it was built for."""
    return _build("inferd_int8_linear", _INT8_SOURCE, "CPU int8 linear kernel")


@functools.cache
def int4_kernels():
    """The compiled int4 module: `int4_linear` (few rows), `int4_linear_chunked` (many), `int4_dequantize`,
    `isa()`."""
    return _build("inferd_int4_linear", _INT4_SOURCE, "CPU int4 linear kernel")


@functools.cache
def gguf_module():
    """The compiled GGUF module: `gguf_pack(blocks, type, K)` (a segment's rows as tiles: codes, a, b, s),
    `gguf_linear(x, tiles, types, rows, bias)`, `gguf_dequantize(blocks, type, K, lo, hi)`, `gguf_unpack(tiles,
    type, K, lo, hi)`, `isa()`. No fused multiply-add outside its intrinsics: the dequantizers round as the `gguf`
    package does."""
    return _build("inferd_gguf_linear", _GGUF_SOURCE, "CPU GGUF block kernel", ["-ffp-contract=off"])


@functools.cache
def _norm_rope_module():
    # no fused multiply-add: the reference rounds each product before the sum. -fno-trapping-math lets GCC
    # vectorise exp_approx's clamp (std::min/max) where the CPU has no masked vector ops: without it, on AVX2
    # the gated activations ran one element at a time, several times slower for the same bits (AVX-512's masks
    # vectorised it anyway). It changes no value, only which code may be used.
    flags = ["-ffp-contract=off", "-fno-trapping-math"]
    return _build("inferd_norm_rope", _NORM_SOURCE, "CPU RMS norm and rotary kernels", flags)


def named_in_profiles(name: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) for a native call, inside a profiler range named `name` only while a profiler runs:
    entering `record_function` costs ~50 us, a millisecond per decode step of an 18-layer model at batch 1 (and
    an empty context manager ~0.5 us, on ~100 calls a step)."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


@functools.cache
def _named(name: str) -> Callable | None:
    """The small kernel `name` of the norm/rotary module, named `inferd::<name>` in profiles (so a profile tells
    these kernels from the Python around them; one object per kernel), or None where the module does not build."""
    module = _norm_rope_module()
    return None if module is None else functools.partial(named_in_profiles, f"inferd::{name}", getattr(module, name))


def rms_norm_kernel() -> Callable | None:
    """The compiled `rms_norm(x, weight, eps, unit_offset)` (float32 or bfloat16, weight in x's dtype)."""
    return _named("rms_norm")


def add_rms_norm_kernel() -> Callable | None:
    """The compiled `add_rms_norm(x, h, norm1, norm2, eps, unit_offset) -> [x + norm1(h), norm2(that)]` (weights
    in x's dtype; an empty norm1 adds h as is, an empty norm2 gives an empty second tensor)."""
    return _named("add_rms_norm")


def qk_norm_rope_kernel() -> Callable | None:
    """The compiled `qk_norm_rope(qkv, heads, kv_heads, head_dim, cos, sin, q_weight, k_weight, unit_offset,
    eps[, k_cache, v_cache, slots]) -> [q, k]` (weights empty for no norm; everything in qkv's dtype): given
    the caches (in qkv's dtype or bfloat16) and the tokens' slots, k and v are also written there."""
    return _named("qk_norm_rope")


#: activations the native gated_act computes, by their config name -> the kernel's code
GATED_ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


def gated_act_kernel(act: str) -> Callable | None:
    """`f(gate_up [tokens, 2 * inter], inter) -> act(gate) * up` for a config's activation name, or None where
    the kernel does not build or does not know the activation (exact GELU stays on the reference)."""
    kernel = _named("gated_act")
    if kernel is None or act not in GATED_ACTS:
        return None
    code = GATED_ACTS[act]
    return lambda gate_up, inter: kernel(gate_up, inter, code)


def argmax_update_kernel() -> Callable | None:
    """The compiled `argmax_update(logits [rows, n], best_val fp32 [rows], best_idx int64 [rows], offset)`."""
    return _named("argmax_update")


@functools.cache
def _lora_module():
    return _build("inferd_lora", _LORA_SOURCE, "CPU LoRA kernel")


def lora_kernel() -> Callable | None:
    """The compiled `lora_add(y, x, a_parts, b_parts, offsets, slots, rank)` (inferd/models/lora.py)."""
    module = _lora_module()
    return None if module is None else module.lora_add


def build_all() -> dict[str, bool]:
    """Compile (or load from the cache) every native kernel now, and say which are available. A process that
    starts servers (the tests, a benchmark) calls it first: a server's first start on a new machine otherwise
    spends minutes of its start-up compiling on 2 cores, and the builds of several starting servers queue on
    one lock. Each build is one compiler process, so they run side by side, one per core."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        built = {name: pool.submit(build) for name, build in MODULES.items()}
        return {name: future.result() is not None for name, future in built.items()}


#: every native module by its short name -> the function that builds (or loads) it, None where it failed
MODULES: dict[str, Callable] = {
    "paged_decode": _paged_decode_module,
    "int8_linear": int8_module,
    "int4_linear": int4_kernels,
    "norm_rope": _norm_rope_module,
    "prefill_attention": _prefill_attention_module,
    "lora": _lora_module,
    "gguf_linear": gguf_module,
}


def _stable_copy(source: Path, name: str) -> Path:
    """The source, and the headers of its folder, at paths that depend only on their content: torch rebuilds
    an extension whose build arguments name other source or include paths, so two checkouts of the same
    kernel would otherwise rebuild it in turn. The headers go to a folder of this build's own (its name
    hashes them), so a checkout with other headers never compiles against these."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False)).parent
    target = folder / f"{name}.cpp"
    includes = folder / f"{name}.include"
    includes.mkdir(exist_ok=True)
    for src, dst in [(source, target), *((h, includes / h.name) for h in source.parent.glob("*.h"))]:
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
            tmp.write_bytes(src.read_bytes())
            os.replace(tmp, dst)
    return target


def _build_name(prefix: str, source: Path, flags: Sequence[str]) -> str:
    """The module's name: the CPU, the sources and flags, and the toolchain (one build per environment)."""
    return f"{prefix}_{_cpu_fingerprint()}_{_source_hash(source, [*flags, _toolchain()])}"


#: why each native module that did not build is missing, by its name in MODULES (`inferd doctor` shows it)
BUILD_ERRORS: dict[str, str] = {}


def _first_error(e: Exception) -> str:
    """The compiler's first `error:` line (a failed build's message holds the whole log), else the message."""
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {next((line.strip() for line in lines if 'error:' in line), lines[0])}"[:400]


def _build(prefix: str, source: Path, what: str, cflags: list[str] | None = None):
    if os.environ.get("INFERD_DISABLE_CPU_KERNELS"):
        BUILD_ERRORS[prefix.removeprefix("inferd_")] = "disabled by INFERD_DISABLE_CPU_KERNELS"
        return None
    try:
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-march=native", *compiler_flags(), "-fopenmp", *(cflags or [])]
        name = _build_name(prefix, source, flags)
        with _build_lock(name):
            copy = _stable_copy(source, name)
            return load(
                name=name,
                sources=[str(copy)],
                extra_include_paths=[str(copy.with_suffix(".include"))],  # shared headers (quantized_common.h)
                # -fopenmp: at::parallel_for is inline OpenMP; without the flag it runs on one thread.
                # The library links libgomp.so.1, the soname torch loads already, so one runtime serves both.
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, odd platform: the reference path still works
        BUILD_ERRORS[prefix.removeprefix("inferd_")] = _first_error(e)
        logger.warning("%s unavailable (%s); using the PyTorch reference", what, e)
        return None
