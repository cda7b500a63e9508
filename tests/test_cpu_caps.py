"""The other CPU kinds' paths on this machine: under each `INFERD_MAX_CPU_ISA` cap below this CPU's own features,
a run of the tests that choose by the CPU's flags (the dtype, the int8 kernel's paths, the bf16 body and LM head
on oneDNN, decode attention) passes as it must on a CPU of that kind.

A CI machine is one kind at a time; without this, a Zen 3 or Zen 5 path broken on an AMX Xeon waits for a
machine of that kind to show it. The run is a pytest of its own, since the cap is read when the kernels are
compiled and torch's first use fixes its ISA: each cap compiles the native kernels it needs once (a minute or
two on 2 cores), then runs the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferd import cpu
from tests.conftest import cpu_feature_marks

ROOT = Path(__file__).resolve().parent.parent
#: the tests run under each cap: exact greedy decoding on every architecture, the kernels' own checks
UNDER_CAP = [
    "tests/engine/test_hf_parity.py::test_greedy_matches_transformers",
    "tests/models/test_lm_head.py",
    "tests/models/test_quant.py",
    "tests/models/test_dtypes.py",
    "tests/engine/test_attention.py",
]


def _lowers_this_cpu(cap: str) -> bool:
    return cpu._capped(cpu.native_cpu_flags(), cap) != cpu.native_cpu_flags()


@pytest.mark.slow
@pytest.mark.parametrize(
    "cap",
    [
        pytest.param(
            cap,
            marks=cpu_feature_marks(
                not _lowers_this_cpu(cap), f"this CPU has nothing above {cap}: its own run is the capped one"
            ),
        )
        for cap in cpu.ISA_CAPS
    ],
)
def test_the_paths_of_a_lesser_cpu_kind_pass_under_its_cap(cap, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env[cpu.MAX_ISA_ENV] = cap
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *UNDER_CAP]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
