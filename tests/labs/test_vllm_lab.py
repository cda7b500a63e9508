"""`inferd lab vllm`: it runs vLLM live beside inferd where vLLM is installed and its server imports;
elsewhere it shows the newest stored run with both servers, with that run's own date, commit and CPU, never
as this machine's or this run's figures, and never pairing figures from two runs."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferd import procs
from inferd.bench import peers
from inferd.labs import vllm
from inferd.labs.context import LabContext
from inferd.labs.runner import check_result, run_lab, write_glossary_page, write_report

pytestmark = pytest.mark.timeout(120)

REPO = Path(vllm.__file__).resolve().parents[2]


def _entry(levels: dict[int, float]) -> dict:
    figures = {
        f"concurrency={c}": {"median": {"output_throughput": t, "mean_ttft_ms": 100.0}} for c, t in levels.items()
    }
    return {"workloads": {"mixed": figures}, "error": None}


def _run(date: str, cpu: str, servers: dict, **extra) -> dict:
    return {
        "date": date,
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "uncommitted_changes": False,
        "cpu": {"model": cpu, "flags": ["avx2", "avx512f", "avx512_bf16", "sse4_2"]},
        "machine": {"cpu_model": cpu, "cpu_count": 2},
        "command": "python benchmarks/vs_peers.py --servers inferd,vllm --interleave",
        "workloads": {"mixed": "random dataset, prompts 115-461 tokens"},
        "servers": servers,
        **extra,
    }


def _runs_file(path: Path) -> Path:
    runs = [
        _run("2026-12-01 10:00 UTC", "Old CPU", {"inferd": _entry({16: 100.0}), "vllm": _entry({16: 400.0})}),
        _run(
            "2026-12-02 10:00 UTC",
            "Paired CPU",
            {"inferd": _entry({1: 30.0, 32: 300.0}), "vllm": _entry({1: 25.0, 32: 250.0})},
        ),
        # newer runs with one of the two servers each: their figures must not be paired with each other
        _run("2026-12-03 10:00 UTC", "Inferd-only CPU", {"inferd": _entry({1: 50.0, 32: 900.0})}),
        _run("2026-12-04 10:00 UTC", "vLLM-only CPU", {"vllm": _entry({1: 10.0, 32: 90.0})}),
    ]
    path.write_text(json.dumps({"format": "runs", "runs": runs}))
    return path


@pytest.fixture
def no_peer(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERD_PEERS_DIR", str(tmp_path / "no-peers"))  # vLLM not installed, whatever this host has


def test_stored_figures_come_from_one_run_with_its_own_date_and_cpu(no_peer, tmp_path):
    ctx = LabContext(quick=True, model="unused", workdir=tmp_path / "w")
    m = vllm.measure(ctx, _runs_file(tmp_path / "runs.json"))
    assert m.measured_here is False and m.settings["run_index"] == 1
    assert m.series == {"c": [1, 32], "inferd_tok_s": [30.0, 300.0], "vllm_tok_s": [25.0, 250.0]}
    text = vllm.explain(m).text("vLLM")
    assert "2026-12-02 10:00 UTC" in text and "Paired CPU" in text and "0123456789ab" in text
    assert "avx2 avx512f avx512_bf16" in text and "run 2 of 4" in text and "--servers inferd,vllm" in text
    assert "What that run (of 2026-12-02 10:00 UTC, Paired CPU) showed:" in text
    for misleading in ("this run", "What this machine showed", "same machine", "Measured now", "one record"):
        assert misleading not in text
    assert "vLLM is not installed here" in text
    for other in ("Old CPU", "Inferd-only CPU", "vLLM-only CPU", "900", "90.0"):
        assert other not in text


def test_a_converted_record_says_its_figures_may_come_from_different_invocations(no_peer, tmp_path):
    legacy = {
        "machine": {"cpu_model": "Legacy CPU", "cpu_count": 2},
        "workloads": {"mixed": "random dataset"},
        "date": "2026-11-30 19:39 UTC",
        "note": "two invocations",
        "servers": {"inferd": _entry({16: 136.5, 32: 231.2}), "vllm": _entry({16: 191.0, 32: 254.9})},
    }
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps(legacy))
    ctx = LabContext(quick=True, model="unused", workdir=tmp_path / "w")
    text = vllm.explain(vllm.measure(ctx, path)).text("vLLM")
    assert "last written on 2026-11-30 19:39 UTC on Legacy CPU" in text
    assert "may come from different invocations" in text and "only figures from that one run" not in text
    assert "What that record (last written 2026-11-30 19:39 UTC, Legacy CPU) showed:" in text


def test_no_run_with_both_servers_is_an_error_not_a_pairing_across_runs(no_peer, tmp_path):
    from inferd.errors import InferdError

    path = tmp_path / "runs.json"
    runs = json.loads(_runs_file(path).read_text())["runs"][2:]
    path.write_text(json.dumps({"format": "runs", "runs": runs}))
    with pytest.raises(InferdError, match="no concurrency level measured for both inferd and vLLM in one run of"):
        vllm.measure(LabContext(quick=True, model="unused", workdir=tmp_path / "w"), path)


def test_the_glossary_page_and_title_of_a_stored_result_do_not_say_measured(no_peer, tmp_path):
    stored = _runs_file(tmp_path / "runs.json")
    lab = dataclasses.replace(vllm.LAB, measure=lambda ctx: vllm.measure(ctx, stored))
    ctx = LabContext(quick=True, model="unused", workdir=tmp_path / "w", out=tmp_path / "out")
    result = run_lab(lab, ctx)
    assert result.measured_here is False and result.text.startswith("vLLM: a stored result")
    assert check_result(result) == []
    page = write_glossary_page(result, tmp_path / "docs").read_text()
    assert "Measured by" not in page and "from a stored result" in page
    report = write_report([result], ctx, tmp_path / "out").read_text()
    assert "measured in this run except under vLLM, which shows a stored run's figures" in report


def test_the_committed_glossary_page_does_not_call_stored_figures_measured():
    page = (REPO / "docs" / "glossary" / "vllm.md").read_text()
    live = "Measured now on this machine" in page
    assert ("Measured by" in page) == live and ("from a stored result" in page) == (not live)
    assert "this run" not in page


def _fake_python(tmp_path: Path, code: int, message: str = "") -> Path:
    python = tmp_path / "peers" / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit {code}\n")
    python.chmod(0o755)
    return python


def test_vllm_runs_live_only_when_its_server_imports(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_PEERS_DIR", str(tmp_path / "peers"))
    real = LabContext(quick=False, workdir=tmp_path / "w")  # the default model (not loaded by this lab)
    assert "not installed" in vllm.why_not_live(real, peers.peer_python("vllm"))
    python = _fake_python(tmp_path, 1, "ModuleNotFoundError: No module named vllm")
    assert peers.peer_python("vllm") == python
    assert "cannot import vLLM's server (ModuleNotFoundError: No module named vllm)" in vllm.why_not_live(real, python)
    python.write_text("#!/bin/sh\nexit 0\n")
    assert vllm.why_not_live(real, python) is None
    assert "--quick" in vllm.why_not_live(LabContext(quick=True, model="unused", workdir=tmp_path / "w"), python)
    other = LabContext(quick=False, model="some/other-model", workdir=tmp_path / "w")
    assert "default model" in vllm.why_not_live(other, python)


def test_an_installed_vllm_is_measured_live_beside_inferd(tmp_path, monkeypatch):
    """The live path end to end except the servers: the script's command line and its run file."""
    seen = {}

    def fake_script(cmd, log, timeout_s, grace_s=0.0, **kw):
        seen["cmd"] = cmd
        out = Path(cmd[cmd.index("--out") + 1])
        peer = cmd[cmd.index("--servers") + 1].split(",")[1]
        servers = {"inferd": _entry({1: 40.0, 16: 320.0}), peer: _entry({1: 30.0, 16: 200.0}) | {"dtype": "fp32"}}
        run = _run("2027-01-01 12:00 UTC", "This CPU", servers)
        out.write_text(json.dumps({"format": "runs", "runs": [run]}))
        return 0

    monkeypatch.setattr(vllm, "why_not_live", lambda ctx, python: None)
    monkeypatch.setattr(procs, "run_bounded", fake_script)
    monkeypatch.setattr("inferd.cpu.cpu_flags", lambda: frozenset({"avx2", "fma"}))  # no native bf16
    ctx = LabContext(quick=False, workdir=tmp_path / "w", out=tmp_path / "out")
    result = run_lab(vllm.LAB, ctx)
    cmd = seen["cmd"]
    assert (
        cmd[1] == str(vllm.VS_PEERS) and "--interleave" in cmd and cmd[cmd.index("--servers") + 1] == "inferd,vllm-fp32"
    )
    assert result.measured_here is True and result.text.startswith("vLLM: measured on")
    assert (
        "Measured now on this machine (This CPU, 2 cores)" in result.text and "What this machine showed:" in result.text
    )
    assert "vLLM CPU in fp32 side by side" in result.text
    assert "stored" not in result.text and check_result(result) == []
    assert result.numbers["inferd_tok_s_hi"] == 320.0 and result.numbers["vllm_tok_s_hi"] == 200.0


