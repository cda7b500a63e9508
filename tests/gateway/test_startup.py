"""The gateway runs beside any OpenAI-compatible server: importing it loads no engine, no model code, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.gateway.procs import REPO, _env

pytestmark = pytest.mark.timeout(60)


def test_gateway_imports_no_torch_and_no_engine():
    code = (
        "import sys, time; t = time.perf_counter();"
        "import inferd.gateway.app, inferd.gateway.cli, inferd.gateway.service;"
        "banned = ('torch', 'inferd.engine', 'inferd.models', 'inferd.server');"
        "bad = [m for m in sys.modules if m.startswith(banned)];"
        "print(bad, round(time.perf_counter() - t, 2))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    bad, _ = out.stdout.rsplit(" ", 1)
    assert bad == "[]", out.stdout
