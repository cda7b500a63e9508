"""The fleet spec: what it accepts, the errors that name the line, and what it renders for serve and the gateway."""

from __future__ import annotations

import pytest

from inferd.errors import ConfigError
from inferd.fleet.spec import parse_fleet

GOOD = """\
models:
  - name: gemma
    aliases: [g]
    engine: {max_num_seqs: 16, enable_prefix_caching: false, block_size: 32, kv_cache_memory: 32MiB}
    pools:
      - name: gemma-both
        replicas: 2
        resources: {cpu: 1.5, memory: 2Gi}
        autoscaling: {min_replicas: 1, max_replicas: 3, targets: {waiting: 2}}
  - name: split
    pools:
      - {name: split-prefill, role: prefill}
      - {name: split-decode, role: decode, engine: {max_num_seqs: 8}}
gateway:
  routing: {picker: round_robin}
"""


def test_a_good_spec_renders_serve_flags_and_the_gateway_config():
    spec = parse_fleet(GOOD)
    (gm, both), (sm, prefill), (_, decode) = spec.pools()
    argv = spec.serve_argv(gm, both)
    assert argv[:4] == ["--model", "gemma3-270m", "--served-model-name", "gemma"]
    assert argv[argv.index("--kv-cache-memory") + 1] == "32MiB"  # written as the flag takes it
    assert "--no-enable-prefix-caching" in argv and argv[argv.index("--num-threads") + 1] == "1"
    assert spec.serve_argv(sm, prefill)[4:6] == ["--role", "prefill"]
    assert "8" in spec.serve_argv(sm, decode) and sm.disaggregated and not gm.disaggregated
    gw = spec.gateway_config({"gemma-both": {"replicas": ["http://h:1"]}, "split-decode": {"replicas_file": "f"}})
    assert [p.name for p in gw.pools] == ["gemma-both", "split-decode"]  # the prefill pool sits behind the proxy
    assert gw.pools[0].block_size == 32 and gw.routing.picker == "round_robin"
    assert gw.pools[0].scheduling_policy == "fcfs"  # the engine's: the gateway passes on only what it accepts
    ranked = parse_fleet(GOOD.replace("block_size: 32,", "block_size: 32, scheduling_policy: deadline,"))
    assert ranked.gateway_config({"gemma-both": {"replicas": ["http://h:1"]}, "split-decode": {"replicas_file": "f"}}
                                 ).pools[0].scheduling_policy == "deadline"  # fmt: skip
    assert [r.name for r in gw.models] == ["gemma", "split"] and gw.models[0].aliases == ["g"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("max_num_seqs: 16", "max_num_seq: 16"), r":4: models.0.engine: .*unknown engine setting 'max_num_seq'"),
        (("max_replicas: 3", "max_replicas: 0"), r":9: models.0.pools.0.autoscaling.max_replicas: .*greater"),
        (("32MiB", "lots"), r":4: models.0.engine: .*cannot read memory size 'lots'"),
        (("replicas: 2", "replicas: 5"), r":7: models.0.pools.0.replicas: .*outside \[1, 3\]"),
        (("memory: 2Gi", "memory: lots"), r":8: models.0.pools.0.resources.memory: .*cannot read memory"),
        (("role: prefill", "role: both"), r":11: models.1.pools: .*either `both` pools"),
        (("picker: round_robin", "picker: fastest"), r":15: gateway.routing.picker: .*'scored'"),
        (("name: gemma-both", "name: Gemma_Both"), r":6: models.0.pools.0.name: String should match"),
        (("waiting: 2", "waiting: 0"), r":9: models.0.pools.0.autoscaling.targets.waiting: .*greater than 0"),
    ],
)
def test_a_broken_spec_names_its_line_and_field(edit, message):
    with pytest.raises(ConfigError, match=message):
        parse_fleet(GOOD.replace(*edit), "fleet.yaml")


def test_scale_to_zero_needs_min_zero_and_one_target_is_required():
    base = "models:\n  - name: m\n    pools:\n      - name: p\n        autoscaling: {%s}\n"
    with pytest.raises(ConfigError, match="needs min_replicas: 0"):
        parse_fleet(base % "scale_to_zero_after_s: 60")
    parse_fleet(base % "min_replicas: 0, scale_to_zero_after_s: 60").models[0].pools[0].replicas = 0
    none = "targets: {waiting: null, kv_cache_usage: null}"
    with pytest.raises(ConfigError, match="set at least one target"):
        parse_fleet(base % none)


def test_the_shipped_examples_are_valid_specs():
    from pathlib import Path

    from inferd.fleet.spec import load_fleet

    examples = sorted((Path(__file__).parents[2] / "examples").glob("fleet*.yaml"))
    assert len(examples) >= 2
    for path in examples:
        assert load_fleet(path).models


def test_adapters_in_the_engine_settings_reach_the_gateway_and_stay_unique():
    spec = parse_fleet(GOOD.replace("block_size: 32,", "block_size: 32, lora_modules: [sql=/a/sql, chat=/a/chat],"))
    (gm, both), *_ = spec.pools()
    argv = spec.serve_argv(gm, both)
    assert argv[argv.index("--lora-modules") + 1 : argv.index("--lora-modules") + 3] == ["sql=/a/sql", "chat=/a/chat"]
    gw = spec.gateway_config({"gemma-both": {"replicas": ["http://h:1"]}, "split-decode": {"replicas_file": "f"}})
    assert gw.models[0].adapters == ["sql", "chat"] and gw.models[1].adapters == []
    clash = GOOD.replace("block_size: 32,", "block_size: 32, lora_modules: [split=/a/s],")
    with pytest.raises(ConfigError, match="adapter 'split' is used twice"):
        parse_fleet(clash)
    with pytest.raises(ConfigError, match="name=path"):
        parse_fleet(GOOD.replace("block_size: 32,", "block_size: 32, lora_modules: [sql],"))
