"""This CPU's feature flags, and the kind of CPU they make it for inferd's speed.

Which kernels inferd runs, and how fast, follows from a few vector features: AMX (Intel Sapphire Rapids and
later), AVX512_BF16 without AMX (AMD Zen 4 and later), or AVX2 alone (AMD Zen 3, older Intel). Benchmark
results are kept per CPU kind (`benchmarks/results/<benchmark>-<kind>.json`), since a figure from one kind
says little about another; `cpu_kind` is the one place that names a kind.

Linux only (/proc/cpuinfo); elsewhere the flags are empty and the kind is "other". No torch, no inferd
imports: the model code, the benchmarks and the load generator all read it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# the vector features that decide a CPU's speed here, as /proc/cpuinfo names them
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# the kinds results are kept under, fastest path first: (kind, what it means)
KINDS = {
    "xeon-amx": "AMX tiles (Intel Xeon, Sapphire Rapids and later)",
    "zen5": "AMD Zen 5: AVX-512 with AVX512_BF16 and VNNI, no AMX",
    "avx512-bf16": "AVX-512 with AVX512_BF16, no AMX (not a Zen 5, or its family is not known)",
    "zen3": "AMD Zen 3: AVX2 only, no AVX-512, no native bf16",
    "avx2": "AVX2 only, no AVX-512, no native bf16 (not a Zen 3, or its family is not known)",
    "other": "no AVX2, or not an x86 CPU",
}
_AMD = "AuthenticAMD"
_ZEN5_FAMILY = 26  # 0x1a
_ZEN3_FAMILY = 25  # 0x19 (Zen 4 too, which has AVX-512)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(info: str, *names: str) -> str:
    line = next((line for line in info.splitlines() if line.startswith(names)), "")
    return line.partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (e.g. 'avx2', 'avx512_bf16'); empty where /proc/cpuinfo is not there."""
    return frozenset(_field(_cpuinfo(), "flags", "Features").split())


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
    if {"amx_tile", "amx_bf16"} & have:
        return "xeon-amx"
    if "avx512_bf16" in have:
        return "zen5" if vendor == _AMD and family == _ZEN5_FAMILY else "avx512-bf16"
    if "avx2" in have:
        avx512 = "avx512f" in have
        return "zen3" if vendor == _AMD and family == _ZEN3_FAMILY and not avx512 else "avx2"
    return "other"


def vector_flags(flags) -> str | None:
    """'avx2 avx512f avx512_bf16': the vector features among `flags`; None where the flags are not known."""
    if flags is None:
        return None
    have = set(flags)
    return " ".join(f for f in VECTOR_FLAGS if f in have) or "none of " + " ".join(VECTOR_FLAGS)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one), not all the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