def test_a_failed_live_run_shows_the_stored_run_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm, "why_not_live", lambda ctx, python: None)

    def failing(cmd, log, timeout_s, grace_s=0.0, **kw):
        log.write_text("the default model is not converted yet\n")
        return 1

    monkeypatch.setattr(procs, "run_bounded", failing)
    ctx = LabContext(quick=False, workdir=tmp_path / "w", out=tmp_path / "out")
    m = vllm.measure(ctx, _runs_file(tmp_path / "runs.json"))
    assert m.measured_here is False
    text = vllm.explain(m).text("vLLM")
    assert (
        "the side-by-side run failed: benchmarks/vs_peers.py exited with 1: the default model is not converted" in text
    )


CHILD = """
import pathlib, signal, sys, time
done = pathlib.Path(sys.argv[1])
if sys.argv[2] == "deaf":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    time.sleep(60)
finally:
    done.write_text("cleaned up")
"""


@pytest.mark.parametrize("kind", ["cooperative", "deaf"])
def test_a_live_run_past_its_time_is_interrupted_and_ended(tmp_path, kind):
    """Past its timeout the script gets Ctrl-C, so its own clean-up stops the servers it started; one that
    ignores it is killed after the grace period. Either way nothing is left running."""
    done = tmp_path / "done"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    t0 = time.monotonic()
    # timeout_s leaves the child's interpreter time to start and reach its `try` under a loaded suite: with 1 s,
    # Ctrl-C once came before it, and the default handler ended it without its clean-up
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run_bounded([sys.executable, str(script), str(done), kind], tmp_path / "log", timeout_s=4, grace_s=3)
    assert time.monotonic() - t0 < 20
    assert done.exists() == (kind == "cooperative")
    # the process group is gone
    alive = [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p).endswith(f"{script} {done} {kind}")]
    assert alive == []


