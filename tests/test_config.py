"""Settings derive from the config fields: every field has a flag, flags read back, checks come from metadata."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from inferd.config import CacheConfig, EngineConfig, SchedulerConfig, add_engine_args, engine_config_from_args
from inferd.config import make_engine_config as make
from inferd.errors import ConfigError


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_defaults_from_the_cli_equal_the_dataclass_defaults():
    assert engine_config_from_args(_parse()) == EngineConfig()


def test_every_setting_has_a_flag_that_reads_back():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest for a in parser._actions}
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        assert {f.name for f in fields(cls) if f.metadata} <= flags
    config = engine_config_from_args(
        _parse("--kv-cache-memory", "512MiB", "--no-enable-prefix-caching", "--max-num-seqs", "4", "--dtype", "float32")
    )
    assert config.cache.kv_cache_memory == 512 << 20 and not config.cache.enable_prefix_caching
    assert config.scheduler.max_num_seqs == 4 and config.dtype == "float32"


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(dtype="int3"), "dtype must be one of"),
        (dict(block_size=12), "power of two"),
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
        (dict(num_blocks=0), "num_blocks must be at least 1"),
        (dict(attention_backend="cuda"), "attention_backend must be one of"),
    ],
)
def test_checks_come_from_the_fields(settings, message):
    with pytest.raises(ConfigError, match=message):
        make(**settings).validate()


def test_unknown_settings_are_named():
    with pytest.raises(ConfigError, match="unknown engine setting 'max_waiting_requests'"):
        make(max_waiting_requests=4)  # a server setting, not the engine's


def test_a_bad_memory_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _parse("--kv-cache-memory", "2QB")
    assert "cannot read memory size" in capsys.readouterr().err
