"""benchmarks.offline_throughput.step_parts on a tiny model: a decode step's wall time split into the parts the
profiler names, the rest outside them, adding up to the whole."""

from __future__ import annotations

import pytest

from benchmarks.offline_throughput import (
    PARTS,
    THREADED,
    fill_decode_batch,
    second_thread_idle,
    step_parts,
    step_peak,
)
from inferd import LLM
from inferd.models.cpu_kernels import rms_norm_kernel

pytestmark = pytest.mark.timeout(180)


def test_step_parts_split_a_decode_step_into_named_parts_and_the_rest(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, dtype="float32", quantization="int8")
    engine = llm.engine
    ids = fill_decode_batch(engine, [[5 + i, 17, 29, 41 + i] * 8 for i in range(4)], max_tokens=32)
    parts, top = step_parts(engine, steps=3)
    for rid in ids:
        engine.abort(rid)
    engine.check_idle()
    assert set(parts) == {*PARTS, "other_ops", "unnamed"}
    assert all(p["ms_per_step"] >= 0 and 0 <= p["share"] <= 1 for p in parts.values())
    assert parts["linears"]["share"] > 0 and top  # int8 layers (or torch's matmuls) ran under their names
    if rms_norm_kernel() is not None:  # the norms' native kernels built: they are named, not Python's time
        assert parts["small_kernels"]["share"] > 0
    idle = second_thread_idle(parts)
    assert 0 <= idle <= 1 and idle == pytest.approx(1 - sum(parts[k]["share"] for k in THREADED))
    # the parts are of the profiled wall time: with the time outside every op they make it up (unless the ops'
    # own times, measured apart, came to more than it)
    total = sum(p["share"] for p in parts.values())
    assert total == pytest.approx(1.0, abs=1e-6) or (parts["unnamed"]["share"] == 0 and total > 1)


def test_the_step_is_set_against_the_peak_of_the_matmul_its_own_layers_run(tiny_models):
    """int8 layers: the int8 kernel's products (without AMX twice a bf16 matmul's an instruction, so the dtype's
    matmul peak would put the step above 100%); float layers: a matmul in the dtype."""
    for quantization, path in (("int8", "int8 kernel"), ("none", "float32 matmul")):
        llm = LLM(str(tiny_models["llama"]), max_model_len=64, dtype="float32", quantization=quantization)
        what, measure = step_peak(llm.engine, n=256, rows=64)
        assert what == path and measure() > 1e8