def test_a_live_run_is_interrupted_even_where_this_process_ignores_ctrl_c(tmp_path):
    """A parent started with SIGINT ignored (a background job of a script) would hand that to the command through
    exec, and a Python command then never raises KeyboardInterrupt: run_bounded gives it the default back."""
    done = tmp_path / "done"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            procs.run_bounded([sys.executable, str(script), str(done), "cooperative"], tmp_path / "log", 4, 3)
    finally:
        signal.signal(signal.SIGINT, before)
    assert done.read_text() == "cleaned up"


def test_a_live_run_past_its_time_fails_naming_its_log(tmp_path, monkeypatch):
    def slow(cmd, log, timeout_s, grace_s, **kw):
        raise subprocess.TimeoutExpired(cmd, timeout_s)

    monkeypatch.setattr(procs, "run_bounded", slow)
    with pytest.raises(peers.RunFailed, match="no result after 1 s"):
        peers.run_side_by_side(vllm.VS_PEERS, ["inferd", "vllm"], [], tmp_path / "o.json", tmp_path / "log", 1, 1)


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@pytest.mark.parametrize(("flags", "peer"), [({"avx2", "avx512f", "avx512_bf16"}, "vllm"), ({"avx2"}, "vllm-fp32")])
def test_the_live_run_starts_vllm_in_its_faster_dtype_beside_the_labs_results(tmp_path, monkeypatch, flags, peer):
    """vLLM in bf16 where this CPU computes it natively, else fp32; the run's file goes beside the lab's own
    results, not into the committed benchmarks/results/."""
    seen = {}

    def capture(cmd, log, timeout_s, grace_s=0.0, **kw):
        seen["out"], seen["servers"] = Path(cmd[cmd.index("--out") + 1]), cmd[cmd.index("--servers") + 1]
        return 1

    monkeypatch.setattr(procs, "run_bounded", capture)
    monkeypatch.setattr("inferd.cpu.cpu_flags", lambda: frozenset(flags))
    ctx = LabContext(quick=False, workdir=tmp_path / "w", out=tmp_path / "out")
    with pytest.raises(peers.RunFailed):
        vllm.run_live(ctx)
    assert seen["servers"] == f"inferd,{peer}"
    assert seen["out"].is_relative_to(tmp_path) and os.fspath(seen["out"]).endswith(".json")


