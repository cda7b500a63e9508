"""Settings derive from the config fields: every field has a flag, flags read back, checks come from metadata,
and no other module writes an engine setting's default again."""

from __future__ import annotations

import argparse
import ast
from dataclasses import fields
from pathlib import Path

import pytest

import inferd
from inferd.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    add_engine_args,
    engine_argv,
    engine_config_from_args,
    engine_config_from_argv,
    engine_default,
)
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


def test_settings_written_as_flags_read_back():
    settings = {"max_num_seqs": 4, "enable_prefix_caching": False, "kv_cache_memory": "64MiB", "num_threads": 2}
    argv = engine_argv(settings)
    assert argv[:3] == ["--max-num-seqs", "4", "--no-enable-prefix-caching"]
    assert engine_config_from_argv(argv) == make(**settings | {"kv_cache_memory": 64 << 20})
    with pytest.raises(ConfigError, match="argument --max-num-seqs: invalid int value"):
        engine_config_from_argv(["--max-num-seqs", "four"])  # raised, not an exit


def test_a_default_is_read_from_its_field():
    assert engine_default("max_num_seqs") == SchedulerConfig().max_num_seqs
    assert engine_default("block_size") == CacheConfig().block_size
    with pytest.raises(ConfigError, match="unknown engine setting 'max_waiting_requests'"):
        engine_default("max_waiting_requests")


def test_the_kv_pool_and_the_context_are_sized_here():
    assert make(num_blocks=10).cache.blocks(1 << 20) == 10
    assert make(kv_cache_memory=64 << 20).cache.blocks(1 << 20) == 64
    assert make().context_len(128) == 128 and make().context_len(1 << 20) < 1 << 20
    assert make(max_model_len=256).context_len(1 << 20) == 256


# -- no engine default written twice ----------------------------------------------------------------------------
# names other parts also use for something of their own (a workload's seed, a tensor's dtype, a machine's device)
# are not taken for the engine's; every other setting's name is the engine's wherever it appears
GENERIC = {"model", "tokenizer", "dtype", "device", "seed"}
SETTINGS = {f.name for c in (EngineConfig, CacheConfig, SchedulerConfig) for f in fields(c) if f.metadata} - GENERIC


def _literal(node: ast.AST | None) -> bool:
    """A value written out (16, "auto", 2 * 1024**3), as opposed to None or a name read from somewhere."""
    if isinstance(node, ast.Constant):
        return node.value is not None and node.value is not Ellipsis
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return False


def _field_default(value: ast.AST | None) -> ast.AST | None:
    """What a class field defaults to: `= 16`, `= Field(16, ...)`, `= field(default=16)`."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in ("Field", "field"):
        default = [k.value for k in value.keywords if k.arg == "default"]
        return default[0] if default else (value.args[0] if value.args else None)
    return value


def _call_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def _call_defaults(node: ast.Call, flags: set[str]) -> list[str]:
    """`.get("max_num_seqs", 64)`, `getattr(x, "block_size", 16)`, `add_argument("--max-num-seqs", default=64)`."""
    a, name = node.args, _call_name(node)
    key_at = {"get": 0, "pop": 0, "setdefault": 0, "getattr": 1}.get(name)
    if key_at is not None and len(a) == key_at + 2 and isinstance(a[key_at], ast.Constant):
        key, default = a[key_at].value, a[key_at + 1]
        return [ast.unparse(node)] if key in SETTINGS and _literal(default) else []
    if name == "add_argument" and any(isinstance(x, ast.Constant) and x.value in flags for x in a):
        return [ast.unparse(node) for k in node.keywords if k.arg == "default" and _literal(k.value)]
    return []


def _parameter_defaults(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[str]:
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
    pairs += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    return [f"parameter {a.arg}={ast.unparse(d)}" for a, d in pairs if a.arg in SETTINGS and _literal(d)]


def _field_defaults(node: ast.ClassDef) -> list[str]:
    return [
        f"{node.name}.{st.target.id} = {ast.unparse(st.value)}"
        for st in node.body
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id in SETTINGS
        if _literal(_field_default(st.value))
    ]


def written_defaults(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every place an engine setting gets a default written as a literal."""
    flags = {"--" + n.replace("_", "-") for n in SETTINGS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found += [(node.lineno, what) for what in _call_defaults(node, flags)]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found += [(node.lineno, what) for what in _parameter_defaults(node)]
        elif isinstance(node, ast.ClassDef):
            found += [(node.lineno, what) for what in _field_defaults(node)]
    return found


def test_engine_defaults_are_written_only_in_config():
    """A default of an engine setting typed again elsewhere drifts from the engine's: read it with
    `engine_default(name)` or from a built config (`ModelSpec.engine_config`)."""
    root = Path(inferd.__file__).parent
    broken = [
        f"{path.relative_to(root.parent)}:{line}: {what}"
        for path in sorted(root.rglob("*.py"))
        if path != root / "config.py"
        for line, what in written_defaults(ast.parse(path.read_text()))
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    "source",
    [
        'seqs = settings.get("max_num_seqs", 64)',
        'size = getattr(args, "block_size", 16)',
        'p.add_argument("--max-num-seqs", type=int, default=32)',
        "def route(ids, block_size=16): ...",
        "class Pool(BaseModel):\n    block_size: int = Field(16, ge=1)",
        "@dataclass\nclass Cache:\n    kv_cache_memory: int = 2 * 1024**3",
    ],
)
def test_the_check_sees_a_default_written_again(source):
    assert written_defaults(ast.parse(source))


@pytest.mark.parametrize(
    "source",
    [
        'seqs = settings.get("max_num_seqs", engine_default("max_num_seqs"))',
        'size = settings.get("max_model_len")',
        "def route(ids, block_size: int | None = None): ...",
        'p.add_argument("--seed", type=int, default=0)',  # a workload's seed
        'engine = {"max_num_seqs": 16}',  # a setting chosen, not a default
    ],
)
def test_the_check_leaves_what_is_not_a_default_written_again(source):
    assert not written_defaults(ast.parse(source))
