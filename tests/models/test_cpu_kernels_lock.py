"""The kernel build lock: a build killed midway must not make every later start wait."""

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
