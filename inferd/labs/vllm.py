"""vLLM: inferd against vLLM's CPU build on the same workload, with figures from one run only: measured now where
vLLM is installed (`benchmarks/vs_peers.py --setup vllm`) and its server imports, else the newest stored run with
both servers (this CPU kind's file first), shown with that run's own date, commit and CPU, never as this machine's."""

from __future__ import annotations

from pathlib import Path

from inferd import cpu
from inferd.bench import peers, runs
from inferd.bench.results import machine_info
from inferd.config import DEFAULT_MODEL
from inferd.errors import InferdError
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext, shown_path

REPO = Path(__file__).resolve().parents[2]
RESULTS, VS_PEERS = REPO / "benchmarks" / "results", REPO / "benchmarks" / "vs_peers.py"
HOW_TO_RUN = (
    "python benchmarks/vs_peers.py --setup model && python benchmarks/vs_peers.py --setup vllm, then "
    "`inferd lab vllm` (or python benchmarks/vs_peers.py --servers inferd,vllm --interleave)"
)
VLLM_SERVERS = ("vllm", "vllm-fp32")  # benchmarks/vs_peers.py's names for vLLM in bf16 and fp32, faster first
LIVE_ARGS = ["--workloads", "mixed", "--concurrency", "1,16", "--runs", "1", "--interleave", "--fresh"]
LIVE_TIMEOUT_S = 1800.0  # vLLM's start-up alone may take up to 15 minutes (torch.compile warm-up)
STOP_GRACE_S = 150.0  # the script stops each server it started (up to 60 s each) once interrupted


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
    return peers.importable(python, "vllm.entrypoints.openai.api_server", "vLLM's server", 300.0)


