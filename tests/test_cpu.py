"""inferd.cpu names the kind of CPU results are kept under, from its flags (and, for AMD, its family)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferd import cpu

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
BF16 = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize(
    "flags, vendor, family, kind",
    [
        (AMX, "GenuineIntel", 6, "xeon-amx"),
        (AMX, None, None, "xeon-amx"),
        (BF16, "AuthenticAMD", 26, "zen5"),
        (BF16, "AuthenticAMD", 25, "avx512-bf16"),  # a Zen 4: its own kind, not taken for a Zen 5
        (BF16, None, None, "avx512-bf16"),
        ({"avx2", "fma"}, "AuthenticAMD", 25, "zen3"),
        ({"avx2", "fma"}, "GenuineIntel", 6, "avx2"),
        ({"sse4_2"}, None, None, "other"),
        (set(), None, None, "other"),
    ],
)
def test_the_kind_follows_the_vector_features(flags, vendor, family, kind):
    assert cpu.cpu_kind(flags, vendor, family) == kind and kind in cpu.KINDS


@pytest.mark.parametrize(
    "flags, vendor, family, core",
    [
        (BF16, "AuthenticAMD", 26, "Zen 5"),
        (BF16, "AuthenticAMD", 25, "Zen 4"),
        ({"avx2", "fma"}, "AuthenticAMD", 25, "Zen 3"),
        ({"avx2", "fma"}, "AuthenticAMD", 23, None),
        (AMX, "GenuineIntel", 6, None),
        (BF16, None, None, None),
    ],
)
def test_an_amd_core_is_told_by_its_family_and_avx512(flags, vendor, family, core):
    assert cpu.amd_core(flags, vendor, family) == core


def test_this_machine_has_a_kind():
    assert cpu.cpu_kind() in cpu.KINDS
    assert cpu.vector_flags(None) is None and cpu.vector_flags({"avx2", "fma"}) == "avx2"


def test_a_benchmark_appends_its_run_to_its_kinds_file(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.delenv(cpu.MAX_ISA_ENV, raising=False)  # a capped CPU files nothing by default (below)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    first = common.record_run("quality", {"modes": {"fp32": {}}}, ["quality.py", "--modes", "fp32"])
    assert first == tmp_path / f"quality-{cpu.cpu_kind()}.json"
    common.record_run("quality", {"modes": {"int8": {}}}, ["quality.py", "--rows", "8"])
    data = json.loads(first.read_text())
    assert data["format"] == "runs" and [list(r["modes"]) for r in data["runs"]] == [["fp32"], ["int8"]]
    run = data["runs"][1]
    assert run["command"] == "python -m benchmarks.quality --rows 8" and run["cpu_kind"] == cpu.cpu_kind()
    assert run["date"].endswith("UTC") and run["cpu"]["flags"] == sorted(cpu.cpu_flags()) and "commit" in run
    assert common.results_path("quality", "x") == tmp_path / "x.json"
    assert common.results_path("quality", str(tmp_path / "y.json")) == tmp_path / "y.json"


INTEL_AMX = AMX | {"avx512_vnni", "avx512_fp16", "avx_vnni", "fma"}


@pytest.fixture
def xeon(monkeypatch):
    """This process on an AMX Xeon's flags, with no cap set."""
    monkeypatch.setattr(cpu, "native_cpu_flags", lambda: frozenset(INTEL_AMX))
    monkeypatch.setattr(cpu, "cpu_identity", lambda: {"model": "Xeon", "vendor": "GenuineIntel", "family": 6})
    monkeypatch.delenv(cpu.MAX_ISA_ENV, raising=False)
    return monkeypatch


def test_a_cap_takes_away_the_features_above_it_from_every_choice(xeon):
    assert cpu.cpu_flags() == INTEL_AMX and cpu.cpu_kind() == "xeon-amx" and cpu.compiler_flags() == []
    xeon.setenv(cpu.MAX_ISA_ENV, "avx512-bf16")  # a Zen 5's features: no AMX, no AVX512-FP16
    assert cpu.cpu_flags() == {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"}
    assert cpu.cpu_kind() == "avx512-bf16"
    assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mno-avx512fp16"} == set(cpu.compiler_flags())
    xeon.setenv(cpu.MAX_ISA_ENV, " AVX2 ")  # a Zen 3's: AVX2 and FMA, nothing wider
    assert cpu.cpu_flags() == {"avx2", "fma"} and cpu.cpu_kind() == "avx2"
    assert {"-mno-avx512f", "-mno-avxvnni"} < set(cpu.compiler_flags())
    xeon.setenv(cpu.MAX_ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="INFERD_MAX_CPU_ISA='avx512': expected one of avx512-bf16, avx2"):
        cpu.cpu_flags()


def test_an_amd_cpu_builds_its_kernels_with_its_prefetch_hint(xeon):
    xeon.setattr(cpu, "cpu_identity", lambda: {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": 25})
    assert cpu.compiler_flags() == ["-DINFERD_AMD"]
    xeon.setenv(cpu.MAX_ISA_ENV, "avx2")  # the cap's switches, and still the vendor's
    assert cpu.compiler_flags()[-1] == "-DINFERD_AMD" and "-mno-avx512f" in cpu.compiler_flags()


def test_a_capped_run_is_not_filed_under_the_kind_it_stands_in_for(xeon):
    from inferd.bench import runs

    xeon.setenv(cpu.MAX_ISA_ENV, "avx2")
    with pytest.raises(RuntimeError, match="results files are kept per real kind"):
        runs.file_name("quality")
    assert runs.file_name("quality", "zen3") == "quality-zen3.json"  # a kind named on purpose: a stored run
    assert runs.header("python -m benchmarks.quality", Path("."))["max_cpu_isa"] == "avx2"


@pytest.mark.parametrize("preset", [None, "AVX512_CORE"])
def test_import_inferd_caps_torchs_own_kernels_unless_told_otherwise(preset):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env[cpu.MAX_ISA_ENV] = "avx2"
    if preset:
        env["ONEDNN_MAX_CPU_ISA"] = preset
    code = "import inferd, os, torch; print(os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [preset or "AVX2", "AVX2" if "avx2" in cpu.native_cpu_flags() else "DEFAULT"]
