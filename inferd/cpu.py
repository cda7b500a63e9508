"""This CPU's feature flags, and the kind of CPU they make it for inferd's speed.

Which kernels inferd runs, and how fast, follows from a few vector features: AMX (Intel Sapphire Rapids and
later), AVX512_BF16 without AMX (AMD Zen 4 and later), or AVX2 alone (AMD Zen 3, older Intel). Benchmark
results are kept per CPU kind (`benchmarks/results/<benchmark>-<kind>.json`), since a figure from one kind
says little about another; `cpu_kind` is the one place that names a kind.

Linux only (/proc/cpuinfo); elsewhere the flags are empty and the kind is "other". No torch, no inferd
imports: the model code, the benchmarks and the load generator all read it.

`INFERD_MAX_CPU_ISA` runs this CPU as a lesser kind, as oneDNN's `ONEDNN_MAX_CPU_ISA` does for its kernels:
`avx512-bf16` (a Zen 4's or Zen 5's features: no AMX, no AVX512-FP16) or `avx2` (a Zen 3's: no AVX-512, no AVX-VNNI,
no AMX). The flags every choice reads lose the features above the cap, the native kernels are compiled without them
(`compiler_flags`), and torch's own kernels are capped too (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`, set on
`import inferd` unless already set), so one machine runs, and tests, the code paths of the kinds below its own.
Results files are kept per real kind, so a benchmark refuses to file a capped run there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

# the vector features that decide a CPU's speed here, as /proc/cpuinfo names them
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# the kinds results are kept under, fastest path first: (kind, what it means)
KINDS = {
    "xeon-amx": "AMX tiles (Intel Xeon, Sapphire Rapids and later)",
    "zen5": "AMD Zen 5: AVX-512 with AVX512_BF16 and VNNI, no AMX",
    "avx512-bf16": "AVX-512 with AVX512_BF16, no AMX, not a Zen 5 (an AMD Zen 4, or a CPU whose family is not known)",
    "zen3": "AMD Zen 3: AVX2 only, no AVX-512, no native bf16",
    "avx2": "AVX2 only, no AVX-512, no native bf16 (not a Zen 3, or its family is not known)",
    "other": "no AVX2, or not an x86 CPU",
}
_AMD = "AuthenticAMD"
_ZEN5_FAMILY = 26  # 0x1a
_ZEN3_ZEN4_FAMILY = 25  # 0x19: Zen 3, and Zen 4 (which has AVX-512)

MAX_ISA_ENV = "INFERD_MAX_CPU_ISA"


@dataclass(frozen=True)
class IsaCap:
    """What `INFERD_MAX_CPU_ISA=<name>` takes away: flags (by prefix), the compiler's features, torch's ISA."""

    dropped: tuple[str, ...]  # prefixes of the /proc/cpuinfo flags above the cap
    compiler: tuple[str, ...]  # GCC switches after -march=native (GCC 12 drops no AMX feature with amx-tile)
    onednn: str  # ONEDNN_MAX_CPU_ISA
    aten: str  # ATEN_CPU_CAPABILITY


_NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
ISA_CAPS = {
    "avx512-bf16": IsaCap(("amx", "avx512_fp16"), (*_NO_AMX, "-mno-avx512fp16"), "AVX512_CORE_BF16", "avx512"),
    "avx2": IsaCap(("amx", "avx512", "avx_vnni"), (*_NO_AMX, "-mno-avx512f", "-mno-avxvnni"), "AVX2", "avx2"),
}


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(info: str, *names: str) -> str:
    line = next((line for line in info.splitlines() if line.startswith(names)), "")
    return line.partition(":")[2].strip()


@functools.cache
def native_cpu_flags() -> frozenset[str]:
    """The CPU's own feature flags (e.g. 'avx2', 'avx512_bf16'); empty where /proc/cpuinfo is not there."""
    return frozenset(_field(_cpuinfo(), "flags", "Features").split())


