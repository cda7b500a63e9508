"""benchmarks/vs_peers.py keeps each invocation as its own run in its output file (date, commit, CPU model and
flags, command line, servers, results) and never merges servers from two invocations into one record; ratios
are taken within a run; a file from before reads as one run marked converted, with what it said of itself."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import vs_peers
from inferd.bench import peers, runs
from inferd.cpu import KINDS, MAX_ISA_ENV, cpu_kind

pytestmark = pytest.mark.timeout(60)

RESULTS = Path(vs_peers.__file__).parent / "results"


def _entry(levels: dict[int, float]) -> dict:
    figures = {
        f"concurrency={c}": {
            "runs": [{"output_throughput": tok_s}],
            "median": {"output_throughput": tok_s, "mean_ttft_ms": 100.0},
        }
        for c, tok_s in levels.items()
    }
    return {"dtype": "bfloat16", "workloads": {"mixed": figures}, "error": None}


def _args(out: Path, fresh: bool = False) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), fresh=fresh, runs=1, interleave=True)


def _write(out: Path, entries: dict, argv: list[str], fresh: bool = False) -> dict:
    return vs_peers.write_summary(entries, _args(out, fresh), started=1_800_000_000.0, argv=argv)


def test_each_invocation_is_its_own_run_and_servers_never_merge(tmp_path):
    out = tmp_path / "peers.json"
    _write(out, {"inferd": _entry({16: 200.0, 32: 250.0}), "vllm": _entry({16: 150.0, 32: 200.0})}, ["x", "--a"])
    _write(out, {"inferd": _entry({1: 20.0})}, ["x", "--servers", "inferd", "--concurrency", "1"])
    data = json.loads(out.read_text())
    assert data["format"] == "runs" and len(data["runs"]) == 2 and "servers" not in data
    first, second = data["runs"]
    # the second invocation ran inferd at c=1 only: the first run's inferd keeps its own levels, nothing added
    assert set(first["servers"]["inferd"]["workloads"]["mixed"]) == {"concurrency=16", "concurrency=32"}
    assert set(second["servers"]) == {"inferd"}
    assert set(second["servers"]["inferd"]["workloads"]["mixed"]) == {"concurrency=1"}
    for run in data["runs"]:
        assert run["date"] == "2027-01-15 08:00 UTC" and run["finished"]
        assert run["cpu"]["model"] and isinstance(run["cpu"]["flags"], list)
        assert run["command"].startswith("python benchmarks/vs_peers.py")
        assert "commit" in run and "uncommitted_changes" in run and "converted" not in run
    assert second["command"] == "python benchmarks/vs_peers.py --servers inferd --concurrency 1"
    assert first["ratios_best_inferd_over_peer"]["mixed"]["vllm"]["concurrency=16"]["output_throughput"] == 200 / 150
    # the second run has no peer: no ratio pairs its inferd with the first run's vLLM
    assert second["ratios_best_inferd_over_peer"] == {} and second["targets"] == {}


def test_the_commit_is_the_checkout_s(tmp_path):
    sha, dirty = runs.commit(Path(vs_peers.__file__).parent.parent)
    assert sha is None or (len(sha) == 40 and isinstance(dirty, bool))
    assert runs.commit(tmp_path) == (None, None)  # not a repository: unknown, not made up


def test_fresh_keeps_only_this_run(tmp_path):
    out = tmp_path / "peers.json"
    _write(out, {"inferd": _entry({16: 200.0})}, ["x"])
    _write(out, {"vllm": _entry({16: 150.0})}, ["x"], fresh=True)
    runs = json.loads(out.read_text())["runs"]
    assert [set(r["servers"]) for r in runs] == [{"vllm"}]


def test_an_older_file_reads_as_one_converted_run_and_stays_when_a_run_is_added(tmp_path):
    legacy = {  # the shape every summary had before runs were kept apart: one record, servers merged into it
        "workloads": {"mixed": "random dataset", "runs": 3, "interleaved": True},
        "machine": {"cpu_count": 2, "processor": "x86_64", "cpu_model": "Intel(R) Xeon(R) Processor"},
        "servers": {"inferd": _entry({1: 20.0, 16: 136.5}), "vllm": _entry({16: 191.0})},
        "ratios_best_inferd_over_peer": {},
        "targets": {},
        "date": "2026-11-30 19:39 UTC",
        "note": "two interleaved invocations: inferd with vllm at c=16, inferd alone at c=1",
    }
    out = tmp_path / "vs_peers.json"
    out.write_text(json.dumps(legacy))
    (run,) = peers.load(out)["runs"]
    assert run["converted"] == peers.CONVERTED and "different invocations" in run["converted"]
    assert run["date"] == legacy["date"] and run["note"] == legacy["note"] and run["servers"] == legacy["servers"]
    assert run["machine"] == legacy["machine"] and run["cpu"]["model"] == legacy["machine"]["cpu_model"]
    assert run["commit"] is None and run["cpu"]["flags"] is None and run["command"] is None  # not known
    _write(out, {"vllm": _entry({16: 150.0})}, ["x"])
    first, second = json.loads(out.read_text())["runs"]
    assert first["servers"] == legacy["servers"] and first["converted"] and set(second["servers"]) == {"vllm"}


@pytest.mark.parametrize("path", sorted(RESULTS.glob("vs_peers*.json")), ids=lambda p: p.name)
def test_every_stored_summary_stays_readable(path):
    runs = peers.load(path)["runs"]
    assert runs and all(r["servers"] and r["date"] and r["cpu"]["model"] for r in runs)


def test_pairs_come_from_one_run_only():
    older = {"servers": {"inferd": _entry({16: 200.0, 32: 250.0}), "vllm": _entry({16: 150.0, 32: 200.0})}}
    inferd_only = {"servers": {"inferd": _entry({1: 20.0, 16: 210.0})}}
    vllm_only = {"servers": {"vllm": _entry({1: 30.0})}}
    data = {"format": "runs", "runs": [older, inferd_only, vllm_only]}
    # the newest runs hold one server each (c=1 in both): no pair across them; the older run is the newest pair
    assert peers.latest_pair(data, "inferd", ("vllm",)) == (0, "vllm", "mixed", ["concurrency=16", "concurrency=32"])
    assert peers.latest_pair({"format": "runs", "runs": [inferd_only, vllm_only]}, "inferd", ("vllm",)) is None
    # of two peers in one run, the first named; a newer run with only the second wins over an older one
    fp32 = {"servers": {"inferd": _entry({1: 20.0}), "vllm-fp32": _entry({1: 15.0})}}
    both = {"format": "runs", "runs": [older, fp32]}
    assert peers.latest_pair(both, "inferd", ("vllm", "vllm-fp32")) == (1, "vllm-fp32", "mixed", ["concurrency=1"])


def test_out_takes_a_name_or_a_path_and_defaults_to_this_cpu_kinds_file(tmp_path, monkeypatch):
    monkeypatch.delenv(MAX_ISA_ENV, raising=False)  # a capped CPU files nothing by default (tests/test_cpu.py)
    assert vs_peers.summary_path(None) == RESULTS / f"vs_peers-{cpu_kind()}.json"
    assert vs_peers.summary_path("vs_peers-zen3") == RESULTS / "vs_peers-zen3.json"
    assert vs_peers.summary_path(str(tmp_path / "x.json")) == tmp_path / "x.json"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("vs_peers*.json")), ids=lambda p: p.name)
def test_a_stored_file_holds_one_kind_of_cpu_named_in_its_name(path):
    assert path.name.startswith("vs_peers-") and path.stem.removeprefix("vs_peers-") in KINDS
    assert {runs.run_kind(r) for r in peers.load(path)["runs"]} == {path.stem.removeprefix("vs_peers-")}


def _ttft(entry: dict, level: int, ms: float) -> dict:
    entry["workloads"]["mixed"][f"concurrency={level}"]["median"]["mean_ttft_ms"] = ms
    return entry


def test_targets_take_the_no_flags_server_against_vllms_faster_dtype_and_the_fastest_of_each_side():
    servers = {
        "inferd": _ttft(_entry({1: 40.0, 16: 160.0, 32: 200.0}), 16, 90.0),
        "inferd-int8": _entry({1: 45.0, 16: 170.0}),
        "vllm": _entry({16: 20.0, 32: 25.0}),  # bf16 on an AVX2 CPU: the slow dtype there
        "vllm-fp32": _entry({16: 100.0, 32: 140.0}),
        "llama-server": _entry({1: 35.0}),
    }
    got = {t.name: t for t in peers.targets(peers.level_figures(servers))}
    c16 = got["c=16, no flags over vllm-fp32"]
    assert c16.ratio == 1.6 and c16.ttft_ratio == 0.9 and c16.met
    c32 = got["c=32, no flags over vllm-fp32"]
    assert c32.ratio == 200 / 140 and not c32.met  # 1.43x: short of 1.5x
    c1 = got["c=1, no flags over llama-server"]
    assert c1.ratio == 40 / 35 and not c1.met  # 1.14x: short of 1.3x, though ahead
    assert got["c=1, fastest (inferd-int8) over fastest peer (llama-server)"].met
    assert got["c=16, fastest (inferd-int8) over fastest peer (vllm-fp32)"].ratio == 1.7
    # a slower TTFT fails a throughput target that is met
    servers["inferd"] = _ttft(servers["inferd"], 16, 101.0)
    assert not {t.name: t for t in peers.targets(peers.level_figures(servers))}[c16.name].met
    # a server that failed takes part in no target
    servers["vllm-fp32"]["error"] = "did not start"
    assert "c=16, no flags over vllm" in {t.name for t in peers.targets(peers.level_figures(servers))}
    summary = vs_peers.target(servers)["mixed"]
    assert summary["c=1, no flags over llama-server"]["met"] is False


def test_llama_cpp_under_a_cap_is_its_own_build_with_the_capped_features(monkeypatch, tmp_path):
    """A capped run's llama-server is built apart, from the capped flags, and a build is taken only where the
    options it noted are the ones this CPU (capped or not) gives."""
    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path)
    monkeypatch.delenv(MAX_ISA_ENV, raising=False)
    native = peers.llama_cpp_bin("llama-server")
    monkeypatch.setenv(MAX_ISA_ENV, "avx2")
    capped = peers.llama_cpp_bin("llama-server")
    assert native.parent.parent.name == "build" and capped.parent.parent.name == "build-avx2"
    assert "-DGGML_AVX512=OFF" in vs_peers.ggml_cpu_options()
    setup = " ".join(vs_peers.setup_commands("llama-server"))
    assert f"-B {capped.parent.parent} " in setup and "-DGGML_AVX512=OFF" in setup
    build = capped.parent.parent
    assert vs_peers.built_for_this_cpu(capped)  # nothing noted
    build.mkdir(parents=True)
    (build / vs_peers.OPTIONS_FILE).write_text(" ".join(vs_peers.ggml_cpu_options()) + "\n")
    assert vs_peers.built_for_this_cpu(capped)
    (build / vs_peers.OPTIONS_FILE).write_text(" ".join(vs_peers.ggml_cpu_options()).replace("=OFF", "=ON"))
    assert not vs_peers.built_for_this_cpu(capped)
