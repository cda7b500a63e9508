"""benchmarks.int8_rows on a tiny model: each row count times every path on the first layer's int8 layers and
records what it ran."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import int8_rows
from inferd.cpu import cpu_flags
from inferd.models.cpu_kernels import int8_module

pytestmark = pytest.mark.timeout(180)


def test_int8_rows_times_each_path_at_each_row_count(tiny_models, tmp_path, monkeypatch):
    out = tmp_path / "rows.json"
    argv = ["int8_rows", "--model", str(tiny_models["llama"]), "--rows", "1,9", "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    int8_rows.main()
    run = json.loads(out.read_text())["runs"][-1]
    native = int8_module()
    assert run["kernel_isa"] == native.isa() and run["layers"]
    expected = {"kernel", "widened", "matmul_only"} | ({"kernel_no_amx"} if native.isa().endswith("+amx") else set())
    assert [level["rows"] for level in run["levels"]] == [1, 9]
    for level in run["levels"]:
        assert set(level["ms"]) == expected and all(v > 0 for v in level["ms"].values())
        assert level["widened_over_kernel"] == level["ms"]["widened"] / level["ms"]["kernel"]
    assert native.isa().endswith("+amx") == ({"amx_int8", "amx_tile"} <= cpu_flags())  # AMX switched back on
