"""Kernel builds: the lock (a build killed midway must not make every later start wait) and the stable copies."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from inferd.models import cpu_kernels


def test_a_lock_left_by_a_dead_build_is_removed_and_a_live_one_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory("inferd_test_kernel", verbose=False))
    (folder / "lock").write_text("")  # what torch leaves behind when its build is killed
    with cpu_kernels._build_lock("inferd_test_kernel"):
        assert not (folder / "lock").exists()
    holder = subprocess.Popen(  # a live build holds the lock for a second
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(1)",
            str(folder.parent / "inferd_test_kernel.flock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with cpu_kernels._build_lock("inferd_test_kernel"):
            waited = time.monotonic() - started
        assert waited > 0.5
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_two_checkouts_share_a_build_and_its_headers_only_when_both_are_the_same(tmp_path, monkeypatch):
    """A kernel's build name hashes its source and the headers of its folder; the copies a build compiles
    sit at paths named by that hash, so checkouts elsewhere reuse the build (torch rebuilds on new paths)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "k.cpp").write_text('#include "common.h"\n')
        (folder / "common.h").write_text("constexpr int kX = 1;\n")
    assert cpu_kernels._source_hash(a / "k.cpp") == cpu_kernels._source_hash(b / "k.cpp")
    name = f"k_{cpu_kernels._source_hash(a / 'k.cpp')}"
    copy = cpu_kernels._stable_copy(a / "k.cpp", name)
    assert copy == cpu_kernels._stable_copy(b / "k.cpp", name)
    assert (copy.with_suffix(".include") / "common.h").read_text() == "constexpr int kX = 1;\n"
    (b / "common.h").write_text("constexpr int kX = 2;\n")  # another checkout, another header: another build
    assert cpu_kernels._source_hash(b / "k.cpp") != cpu_kernels._source_hash(a / "k.cpp")


def test_two_environments_keep_their_own_builds_of_one_source(tmp_path, monkeypatch):
    """torch rebuilds a module whose build arguments name another torch or Python (their headers' folders), so
    two environments on one machine (a checkout's and a CI clone's) would rebuild one module in turn: the
    name carries the toolchain, and each keeps its own build."""
    import torch

    assert str(Path(torch.__file__).parent) in cpu_kernels._toolchain()
    (tmp_path / "k.cpp").write_text("int k;\n")
    names = []
    for torch_dir in ("/env-a/torch", "/env-b/torch"):
        monkeypatch.setattr(cpu_kernels, "_toolchain", lambda d=torch_dir: f"2.13.0 {d} /usr/include/python3.11")
        names.append(cpu_kernels._build_name("k", tmp_path / "k.cpp", ["-O3"]))
    assert names[0] != names[1]
    assert names[1] == cpu_kernels._build_name("k", tmp_path / "k.cpp", ["-O3"])  # and the same again
