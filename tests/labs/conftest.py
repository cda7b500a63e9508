"""The session's `inferd lab all --quick` run, shared by every lab test module (it runs once per session)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from inferd.cli import main
from inferd.models.tiny import tiny_model

PRICE = 2.5


@pytest.fixture(scope="session")
def lab_run(tmp_path_factory) -> dict:
    """`inferd lab all --quick --report DIR --price-per-hour 2.5` on one tiny model built for the session."""
    children_before = set(inferd_children())
    root = tmp_path_factory.mktemp("labs")
    model = tiny_model(root)
    out = root / "report"
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = ["lab", "all", "--quick", "--model", str(model), "--report", str(out), "--price-per-hour", str(PRICE)]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    return {
        "rc": rc,
        "out": out,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        "children_before": children_before,
    }


def inferd_children() -> list[str]:
    """Live inferd processes (serve, gateway, proxy) whose parent is this test process (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and "inferd.cli" in cmd:
            found.append(cmd)
    return found
