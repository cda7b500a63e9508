"""inferd as a user installs it: a built wheel, installed non-editable into a fresh virtual environment.

An editable install reads every file from the checkout, so a file the package needs at run time but does not
ship (a kernel's header, a template, a static page) passes every other test and breaks only for users. Here
the wheel is built, its contents are checked against the files the package holds, and `inferd doctor` and
`inferd generate` run from the installed copy, with the native kernels built from what the wheel shipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _source_files() -> list[str]:
    """The files of the working tree a clean checkout would have (tracked, or new and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [name for name in listed.stdout.splitlines() if (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the source tree: a build in the checkout reuses its build/ and egg-info folders,
    which keep files from earlier builds that the package data no longer names."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in _source_files():
        if name.startswith(("inferd/", "README", "pyproject", "LICENSE")):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        cwd=out,
        timeout=300,
    )
    (found,) = out.glob("inferd-*.whl")
    return found


def test_the_wheel_ships_every_file_the_package_holds(wheel):
    """Every file git tracks under inferd/ (kernel headers, templates, static pages, CRDs, profiles) is in the
    wheel; tests and benchmarks are not."""
    wanted = {name for name in _source_files() if name.startswith("inferd/")}
    assert any(name.endswith(".h") for name in wanted)
    with zipfile.ZipFile(wheel) as z:
        shipped = {name for name in z.namelist() if name.startswith("inferd/")}
    assert not wanted - shipped, f"not in the wheel: {sorted(wanted - shipped)}"


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed, not editable; torch and the other dependencies are this
    environment's, reached through a .pth (a copy of torch would cost minutes and gigabytes)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=300,
    )
    return venv


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INFERD_DISABLE_CPU_KERNELS")}
    return {**env, "HF_HUB_OFFLINE": "1"}


def test_the_installed_package_builds_its_native_kernels(installed, tmp_path):
    """`inferd doctor` from the installed copy: the code is the venv's, and every kernel built there (a missing
    header changes the build's name, so it is compiled again from what the wheel shipped, and fails)."""
    run = subprocess.run(
        [installed / "bin" / "inferd", "doctor", "--json"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads(run.stdout)
    assert Path(found["inferd"]).is_relative_to(installed), found["inferd"]
    assert found["ok"] and not found["missing"], found["kernels"]


def test_the_installed_package_generates_on_the_native_kernels(installed, tmp_path, tiny_models):
    run = subprocess.run(
        [installed / "bin" / "inferd", "generate", "--model", str(tiny_models["llama"]), "--max-tokens", "8",
         "--dtype", "float32", "The quick brown fox"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "finish=length" in run.stdout
    assert "decode attention: native CPU kernel" in run.stderr
    assert "unavailable" not in run.stderr and "No such file" not in run.stderr, run.stderr
