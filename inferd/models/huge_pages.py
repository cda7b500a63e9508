"""Quantized weights in transparent huge pages (2 MiB) where the kernel grants them.

A decode step at batch 1 streams every weight matrix once: Gemma 3 270M in int8 reads 270 MB a step, which in
4 KiB pages is some 66,000 page translations, and each matrix, allocated on its own, starts its stream cold.
The quantized layers' weights are therefore copied into anonymous mappings advised `MADV_HUGEPAGE` and started
on a 2 MiB boundary, and every layer holds a view of its part (`quant.weights_to_huge_pages`; the joined int8
LM head through `cat`). Linux's default `transparent_hugepage` setting, `madvise`, grants such mappings huge
pages; under `never`, or on another system, the copies sit in ordinary pages and nothing else changes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's first byte: a cache line, as the kernels' loads expect at most


def empty_bytes(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], uninitialized (zeros), starting on a 2 MiB boundary of a mapping advised for huge pages;
    ordinary memory where the system has no such mappings."""
    if not sys.platform.startswith("linux") or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no such mapping allowed here (a sandbox, a limit): ordinary memory serves
        return torch.empty(nbytes, dtype=torch.uint8)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages refuses the advice
            mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until its last view is gone
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return raw.view(dtype).view(shape)


def pack(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors`, one after another in one mapping (each 64-byte aligned), in their order."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += math.ceil(_nbytes(t) / ALIGN) * ALIGN
    arena = empty_bytes(at)
    views = []
    for t, offset in zip(tensors, offsets, strict=True):
        view = _typed(arena[offset : offset + _nbytes(t)], t.dtype, t.shape)
        view.copy_(t)
        views.append(view)
    return views


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)` (along dim 0) in a mapping of its own."""
    first = tensors[0]
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    out = _typed(empty_bytes(math.prod(shape) * first.element_size()), first.dtype, shape)
    return torch.cat(list(tensors), out=out)


def thp_mode() -> str | None:
    """The kernel's transparent huge page setting (always, madvise or never); None where it has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def describe(t: torch.Tensor | None = None) -> str:
    """For the log and `inferd doctor`: how the pages under `t` came out ('2 MiB pages', or 4 KiB ones and why),
    or without `t` what this kernel's setting gives such a mapping."""
    mode = thp_mode()
    if mode is None:
        return "ordinary pages (no transparent huge pages here)"
    if mode == "never":
        return "4 KiB pages (transparent huge pages: never)"
    if t is None:
        return f"2 MiB pages (transparent huge pages: {mode})"
    return "2 MiB pages" if in_huge_pages(t) else "4 KiB pages (the kernel granted none)"


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether the pages under `t` are huge now (Linux: AnonHugePages of the mapping holding it)."""
    if not sys.platform.startswith("linux"):
        return False
    address = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) > 0
    except OSError:
        return False
    return False
