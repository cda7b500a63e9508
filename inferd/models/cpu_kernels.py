"""Native CPU kernels, compiled on first use with torch's C++ extension builder (g++ and ninja).

The build is cached per CPU and source (it is compiled with -march=native), so only the first start on a
machine pays the ~1 minute compile. If anything about the build fails, inferd logs why and falls
back to the PyTorch reference attention, which gives the same results, only slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "paged_decode_cpu.cpp"


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    return hashlib.sha256((flags + model).encode()).hexdigest()[:10]


def _source_hash() -> str:
    """In the module's name, so two checkouts with different kernel sources never load each other's build."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]


_STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a process that died


def _remove_stale_lock(name: str) -> None:
    """torch's build lock is a plain file: a build killed midway (Ctrl-C on the first start) leaves it behind,
    and every later start would wait on it forever. Remove one that no live build can still hold."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > _STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


@functools.cache
def paged_decode_kernel() -> Callable | None:
    """The compiled `paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)`."""
    if os.environ.get("INFERD_DISABLE_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"inferd_paged_decode_{_cpu_fingerprint()}_{_source_hash()}"
        _remove_stale_lock(name)
        module = load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )
        return module.paged_decode
    except Exception as e:  # no compiler, no ninja, odd platform: the reference path still works
        logger.warning("CPU paged attention kernel unavailable (%s); using the PyTorch reference", e)
        return None