def run_live(ctx: LabContext) -> tuple[Path, dict]:
    """benchmarks/vs_peers.py with inferd and vLLM up at once, its run file in ctx.out; that run."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    out, log = (ctx.out / "vllm-vs_peers.json").resolve(), ctx.workdir / "vllm-vs_peers.log"
    # bf16 where the CPU computes it natively (1.5-1.8x fp32 there; elsewhere it crawls), as inferd's auto dtype
    peer = "vllm" if {"avx512_bf16", "amx_bf16"} & cpu.cpu_flags() else "vllm-fp32"
    return out, peers.run_side_by_side(VS_PEERS, ["inferd", peer], LIVE_ARGS, out, log, LIVE_TIMEOUT_S, STOP_GRACE_S)


def from_run(run: dict, peer: str, workload: str | None, levels: list[str], source: str, live: bool) -> Measurement:
    """The lab's numbers from one run's inferd and vLLM figures at the levels both ran, and what that run was."""
    machine, vllm, w = run.get("machine", {}), run["servers"][peer], run.get("workload")
    cpu_rec = run.get("cpu") or {"model": machine.get("cpu_model") or machine.get("processor"), "flags": None}
    if workload is not None:
        what = f"the same prompts (the {workload} workload: {run['workloads'][workload]})"
    elif isinstance(w, dict):
        what = f"{w['input_len']}-token prompts and {w['output_len']} tokens out"
    else:
        what = f"a workload the record does not describe ({w or 'no description'})"
    settings = {k: run.get(k) for k in ("commit", "uncommitted_changes", "command", "converted", "note")}
    settings |= dict(source=source, date=run.get("date") or "an unknown date", run_source=run.get("source"))
    settings |= dict(cpu_model=cpu_rec.get("model") or "an unknown CPU", vector_flags=peers.vector_flags(cpu_rec))
    settings |= dict(cores=machine.get("cpu_count"), run_kind=runs.run_kind(run), workload=what)
    settings |= dict(vllm_dtype=vllm.get("dtype") or ("float32" if "fp32" in peer else "bf16"), live=live)
    m = Measurement(settings=settings, series={"c": [peers.concurrency(k) for k in levels]}, measured_here=live)
    for name, entry in (("inferd", run["servers"]["inferd"]), ("vllm", vllm)):
        m.series[f"{name}_tok_s"] = [peers.figures(entry, workload)[k]["output_throughput"] for k in levels]
    m.ends("c", "inferd_tok_s", "vllm_tok_s")
    m.numbers["ratio_hi"] = m.numbers["inferd_tok_s_hi"] / m.numbers["vllm_tok_s_hi"]
    return m


def measure(ctx: LabContext, stored: Path | None = None) -> Measurement:
    python = peers.peer_python("vllm")
    if (reason := why_not_live(ctx, python)) is None:
        try:
            out, run = run_live(ctx)
        except peers.RunFailed as e:
            reason = f"vLLM is installed here, but the side-by-side run failed: {e}"
        else:
            if found := peers.latest_pair({"runs": [run]}, "inferd", VLLM_SERVERS):
                return from_run(run, *found[1:], shown_path(out), live=True)
            reason = f"the side-by-side run left no level with figures from both servers ({out})"
    # else the newest stored run in which inferd and vLLM both ran a level: that run's figures only
    stored = stored or peers.newest_pair_file(RESULTS, cpu.cpu_kind(), "inferd", VLLM_SERVERS)
    if not stored.exists():
        raise InferdError(f"no stored vLLM result at {stored}; measure one with: {HOW_TO_RUN}")
    if (found := peers.latest_pair(data := peers.load(stored), "inferd", VLLM_SERVERS)) is None:
        raise InferdError(
            f"no concurrency level measured for both inferd and vLLM in one run of {stored}; run: {HOW_TO_RUN}"
        )
    m = from_run(data["runs"][found[0]], *found[1:], shown_path(stored), live=False)
    m.settings |= dict(why_not_live=reason, run_index=found[0], runs_in_file=len(data["runs"]))
    m.settings |= dict(this_cpu=machine_info().get("cpu_model") or "an unknown CPU", this_kind=cpu.cpu_kind())
    return m


def explain(m: Measurement) -> Explanation:
    s = m.settings
    claims = [
        m.decide(
            "vllm_tok_s_hi > vllm_tok_s_lo",
            yes="vLLM's output throughput rose from {vllm_tok_s_lo} tokens/s at concurrency {c_lo} to "
            "{vllm_tok_s_hi} at {c_hi}: continuous batching over PagedAttention, as in inferd.",
            no="vLLM's output throughput did not rise with concurrency: {vllm_tok_s_lo} at {c_lo}, "
            "{vllm_tok_s_hi} at {c_hi}.",
        ),
        m.either(
            "inferd_tok_s_hi >= vllm_tok_s_hi",
            yes="At concurrency {c_hi} inferd reached {inferd_tok_s_hi} tokens/s against vLLM's {vllm_tok_s_hi}.",
            no="At concurrency {c_hi} inferd reached {inferd_tok_s_hi} tokens/s against vLLM's {vllm_tok_s_hi} "
            "({ratio_hi} of it): vLLM is ahead there.",
        ),
    ][m.numbers["c_hi"] == m.numbers["c_lo"] :]  # one level only: no rise to tell
    why = "Why it matters: vLLM is the reference point a platform is measured against: the OpenAI API, "
    why += "PagedAttention, continuous batching and prefix caching are what users expect of any engine behind it."
    if s["live"]:
        intro = f"Measured now on this machine ({s['cpu_model']}, {s['cores']} cores): `{s['command']}` started "
        intro += f"inferd and vLLM CPU in {s['vllm_dtype']} side by side and sent each level's requests to both in "
        intro += f"turn, serving Gemma 3 270M with {s['workload']}. The whole run is in {s['source']}."
        return Explanation([intro], claims, [why])
    where = s["cpu_model"] + (f" with {s['cores']} cores" if s["cores"] else "")
    where += f" ({s['vector_flags']})" if s["vector_flags"] is not None else ""
    text = "These figures are stored, not measured now: "
    if s["converted"]:
        text += f"{s['source']} holds one record, last written on {s['date']} on {where}, {s['converted']}"
        text += " (its note, in the file, says which)." if s["note"] else "."
    else:
        commit = (s["commit"] or "unknown")[:12] + (" with uncommitted changes" if s["uncommitted_changes"] else "")
        made = f": {s['run_source']}." if s["run_source"] else f" at commit {commit} by `{s['command']}`."
        text += f"run {s['run_index'] + 1} of {s['runs_in_file']} in {s['source']}, the newest with both servers, made "
        text += f"on {s['date']} on {where}{made} Only its figures are compared: the CPU, the code and a shared "
        text += "machine's speed change from one run to the next."
    text += f" This machine's CPU is {s['this_cpu']} ({s['this_kind']}; the run's: {s['run_kind'] or 'not recorded'})."
    text += f" Both servers (inferd and vLLM CPU in {s['vllm_dtype']}) served Gemma 3 270M with {s['workload']}."
    what = "that record (last written" if s["converted"] else "that run (of"
    heading = f"What {what} {s['date']}, {s['cpu_model']}) showed:"
    not_here = f"Not measured here: {s['why_not_live']}. To measure it: {HOW_TO_RUN}."
    return Explanation([text, not_here], claims, [why], claims_heading=heading)


def plot(m: Measurement, fig) -> None:
    s, st = m.series, m.settings
    when = "Measured now" if st["live"] else ("Stored record, last written" if st["converted"] else "Stored run of")
    ys = {"inferd": s["inferd_tok_s"], f"vLLM CPU ({st['vllm_dtype']})": s["vllm_tok_s"]}
    title = f"{when} {st['date']}, {st['cpu_model']}"
    lines(fig, s["c"], ys, xscale="log", xlabel="concurrency", ylabel="output tokens/s", title=title)


LAB = Lab("vllm", "vLLM", measure, explain, plot, measured_here=False)
