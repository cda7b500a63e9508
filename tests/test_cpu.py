"""inferd.cpu names the kind of CPU results are kept under, from its flags (and, for AMD, its family)."""

from __future__ import annotations

import json

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


def test_this_machine_has_a_kind():
    assert cpu.cpu_kind() in cpu.KINDS
    assert cpu.vector_flags(None) is None and cpu.vector_flags({"avx2", "fma"}) == "avx2"


def test_a_benchmark_appends_its_run_to_its_kinds_file(tmp_path, monkeypatch):
    from benchmarks import common

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
