"""vLLM: inferd against vLLM's CPU build on the same workload, with figures from one run only.

Where vLLM is installed as `benchmarks/vs_peers.py --setup vllm` installs it (its own virtual environment
under ~/.cache/inferd-peers, or INFERD_PEERS_DIR, started as `python -m vllm.entrypoints.openai.api_server`)
and its server imports, the lab runs that script: inferd and vLLM up side by side, each level's requests sent
to both in turn, measured now on this machine. Elsewhere (and with --quick, which has no minutes for vLLM's
start-up, or with another model than the default one the script serves) it shows the newest stored run in
which both servers ran a common level as a stored result, with that run's own date, commit and CPU: from
this kind of CPU's file (benchmarks/results/vs_peers-<kind>.json) where it holds one, else from the file
with the newest such run; never as this machine's figures, and never pairing figures from two runs, since
the CPU, the code and a shared machine's speed change from one run to the next.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from inferd import cpu, procs
from inferd.bench import peers, runs
from inferd.config import DEFAULT_MODEL
from inferd.errors import InferdError
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext, shown_path

DEFINITION = (
    "open-source, PagedAttention plus continuous batching, OpenAI-compatible server. The fast path to a running "
    "endpoint and the default starting point."
)
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
VS_PEERS = REPO / "benchmarks" / "vs_peers.py"
HOW_TO_RUN = (
    "python benchmarks/vs_peers.py --setup model && python benchmarks/vs_peers.py --setup vllm, then "
    "`inferd lab vllm` (or python benchmarks/vs_peers.py --servers inferd,vllm --interleave)"
)
# benchmarks/vs_peers.py's names for vLLM in bf16 and in fp32, the faster first where both ran
VLLM_SERVERS = ("vllm", "vllm-fp32")
# the live run: the two servers side by side, one run per level, the levels the claims compare
LIVE_ARGS = ["--workloads", "mixed", "--concurrency", "1,16", "--runs", "1", "--interleave", "--fresh"]
LIVE_TIMEOUT_S = 1800.0  # vLLM's start-up alone may take up to 15 minutes (torch.compile warm-up)
IMPORT_TIMEOUT_S = 300.0
STOP_GRACE_S = 150.0  # the script stops each server it started (up to 60 s each) once interrupted


class LiveRunFailed(Exception):
    pass


def live_vllm() -> str:
    """vLLM in bf16 where the CPU computes bf16 natively (1.5-1.8x its fp32 there), else in fp32 (bf16 without
    native support crawls): the faster of its two modes, as inferd's auto dtype picks between the same two."""
    return "vllm" if {"avx512_bf16", "amx_bf16"} & cpu.cpu_flags() else "vllm-fp32"


def why_not_live(ctx: LabContext, python: Path) -> str | None:
    """None when the lab can run vLLM here now; else the reason it shows a stored run instead."""
    if not python.exists():
        return f"vLLM is not installed here ({peers.home_path(python)} does not exist)"
    if not VS_PEERS.exists():
        return f"{VS_PEERS} is not in this installation"
    if ctx.quick:
        return "vLLM is installed here, but --quick leaves no time for its start-up (minutes)"
    if ctx.model != DEFAULT_MODEL:
        return f"the side-by-side run serves the default model ({DEFAULT_MODEL}), not {ctx.model}"
    return peers.importable(python, "vllm.entrypoints.openai.api_server", "vLLM's server", IMPORT_TIMEOUT_S)


