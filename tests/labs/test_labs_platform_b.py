"""The KServe and Ray Serve labs beyond what `lab all --quick` checks (tests/labs/test_labs.py runs both): the
KServe manifests validate with 0 errors and a broken one is caught with its field named; the memory claim turns
into a warning when a spec asks for too little; the Ray lab's policy is inferd's own, and Ray (the runtime's
`local_ray`, which the lab runs in) is shut down, its processes gone, when the lab fails half-way; the vLLM lab
compares only the levels both servers ran."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from inferd.deploy.validate import errors
from inferd.fleet.spec import AutoscalingPolicy, parse_fleet
from inferd.labs import find_lab
from inferd.labs import kserve as ks
from inferd.labs.context import LabContext
from inferd.procs import free_port

FLEET = """\
models:
  - name: qwen
    aliases: [q]
    model: Qwen/Qwen3-0.6B
    engine: {max_num_seqs: 8, block_size: 32, max_model_len: 4096}
    pools:
      - name: qwen-main
        replicas: 3
        resources: {cpu: 4, memory: 6Gi, gpu: 1}
  - name: split
    pools:
      - {name: split-prefill, role: prefill}
      - {name: split-decode, role: decode}
"""


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return ks.render_kserve(parse_fleet(FLEET))


def test_the_kserve_objects_validate_and_a_broken_one_is_caught_by_field(rendered):
    assert [o["kind"] for o in rendered] == ["LLMInferenceService", "ServingRuntime", "InferenceService"]
    checked, caught = ks.validation(rendered)
    assert [o["errors"] for o in checked] == [[], [], []] and sum(o["fields"] for o in checked) > 100
    assert len(caught) >= ks.BREAKS == 3
    assert any("spec.template.containers.0" in c and "readinesProbe" in c for c in caught), caught
    assert any("spec.model.uri" in c for c in caught) and any("'replica' was unexpected" in c for c in caught)
    unknown = {"apiVersion": "serving.kserve.io/v9", "kind": "LLMInferenceService", "metadata": {"name": "x"}}
    assert "no CRD" in str(errors(unknown)[0])  # a version KServe does not have is an error, not a pass


def test_the_field_table_is_read_from_the_manifest(rendered):
    table = ks.field_table(rendered[0])
    rows = {r.split(" | ")[0].strip("| `"): r.split(" | ")[1:] for r in table.splitlines()[2:]}
    assert rows["spec.model.uri"][0] == "`hf://Qwen/Qwen3-0.6B`" and rows["spec.replicas"][0] == "`3`"
    assert rows["c.args --max-num-seqs"][0] == "`8`" and "batch" in rows["c.args --max-num-seqs"][1]  # its --help
    assert rows["c.args --block-size"][0] == "`32`" and rows["c.args --max-model-len"][0] == "`4096`"
    assert rows["c.args --model"][0] == "`/mnt/models`"  # KServe's storage initializer puts the hub model there
    assert rows["c.resources.limits.memory"][0] == "`6Gi`" and rows["c.resources.requests.nvidia.com/gpu"][0] == "`1`"
    assert table.startswith("| field | value rendered | what it does |\n|---|---|---|\n")


def test_the_memory_claim_warns_when_the_spec_asks_too_little():
    kserve = find_lab("kserve")
    n = dict(objects=3, fields_validated=122, validation_errors=0, broken_edits=3, broken_errors=3, max_num_seqs=16)
    n |= dict(max_model_len=8192, kv_bytes_per_token=18432, kv_pool_tokens=29120, full_tokens=131072, full_seqs_fit=3)
    n |= dict(rss_idle_mib=1900, rss_peak_mib=2150, host_kv_mib=512, host_weights_mib=1030, limit_mib=2048)
    n |= dict(runtime_mib=608, suggested_mib=2816)
    settings = {"fleet": "f.yaml", "fleet_model": "gemma3-270m", "measured_model": "Gemma", "pool": "p"}
    settings["out_yaml"] = "out/kserve.yaml"
    m = ks.Measurement(numbers=n, series={"objects": [], "fields": "", "caught": []}, settings=settings)
    claims = kserve.explain(m).claims
    memory = next(c for c in claims if c.left == "limit_mib")
    assert memory.holds(n) and memory.agrees is None and "OOM-kill" in memory.text and "2,816 MiB" in memory.text
    fit = next(c for c in claims if c.left == "kv_pool_tokens")
    assert "3 sequences at the full 8,192 tokens, not all 16" in fit.text and fit.holds(n)
    n["limit_mib"] = 4096  # enough: the memory claim no longer warns
    memory = next(c for c in kserve.explain(m).claims if c.left == "limit_mib")
    assert memory.holds(n) and "OOM-kill" not in memory.text and "4,096 MiB" in memory.text


def test_the_fleet_option_is_what_the_lab_renders(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(FLEET)
    ctx = LabContext(quick=True, fleet=path, workdir=tmp_path / "w")
    source, spec = ks.read_fleet(ctx)
    assert source.endswith("mine.yaml") and [m.name for m in spec.models] == ["qwen", "split"]
    only_split = parse_fleet(FLEET.split("  - name: split")[0].replace("qwen", "x").replace("Qwen/Qwen3-0.6B", "a/b"))
    assert ks.render_kserve(only_split)[0]["metadata"]["name"] == "inferd-x-main"
    disagg = parse_fleet(
        "models:\n  - name: s\n    pools:\n      - {name: p, role: prefill}\n      - {name: d, role: decode}\n"
    )
    with pytest.raises(Exception, match="disaggregated"):
        ks.render_kserve(disagg)


def test_the_recorded_policy_is_inferds_own(tmp_path):
    from inferd.runtime.ray import PoolAutoscalingPolicy, desired_replicas, read_decisions

    policy = {"min_replicas": 1, "max_replicas": 2, "targets": {"waiting": 1}}
    log = tmp_path / "decisions.jsonl"
    recording = PoolAutoscalingPolicy(str(log), **policy)
    for waiting in (0.0, 0.5, 3.2, 3.2):
        ctx = SimpleNamespace(
            aggregated_metrics={"waiting": {"r1": waiting}, "running": {"r1": 4.0}},
            current_num_replicas=1,
            target_num_replicas=1,
            total_num_requests=0,
        )
        desired, _ = recording(ctx)
        assert desired == desired_replicas(AutoscalingPolicy.model_validate(policy), 1, {"waiting": waiting})
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # a line per change (or per half second); 4 = ceil(3.2 / 1): the policy's wish, which Serve bounds to max 2
    assert [line["desired"] for line in lines] == [0, 1, 4]
    assert lines[-1]["waiting"] == 3.2 and lines[-1]["running"] == 4.0 and lines[-1]["t"] <= time.time()
    assert [d["t"] for d in read_decisions(log, lines[0]["t"])][0] == 0.0


@pytest.mark.timeout(180)
def test_ray_is_shut_down_and_its_processes_gone_when_the_lab_fails():
    import ray

    from inferd.runtime.ray import local_ray

    with pytest.raises(RuntimeError, match="half-way"), local_ray(free_port()) as run:
        assert ray.is_initialized()
        raise RuntimeError("the lab failed half-way")
    assert not ray.is_initialized()
    assert len(run.pids) >= 3 and run.left == [], run  # GCS, raylet, workers ... all ended


def _stored_peers(path, inferd_levels, vllm_levels):
    def server(levels):
        figures = {
            f"concurrency={c}": {"median": {"output_throughput": 10.0 * c, "mean_ttft_ms": 100.0}} for c in levels
        }
        return {"workloads": {"mixed": figures}}

    data = {
        "machine": {"cpu_model": "test CPU"},
        "workloads": {"mixed": ["--random-input-len", "288"]},
        "date": "2026-11-30 10:00",
        "servers": {"inferd": server(inferd_levels), "vllm": server(vllm_levels)},
    }
    path.write_text(json.dumps(data))
    return path


def test_vllm_lab_compares_only_the_levels_both_servers_ran(tmp_path):
    """A summary where inferd was rerun at fewer levels (vs_peers merges servers): the lab compares the
    levels both have, and says how to measure when they share none."""
    from inferd.errors import InferdError
    from inferd.labs import vllm

    ctx = LabContext(quick=True, workdir=tmp_path / "w")
    m = vllm.measure(ctx, _stored_peers(tmp_path / "a.json", [16, 32], [1, 16, 32]))
    assert m.series["c"] == [16, 32] and m.numbers["c_lo"] == 16
    with pytest.raises(InferdError, match="no concurrency level measured for both"):
        vllm.measure(ctx, _stored_peers(tmp_path / "b.json", [4], [1, 16]))
