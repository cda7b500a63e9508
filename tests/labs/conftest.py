"""The session's `inferd lab all --quick` run, shared by every lab test module (it runs once per session)."""

from __future__ import annotations

import contextlib
import io

import pytest

from inferd.cli import main
from inferd.labs.tiny import tiny_model

PRICE = 2.5


@pytest.fixture(scope="session")
def lab_run(tmp_path_factory) -> dict:
    """`inferd lab all --quick --report DIR --price-per-hour 2.5` on one tiny model built for the session."""
    root = tmp_path_factory.mktemp("labs")
    model = tiny_model(root)
    out = root / "report"
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = ["lab", "all", "--quick", "--model", str(model), "--report", str(out), "--price-per-hour", str(PRICE)]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    return {"rc": rc, "out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
