"""`--dtype auto`: bf16 where the CPU has native bf16, fp32 elsewhere; chosen from the CPU's flags (mocked here)."""

from __future__ import annotations

import logging

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.config import make_engine_config
from inferd.errors import ConfigError
from inferd.models import dtypes
from tests.conftest import assert_idle

CPU = torch.device("cpu")
ZEN3 = frozenset({"avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
AMX_ONLY = ZEN3 | {"amx_bf16"}


@pytest.fixture
def flags(monkeypatch):
    def use(found: frozenset[str]) -> None:
        monkeypatch.setattr(dtypes, "cpu_flags", lambda: found)

    return use


@pytest.mark.parametrize(
    ("found", "expected"), [(ZEN3, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16), (AMX_ONLY, torch.bfloat16)]
)
def test_auto_follows_the_cpu_flags(flags, found, expected):
    flags(found)
    choice = dtypes.resolve_dtype("auto", CPU)
    assert choice.dtype == expected
    assert choice.reason.startswith("auto: ")


def test_explicit_dtype_is_kept_and_bf16_without_native_support_warns(flags, caplog):
    flags(ZEN3)
    with caplog.at_level(logging.WARNING, logger="inferd.models.dtypes"):
        assert dtypes.resolve_dtype("float32", CPU).dtype == torch.float32
        assert not caplog.records
        assert dtypes.resolve_dtype("bfloat16", CPU).dtype == torch.bfloat16
    assert "emulated" in caplog.text and "avx512_bf16" in caplog.text
    caplog.clear()
    flags(SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.WARNING, logger="inferd.models.dtypes"):
        dtypes.resolve_dtype("bfloat16", CPU)
    assert not caplog.records


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ConfigError, match="dtype must be one of"):
        dtypes.resolve_dtype("int3", CPU)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        make_engine_config("x", dtype="fp8").validate()


def test_cpu_flags_reads_this_machine():
    found = dtypes.cpu_flags()
    assert isinstance(found, frozenset)
    if found:  # Linux: x86 has sse2 at least, ARM 'fp' or 'asimd'
        assert found & {"sse2", "fp", "asimd"}


@pytest.mark.parametrize(("found", "expected"), [(ZEN3, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16)])
def test_engine_runs_in_the_auto_dtype(tiny_models, flags, caplog, found, expected):
    flags(found)
    with caplog.at_level(logging.INFO, logger="inferd.engine.engine"):
        llm = LLM(str(tiny_models["gemma3"]), max_model_len=128, num_blocks=32)
    engine = llm.engine
    assert engine.dtype == expected
    assert f"dtype: {str(expected).removeprefix('torch.')} (auto: " in caplog.text
    # the cache is bf16 either way: the model's, or half the bytes of the float32 that auto chose
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert ("KV cache: bfloat16 (auto: under float32" in caplog.text) == (expected == torch.float32)
    assert engine.model.model.embed_tokens.weight.dtype == expected
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert_idle(llm)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (48,), (1, 1, 48), (3, 48), (0, 48)])
def test_one_bf16_row_takes_gemv_and_matches_linear(bias, shape, monkeypatch):
    """A single bf16 row (decode at batch 1) goes through torch's gemv; any shape comes back as F.linear's,
    equal to bf16 rounding of the float32 product."""
    from inferd.models import layers

    torch.manual_seed(0)
    layer = layers.Linear(48, 40, bias=bias).bfloat16()
    calls = []
    monkeypatch.setattr(layers, "_gemv", lambda *a, real=layers._gemv: calls.append(1) or real(*a))
    x = torch.randn(*shape).bfloat16()
    y = layer(x)
    bias_f = None if layer.bias is None else layer.bias.float()
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), bias_f)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert bool(calls) == (x.numel() == 48)
    calls.clear()
    layers.Linear(48, 40)(x.float())
    assert not calls  # float32 rows stay on F.linear