def isa_cap() -> str | None:
    """The name of the cap `INFERD_MAX_CPU_ISA` sets (a key of ISA_CAPS), None where it is unset."""
    name = os.environ.get(MAX_ISA_ENV, "").strip().lower()
    if not name:
        return None
    if name not in ISA_CAPS:
        raise ValueError(f"{MAX_ISA_ENV}={name!r}: expected one of {', '.join(ISA_CAPS)} (or unset)")
    return name


def cpu_flags() -> frozenset[str]:
    """The feature flags inferd chooses by: the CPU's own, less those above `INFERD_MAX_CPU_ISA`."""
    cap = isa_cap()
    return _capped(native_cpu_flags(), cap) if cap else native_cpu_flags()


@functools.cache
def _capped(flags: frozenset[str], cap: str) -> frozenset[str]:
    return frozenset(f for f in flags if not f.startswith(ISA_CAPS[cap].dropped))


def compiler_flags() -> list[str]:
    """What the native kernels' compiler takes after -march=native: the cap's switches, if any, and
    `-DINFERD_AMD` on an AMD CPU, whose weight streams prefetch with another hint (quantized_common.h)."""
    cap = isa_cap()
    vendor = ["-DINFERD_AMD"] if cpu_identity()["vendor"] == _AMD else []
    return [*(ISA_CAPS[cap].compiler if cap else ()), *vendor]


def cap_torch() -> None:
    """Give torch's own kernels the cap (oneDNN's matmuls, ATen's vector kernels): both read their variable once,
    at their first use, so this runs on `import inferd`; a variable set by hand is left as it is."""
    cap = isa_cap()
    if cap:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ISA_CAPS[cap].onednn)
        os.environ.setdefault("ATEN_CPU_CAPABILITY", ISA_CAPS[cap].aten)


@functools.cache
def cpu_identity() -> dict:
    """The CPU's model name, vendor and family (None where not known)."""
    info = _cpuinfo()
    family = _field(info, "cpu family")
    return {
        "model": _field(info, "model name") or None,
        "vendor": _field(info, "vendor_id") or None,
        "family": int(family) if family.isdigit() else None,
    }


def cpu_kind(flags=None, vendor: str | None = None, family: int | None = None) -> str:
    """The kind of CPU for inferd's kernels (a key of KINDS): this one's, or that of the flags, vendor and
    family given (a stored record's; a vendor or family not known names the kind by its features alone)."""
    if flags is None:
        flags, ident = cpu_flags(), cpu_identity()
        vendor, family = ident["vendor"], ident["family"]
    have = set(flags)
    core = amd_core(have, vendor, family)
    if {"amx_tile", "amx_bf16"} & have:
        return "xeon-amx"
    if "avx512_bf16" in have:
        return "zen5" if core == "Zen 5" else "avx512-bf16"
    if "avx2" in have:
        return "zen3" if core == "Zen 3" else "avx2"
    return "other"


def amd_core(flags, vendor: str | None, family: int | None) -> str | None:
    """'Zen 4': the AMD core of a vendor, family and flags (Zen 3 and Zen 4 share family 25, and only Zen 4
    has AVX-512); None for another vendor or family, or where they are not known. A VM's model name is often
    just 'AMD EPYC', so this is what tells its figures apart."""
    if vendor != _AMD:
        return None
    if family == _ZEN5_FAMILY:
        return "Zen 5"
    if family == _ZEN3_ZEN4_FAMILY:
        return "Zen 4" if "avx512f" in set(flags or ()) else "Zen 3"
    return None


def vector_flags(flags) -> str | None:
    """'avx2 avx512f avx512_bf16': the vector features among `flags`; None where the flags are not known."""
    if flags is None:
        return None
    have = set(flags)
    return " ".join(f for f in VECTOR_FLAGS if f in have) or "none of " + " ".join(VECTOR_FLAGS)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one), not all the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