def test_the_stored_run_comes_from_this_cpu_kinds_file_else_the_newest_pair(no_peer, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    old = _run("2026-12-01 10:00 UTC", "Xeon", {"inferd": _entry({16: 100.0}), "vllm": _entry({16: 90.0})})
    new = _run("2026-12-05 10:00 UTC", "Zen 3", {"inferd": _entry({16: 50.0}), "vllm-fp32": _entry({16: 40.0})})
    alone = _run("2026-12-09 10:00 UTC", "Zen 5", {"inferd": _entry({16: 70.0})})  # no vLLM: no pair
    for kind, run in (("xeon-amx", old), ("zen3", new), ("zen5", alone)):
        (results / f"vs_peers-{kind}.json").write_text(json.dumps({"format": "runs", "runs": [run]}))

    def stored_file(results, kind):
        return peers.newest_pair_file(results, kind, "inferd", vllm.VLLM_SERVERS)

    assert stored_file(results, "xeon-amx") == results / "vs_peers-xeon-amx.json"  # its own kind's
    assert stored_file(results, "zen5") == results / "vs_peers-zen3.json"  # the newest pair elsewhere
    assert stored_file(tmp_path / "none", "zen5") == tmp_path / "none" / "vs_peers-zen5.json"


def test_a_record_of_unknown_workload_and_commit_says_where_it_comes_from(no_peer, tmp_path):
    probe = {
        "date": "2026-11",
        "cpu": {"model": "Probe CPU", "flags": None},
        "machine": {},
        "source": "an independent probe's measurement; no commit recorded",
        "workload": "not recorded",
        "servers": {
            "inferd": {"levels": {"concurrency=1": {"output_throughput": 20.0}}},
            "vllm": {"dtype": "bfloat16", "levels": {"concurrency=1": {"output_throughput": 30.0}}},
        },
    }
    path = tmp_path / "vs_peers-zen5.json"
    path.write_text(json.dumps({"format": "runs", "runs": [probe]}))
    m = vllm.measure(LabContext(quick=True, model="unused", workdir=tmp_path / "w"), path)
    text = vllm.explain(m).text("vLLM")
    assert "an independent probe's measurement; no commit recorded" in text and "Probe CPU" in text
    assert "a workload the record does not describe (not recorded)" in text and "None" not in text
    assert m.numbers["inferd_tok_s_hi"] == 20.0 and m.numbers["vllm_tok_s_hi"] == 30.0