def run_bounded(cmd: list[str], log: Path, timeout_s: float, grace_s: float = STOP_GRACE_S) -> int:
    """`cmd` run by `inferd.procs.run_bounded` (interrupted past `timeout_s`, never left running)."""
    try:
        return procs.run_bounded(cmd, log, timeout_s, grace_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        raise LiveRunFailed(f"no result after {timeout_s:.0f} s (log: {log})") from None


def run_live(ctx: LabContext, timeout_s: float = LIVE_TIMEOUT_S) -> tuple[Path, dict]:
    """benchmarks/vs_peers.py with inferd and vLLM up at once, its run file in ctx.out; that run."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    out, log = (ctx.out / "vllm-vs_peers.json").resolve(), ctx.workdir / "vllm-vs_peers.log"
    cmd = [sys.executable, str(VS_PEERS), "--servers", f"inferd,{live_vllm()}", *LIVE_ARGS, "--out", str(out)]
    rc = run_bounded(cmd, log, timeout_s)
    if rc != 0:
        written = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        raise LiveRunFailed(f"benchmarks/vs_peers.py exited with {rc}: {(written or ['no output'])[-1]} (log: {log})")
    if not (found := peers.load(out)["runs"]):
        raise LiveRunFailed(f"benchmarks/vs_peers.py wrote no run to {out} (log: {log})")
    if errors := [f"{name}: {e['error']}" for name, e in found[-1]["servers"].items() if e.get("error")]:
        raise LiveRunFailed("; ".join(errors))
    return out, found[-1]


def _workload_text(run: dict, workload: str | None) -> str:
    if workload is None:
        w = run.get("workload")
        if not isinstance(w, dict):
            return f"a workload the record does not describe ({w or 'no description'})"
        return f"{w['input_len']}-token prompts and {w['output_len']} tokens out"
    return f"the same prompts (the {workload} workload: {run['workloads'][workload]})"


def from_run(run: dict, vllm_server: str, workload: str | None, levels: list[str], source: str) -> Measurement:
    """The lab's numbers from one run's inferd and vLLM figures at the levels both ran, and what that run was."""
    by_level = {
        "inferd": peers.figures(run["servers"]["inferd"], workload),
        "vllm": peers.figures(run["servers"][vllm_server], workload),
    }
    machine = run.get("machine", {})
    cpu = run.get("cpu") or {"model": machine.get("cpu_model") or machine.get("processor"), "flags": None}
    m = Measurement(
        settings={
            "source": source,
            "date": run.get("date") or "an unknown date",
            "commit": run.get("commit"),
            "uncommitted_changes": run.get("uncommitted_changes"),
            "cpu_model": cpu.get("model") or "an unknown CPU",
            "vector_flags": peers.vector_flags(cpu),
            "cores": machine.get("cpu_count"),
            "command": run.get("command"),
            "converted": run.get("converted"),
            "note": run.get("note"),
            "run_source": run.get("source"),
            "run_kind": runs.run_kind(run),
            "workload": _workload_text(run, workload),
            "how_to_run": HOW_TO_RUN,
            "vllm_server": vllm_server,
            "vllm_dtype": run["servers"][vllm_server].get("dtype") or ("float32" if "fp32" in vllm_server else "bf16"),
        }
    )
    m.series = {"concurrency": [peers.concurrency(k) for k in levels]}
    for name in ("inferd", "vllm"):
        m.series[name] = [by_level[name][k]["output_throughput"] for k in levels]
        m.series[name + "_ttft_ms"] = [by_level[name][k].get("mean_ttft_ms") for k in levels]
    lo, hi = levels[0], levels[-1]
    for side, key in (("lo", lo), ("hi", hi)):
        m.numbers[f"c_{side}"] = peers.concurrency(key)
        for name in ("inferd", "vllm"):
            m.numbers[f"{name}_tok_s_{side}"] = by_level[name][key]["output_throughput"]
    m.numbers["ratio_hi"] = m.numbers["inferd_tok_s_hi"] / m.numbers["vllm_tok_s_hi"]
    m.numbers["vllm_gain"] = m.numbers["vllm_tok_s_hi"] / m.numbers["vllm_tok_s_lo"]
    return m


def measure(ctx: LabContext, stored: Path | None = None) -> Measurement:
    python = peers.peer_python("vllm")
    reason = why_not_live(ctx, python)
    if reason is None:
        try:
            out, run = run_live(ctx)
        except LiveRunFailed as e:
            reason = f"vLLM is installed here, but the side-by-side run failed: {e}"
        else:
            found = peers.latest_pair({"runs": [run]}, "inferd", VLLM_SERVERS)
            if found:
                _, vllm_server, workload, levels = found
                m = from_run(run, vllm_server, workload, levels, shown_path(out))
                m.measured_here = True
                m.settings.update(live=True, vllm_python=peers.home_path(python))
                return m
            reason = f"the side-by-side run left no level with figures from both servers ({out})"
    m = stored_measurement(stored or peers.newest_pair_file(RESULTS, cpu.cpu_kind(), "inferd", VLLM_SERVERS))
    m.settings["why_not_live"] = reason
    return m


def stored_measurement(stored: Path) -> Measurement:
    """The newest stored run in which inferd and vLLM both ran a level: that run's figures only."""
    if not stored.exists():
        raise InferdError(f"no stored vLLM result at {stored}; measure one with: {HOW_TO_RUN}")
    data = peers.load(stored)
    found = peers.latest_pair(data, "inferd", VLLM_SERVERS)
    if found is None:
        raise InferdError(
            f"no concurrency level measured for both inferd and vLLM in one run of {stored}; run: {HOW_TO_RUN}"
        )
    index, vllm_server, workload, levels = found
    m = from_run(data["runs"][index], vllm_server, workload, levels, shown_path(stored))
    m.measured_here = False
    from inferd.bench.results import machine_info

    m.settings.update(
        live=False,
        run_index=index,
        runs_in_file=len(data["runs"]),
        this_cpu=machine_info().get("cpu_model") or "an unknown CPU",
        this_kind=cpu.cpu_kind(),
    )
    return m


def _stored_intro(s: dict) -> str:
    where = s["cpu_model"] + (f" with {s['cores']} cores" if s["cores"] else "")
    if s["vector_flags"] is not None:
        where += f" ({s['vector_flags']})"
    if s["converted"]:
        text = (
            f"These figures are stored, not measured now: {s['source']} holds one record, last written on "
            f"{s['date']} on {where}, from before each invocation of benchmarks/vs_peers.py was kept as its own "
            "run, so its inferd and vLLM figures may come from different invocations"
            + (" (its note, in the file, says which invocations it holds)." if s["note"] else ".")
        )
        compared = "newer records keep each invocation as its own run, and the lab compares figures within one"
    elif s["run_source"]:
        text = (
            f"These figures are stored, not measured now: run {s['run_index'] + 1} of {s['runs_in_file']} in "
            f"{s['source']}, the newest with both servers, of {s['date']} on {where}: {s['run_source']}."
        )
        compared = "only figures from that one run are compared"
    else:
        commit = (s["commit"] or "unknown")[:12] + (" with uncommitted changes" if s["uncommitted_changes"] else "")
        text = (
            f"These figures are stored, not measured now: run {s['run_index'] + 1} of {s['runs_in_file']} in "
            f"{s['source']}, the newest with both servers, made on {s['date']} at commit {commit} on {where} by "
            f"`{s['command']}`."
        )
        compared = "only figures from that one run are compared"
    if s["run_kind"] is None:
        same = s["this_cpu"] == s["cpu_model"]
        this = f"{s['this_cpu']}{' too' if same else ', another one'}"
    elif s["run_kind"] == s["this_kind"]:
        this = f"{s['this_cpu']}, of the same kind ({s['this_kind']})"
    else:
        this = f"{s['this_cpu']}, of another kind ({s['this_kind']}; the run's: {s['run_kind']})"
    text += (
        f" This machine's CPU is {this}. Both servers (inferd "
        f"and vLLM CPU in {s['vllm_dtype']}) served Gemma 3 270M with {s['workload']}; {compared}: the CPU "
        "generation, the code and the machine's speed change from one run to the next."
    )
    return text


def explain(m: Measurement) -> Explanation:
    n, s = m.numbers, m.settings
    claims = []
    if n["c_hi"] > n["c_lo"]:
        claims.append(
            m.decide(
                "vllm_tok_s_hi > vllm_tok_s_lo",
                yes="vLLM's output throughput rose from {vllm_tok_s_lo} tokens/s at concurrency {c_lo} to "
                "{vllm_tok_s_hi} at {c_hi}: continuous batching over PagedAttention, as in inferd.",
                no="vLLM's output throughput did not rise with concurrency: {vllm_tok_s_lo} at {c_lo}, "
                "{vllm_tok_s_hi} at {c_hi}.",
            )
        )
    claims.append(
        m.decide(
            "inferd_tok_s_hi >= vllm_tok_s_hi",
            textbook=False,
            yes="At concurrency {c_hi} inferd reached {inferd_tok_s_hi} tokens/s against vLLM's {vllm_tok_s_hi}.",
            no="At concurrency {c_hi} inferd reached {inferd_tok_s_hi} tokens/s against vLLM's {vllm_tok_s_hi} "
            "({ratio_hi} of it): vLLM is ahead there.",
        )
    )
    intro: list[str] = []
    if s.get("live"):
        intro.append(
            f"Measured now on this machine ({s['cpu_model']}, {s['cores']} cores): `{s['command']}` started "
            f"inferd and vLLM CPU in {s['vllm_dtype']} side by side and sent each level's requests to both in "
            f"turn, serving Gemma 3 270M with {s['workload']}. The whole run, with every figure, is in "
            f"{s['source']}."
        )
        heading = "What this machine showed:"
    else:
        intro += [_stored_intro(s), f"Not measured here: {s['why_not_live']}. To measure it: {s['how_to_run']}."]
        record = "that record (last written" if s["converted"] else "that run (of"
        heading = f"What {record} {s['date']}, {s['cpu_model']}) showed:"
    why = [
        "Why it matters: vLLM is the reference point a platform is measured against: the OpenAI API, "
        "PagedAttention, continuous batching and prefix caching are what users expect of any engine behind it."
    ]
    return Explanation(intro, claims, why, claims_heading=heading)


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots(1, 1)
    s = m.series
    xs = range(len(s["concurrency"]))
    ax.bar([x - 0.2 for x in xs], s["inferd"], width=0.4, label="inferd")
    ax.bar([x + 0.2 for x in xs], s["vllm"], width=0.4, label=f"vLLM CPU ({m.settings['vllm_dtype']})")
    ax.set_xticks(list(xs), [str(c) for c in s["concurrency"]])
    st = m.settings
    if st.get("live"):
        title = f"Measured now ({st['date']})"
    else:
        record = "Stored record, last written" if st.get("converted") else "Stored run of"
        title = f"{record} {st['date']}, {st['cpu_model']}"
    ax.set(xlabel="concurrency", ylabel="output tokens/s", title=title)
    ax.legend()


LAB = Lab("vllm", "vLLM", DEFINITION, measure, explain, plot, measured_here=False)
