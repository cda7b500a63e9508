"""The figures in README.md and docs/performance.md, rendered from the results files in benchmarks/results/.

Each table sits in its document between `<!-- figures:NAME -->` and `<!-- /figures -->`; this script
rewrites what lies between them from `benchmarks/results/<benchmark>-<kind>.json`, so a page and the files
cannot disagree. A new measurement is one benchmark run (it appends to its file) and one `report`.

    python -m benchmarks.report            # rewrite the tables
    python -m benchmarks.report --check    # exit 1, naming each table that differs (tests/test_docs.py runs it)

What is shown is the current figure of each configuration: per benchmark, CPU kind and configuration (a
concurrency level and the servers measured at it, a mode, a quality setting), the newest run that measured
it, labelled with its date and commit. Ratios are taken within one run only: the code, the CPU and a shared
machine's speed change from one run to the next, so a record whose servers may come from several
invocations (`converted`) is never paired. Older runs stay in the files; one marked `superseded` (with the
reason: code that has changed since for that mode, and no newer run of it) is not shown.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `inferd` importable from the checkout
from benchmarks.common import PREFIX_CACHE_RESET  # noqa: E402
from inferd.bench import peers  # noqa: E402
from inferd.cpu import KINDS, amd_core  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "README.md", ROOT / "docs" / "performance.md")
BLOCK = re.compile(r"(<!-- figures:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)
# the kinds README's table shows, this project's machines of today, each by its newest comparable runs; a kind
# is shown by its stand-in's where those are newer (the AVX512_BF16 machines measured so far were Zen 4s, kind
# `avx512-bf16`; the one `zen5` file is an outside probe's, which named no family)
README_KINDS = ("zen5", "xeon-amx", "zen3")
README_STAND_INS = {"zen5": "avx512-bf16", "zen3": "avx2"}
LEVELS = (1, 4, 16, 32)
README_LEVELS = (1, 16, 32)  # README stays short: single stream, and the two loads the targets name
# the columns of the side-by-side tables: inferd's default and best modes, then the peers
INFERD_COLUMNS = (
    (("inferd",), "inferd default"),  # its mode beside each figure: int8 for the GGUF where auto picks it
    # dequantized floats, or int8 where bf16 was default, or the GGUF's own blocks
    (("inferd-float", "inferd-int8", "inferd-gguf"), "inferd other mode"),
)
PEER_COLUMNS = (
    (("vllm", "vllm-fp32"), "vLLM CPU 0.32"),
    (("llama-server",), "llama-server Q4_K_M"),
)
COLUMNS = INFERD_COLUMNS + PEER_COLUMNS
REPRODUCE = (
    "python benchmarks/vs_peers.py --servers inferd,inferd-float,vllm,llama-server --workloads mixed "
    "--concurrency 1,16,32 --interleave"
)


# -- reading -------------------------------------------------------------------------------------------
def kinds_of(benchmark: str) -> dict[str, list[dict]]:
    """kind -> the runs of benchmarks/results/<benchmark>-<kind>.json, in the order of KINDS."""
    found = {}
    for path in RESULTS.glob(f"{benchmark}-*.json"):
        kind = path.stem.removeprefix(f"{benchmark}-")
        found[kind] = peers.load(path)["runs"] if benchmark == "vs_peers" else json.loads(path.read_text())["runs"]
    order = list(KINDS)
    return dict(sorted(found.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def newest(runs: list[dict], key: Callable[[dict], object]) -> dict[object, dict]:
    """config -> the newest run that measured it (`key` gives a run's configs); a file's runs are in the
    order they were taken, and superseded ones are left out."""
    best: dict[object, dict] = {}
    for run in runs:
        if run.get("superseded"):
            continue
        for config in key(run) or ():
            best[config] = run
    return best


# -- formatting ----------------------------------------------------------------------------------------
def num(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def short_dtype(dtype: str | None) -> str:
    text = dtype or ""
    return "bf16" if "bfloat16" in text else "fp32" if "float32" in text else text


def mode_label(server: dict) -> str:
    """'bf16', or 'int8, bf16' for a server whose weights ran quantized (its default's `auto` included)."""
    quant = next((q for q in ("int8", "int4", "gguf") if q in (server.get("quantization") or "")), None)
    dtype = short_dtype(server.get("dtype"))
    return f"{quant}, {dtype}" if quant else dtype


def cpu_label(kind: str, runs: list[dict]) -> str:
    """'AMD EPYC (Zen 4), 2 vCPUs, `avx512-bf16`': the CPU model (with its AMD core, where the run recorded its
    family) and cores the newest run that recorded them gave; the kind's description where none did."""
    named = [r for r in runs if (r.get("cpu") or {}).get("model")] or runs
    run = named[-1]
    cpu = run.get("cpu") or {}
    model = cpu.get("model")
    if not model:
        return f"{KINDS.get(kind, kind)}, `{kind}`"
    model = re.sub(r"\((R|TM)\)", "", model).replace("  ", " ").strip()
    core = amd_core(cpu.get("flags"), cpu.get("vendor"), cpu.get("family"))
    if core and "Zen" not in model:
        model += f" ({core})"
    machine = run.get("machine") or {}
    cores = machine.get("cpu_count") or machine.get("cores")
    return f"{model}{f', {cores} vCPUs' if cores else ''}, `{kind}`"


def run_label(run: dict) -> str:
    if run.get("source") and not run.get("commit"):
        return f"{run.get('date') or 'undated'}, {run['source']}"
    commit = run.get("commit")
    where = f"commit {commit[:10]}" if commit else "no commit recorded"
    if commit and run.get("uncommitted_changes"):
        where += " with uncommitted changes"
    return f"{run.get('date') or 'undated'}, {where}"


def command(run: dict) -> str | None:
    """The run's command line without its --out (the file it wrote is the one it is read from)."""
    text = run.get("command")
    if not text:
        return None
    words = shlex.split(text)
    while "--out" in words:
        i = words.index("--out")
        del words[i : i + 2]
    return shlex.join(words)


def how_measured(run: dict) -> str:
    cmd = command(run)
    text = f"`{cmd}`" if cmd else "command not recorded"
    if isinstance(run.get("workload"), str):
        text += f"; workload {run['workload']}"
    if run.get("note") and not run.get("converted"):
        text += f"; {run['note']}"
    return text


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


# -- inferd against its peers (vs_peers) ---------------------------------------------------------------
def level_figures(run: dict) -> dict[str, dict[int, dict]]:
    """server -> concurrency -> median figures, for the servers of a run that finished."""
    return peers.level_figures(run.get("servers", {}))


def peer_configs(run: dict, levels: tuple[int, ...] = LEVELS) -> list[int]:
    """The levels at which a run measured an inferd mode beside a peer (none in a converted record, whose
    servers may come from different invocations)."""
    if run.get("converted"):
        return []
    figs = level_figures(run)
    mine = {c for name, f in figs.items() if name.startswith("inferd") for c in f}
    theirs = {c for name, f in figs.items() if not name.startswith("inferd") for c in f}
    return sorted(c for c in mine & theirs if c in levels)


def current_peer_runs(runs: list[dict], levels: tuple[int, ...] = LEVELS) -> list[tuple[dict, list[int]]]:
    """The newest run at each level, with the levels it is shown for, oldest run first."""
    chosen: dict[int, list[int]] = {}
    for level, run in newest(runs, lambda r: peer_configs(r, levels)).items():
        chosen.setdefault(runs.index(run), []).append(level)
    return [(runs[i], sorted(levels)) for i, levels in sorted(chosen.items())]


def column_server(run: dict, names: tuple[str, ...]) -> str | None:
    figs = level_figures(run)
    return next((n for n in names if n in figs), None)


def cell(run: dict, names: tuple[str, ...], level: int, detail: bool) -> str:
    server = column_server(run, names)
    if server is None or level not in level_figures(run)[server]:
        return "—"
    m = level_figures(run)[server][level]
    text = num(m.get("output_throughput"))
    if server.startswith(("inferd", "vllm")):
        text += f" ({mode_label(run['servers'][server])})"
    if detail and m.get("mean_ttft_ms") is not None:
        text += f"; TTFT {num(m['mean_ttft_ms'], 0)} ms, ITL {num(m.get('mean_itl_ms'))} ms"
    return text


def ratio_lines(run: dict, levels: list[int], compact: bool = False) -> list[str]:
    """Within this run: each inferd mode's output throughput over each peer's, at the levels shown
    (`compact`: against llama-server, the single-stream peer, at concurrency 1 only)."""
    figs = level_figures(run)
    lines = []
    for mine, _ in INFERD_COLUMNS:
        me = column_server(run, mine)
        if me is None:
            continue
        mode = mode_label(run["servers"][me])
        mine_label = f"inferd default ({mode})" if me == "inferd" else f"inferd {mode}"
        parts = []
        for theirs, label in PEER_COLUMNS:
            peer = column_server(run, theirs)
            shared = [c for c in levels if peer and c in figs[me] and c in figs[peer]]
            if compact and peer == "llama-server":
                shared = [c for c in shared if c == 1]
            if not shared:
                continue
            r = [figs[me][c]["output_throughput"] / figs[peer][c]["output_throughput"] for c in shared]
            name = f"{label} ({short_dtype(run['servers'][peer].get('dtype'))})" if peer.startswith("vllm") else label
            where = "behind" if max(r) < 1 else "ahead" if min(r) > 1 else None
            at = f"at c={' / '.join(map(str, shared))}" + (f", {where} at each" if where and len(r) > 1 else "")
            parts.append(f"{' / '.join(times(x) for x in r)} {name} {at}")
        if parts:
            lines.append(f"{mine_label}: " + "; ".join(parts))
    return lines


def target_line(run: dict, levels: list[int]) -> str | None:
    """inferd's targets within this run (`inferd.bench.peers.targets`), at the levels shown."""
    figs = {name: {c: f for c, f in by.items() if c in levels} for name, by in level_figures(run).items()}
    out = []
    for t in peers.targets(figs):
        ttft = f", mean TTFT {times(t.ttft_ratio)}" if t.ttft_ratio is not None else ""
        out.append(f"{t.name} {times(t.ratio)}{ttft}, goal {times(t.goal)}: {'met' if t.met else 'not met'}")
    return "; ".join(out) or None


def peers_table(kind: str, runs: list[dict], detail: bool, shown: tuple[int, ...] = LEVELS) -> list[str]:
    rows = []
    for level, run in by_level(current_peer_runs(runs, shown)):
        rows.append([run.get("date") or "undated", str(level), *(cell(run, n, level, detail) for n, _ in COLUMNS)])
    return table(["run", "c", *(label for _, label in COLUMNS)], rows)


def by_level(current: list[tuple[dict, list[int]]]) -> list[tuple[int, dict]]:
    """(level, the run it is shown from), lowest concurrency first, whichever run each came from."""
    return sorted(((level, run) for run, levels in current for level in levels), key=lambda x: x[0])


def readme_kinds(data: dict[str, list[dict]]) -> list[str]:
    """The kinds README shows: for each of README_KINDS, it or its stand-in, whichever has the newer run that
    set inferd beside a peer."""
    shown = []
    for kind in README_KINDS:
        dated = [
            (max(run.get("date") or "" for run, _ in current), k)
            for k in (kind, README_STAND_INS.get(kind))
            if k in data and (current := current_peer_runs(data[k], README_LEVELS))
        ]
        if dated:
            shown.append(max(dated)[1])
    return shown


def render_how_fast() -> str:
    data = kinds_of("vs_peers")
    rows, notes = [], []
    for kind in readme_kinds(data):
        label = cpu_label(kind, data[kind])
        current = current_peer_runs(data[kind], README_LEVELS)
        for i, (level, run) in enumerate(by_level(current)):
            first = [label if i == 0 else "", run.get("date") or "undated", str(level)]
            rows.append(first + [cell(run, n, level, False) for n, _ in COLUMNS])
        for run, levels in current:
            notes.append(f"- {label}, {run_label(run)}: " + "; ".join(ratio_lines(run, levels, compact=True)) + ".")
    lines = [
        "Output tokens/s, Gemma 3 270M, streaming, medians of 3-5 runs with the servers interleaved, on each kind of "
        "CPU the project runs on (its newest runs; each row is one run: compare within a row, `—`: not in that "
        "run):",
        "",
        *table(["CPU", "run", "c", *(label for _, label in COLUMNS)], rows),
        "",
        *notes,
        "",
        f"Measure your CPU with `{REPRODUCE}` (setup: [benchmarks/README.md](benchmarks/README.md)); every kind "
        "measured, with latencies: [docs/performance.md](docs/performance.md#against-vllm-and-llama-server).",
    ]
    return "\n".join(lines) + "\n"


def render_vs_peers() -> str:
    lines = []
    for kind, runs in kinds_of("vs_peers").items():
        lines += [f"**{cpu_label(kind, runs)}**, `benchmarks/results/vs_peers-{kind}.json`", ""]
        lines += [*peers_table(kind, runs, detail=True), ""]
        for run, levels in current_peer_runs(runs):
            lines.append(f"- {run_label(run)}: {how_measured(run)}.")
            lines += [f"  {text}." for text in ratio_lines(run, levels)]
            if target := target_line(run, levels):
                lines.append(f"  Targets: {target}.")
        lines.append("")
    return "\n".join(lines)


# -- offline throughput --------------------------------------------------------------------------------
def offline_mode(run: dict) -> list[tuple] | None:
    """A run's mode (dtype, quantization, KV cache), where it ran the default settings otherwise."""
    w = run.get("workload") or {}
    if "inferd" not in run or w.get("cpu_linear", "onednn") != "onednn":
        return None
    if w.get("attention_backend") not in (None, "auto") or w.get("kv_cache_dtype") not in (None, "bfloat16", "float32"):
        return None
    dtype = w.get("dtype_chosen") or w.get("dtype")
    quant = w.get("quantization_chosen", w.get("quantization"))  # what ran, where recorded, else what was asked
    return [(short_dtype(dtype), "-" if quant in (None, "none") else quant, w.get("num_requests"))]


def step_split(parts: dict | None) -> str:
    """A decode step's shares (benchmarks.offline_throughput.step_parts): attention / linears / LM head / the
    rest (the small fused kernels, other ops, Python and scheduling)."""
    if not parts:
        return "—"
    rest = sum(parts[k]["share"] for k in ("other_ops", "unnamed", "small_kernels") if k in parts)
    return " / ".join(pct(x) for x in (*(parts[k]["share"] for k in ("attention", "linears", "lm_head")), rest))


def render_offline() -> str:
    lines = []
    for kind, runs in kinds_of("offline_throughput").items():
        current = newest(runs, offline_mode)
        rows, flagged = [], False
        for (dtype, quant, requests), run in sorted(current.items()):
            step = run.get("decode_step_batch32") or {}
            tok_s, first = cold(run, [r["output_tokens_per_s"] for r in run["inferd"].get("runs") or []])
            tok_s = tok_s or run["inferd"]["median_output_tokens_per_s"]
            hf = (run.get("transformers") or {}).get("median_output_tokens_per_s")
            flagged |= first
            rows.append([
                f"{dtype}{'' if quant == '-' else ' + ' + quant}", str(requests),
                num(tok_s) + (FIRST_ONLY if first else ""),
                num((step.get("step_seconds") or 0) * 1e3) if step.get("step_seconds") else "—",
                pct(step.get("fraction_of_peak")), step_split(step.get("parts")), times(tok_s / hf) if hf else "—",
                run_label(run),
            ])  # fmt: skip
        if not rows:
            continue
        lines += [f"**{cpu_label(kind, runs)}**, `benchmarks/results/offline_throughput-{kind}.json`", ""]
        split = "attention / linears / LM head / rest of the step"
        head = ["mode", "requests", "out tok/s", "batch-32 step, ms", "of the matmul peak", split]
        head += ["vs transformers", "run"]
        lines += [*table(head, rows), "", *([FIRST_ONLY_NOTE, ""] if flagged else [])]
    return "\n".join(lines)


# -- repeated prompts and the prefix cache ---------------------------------------------------------------
FIRST_ONLY = "¹"
FIRST_ONLY_NOTE = (
    f"{FIRST_ONLY} The run's first round only: its later rounds sent the same prompts again, and inferd's prefix "
    "cache served them (the benchmark now resets the cache before each round)."
)


def cold(run: dict, figures: list[float]) -> tuple[float | None, bool]:
    """inferd's figure of a run that repeated its prompts, and whether it is the first round's alone: the median
    where the run reset the prefix cache between rounds (`workload.prefix_cache`), else the first round."""
    if not figures:
        return None, False
    if (run.get("workload") or {}).get("prefix_cache") == PREFIX_CACHE_RESET or len(figures) == 1:
        return statistics.median(figures), False
    return figures[0], True


def quality_configs(run: dict) -> list[tuple]:
    return [(mode, m.get("rows") or 0) for mode, m in (run.get("modes") or {}).items() if mode != "fp32"]


def render_quality() -> str:
    lines = []
    for kind, runs in kinds_of("quality").items():
        rows = []
        for (mode, rows_per_pass), run in sorted(newest(runs, quality_configs).items(), key=lambda kv: kv[0][::-1]):
            m, ref = run["modes"][mode], run["modes"].get("fp32", {})
            a = m.get("agreement_with_fp32") or {}
            excess = m["perplexity"] / ref["perplexity"] - 1 if ref.get("perplexity") else None
            rows.append([
                mode, str(rows_per_pass or "many"), f"{m['perplexity']:.3f}",
                num(ref.get("perplexity"), 3), "—" if excess is None else f"{100 * excess:+.1f}%",
                pct(a.get("same_token_fraction")), pct(a.get("identical_sequences_fraction")),
                pct(a.get("first_token_agreement")), run_label(run),
            ])  # fmt: skip
        lines += [f"**{cpu_label(kind, runs)}**, `benchmarks/results/quality-{kind}.json`", ""]
        head = ["mode", "rows a pass", "perplexity", "fp32 (same run)", "excess", "same token", "identical seqs",
                "first token", "run"]  # fmt: skip
        lines += [*table(head, rows), ""]
    return "\n".join(lines)


def render_llama_perplexity() -> str:
    lines = []
    for kind, runs in kinds_of("perplexity_vs_llama_cpp").items():
        run = runs[-1]
        w, ref = run["workload"], run["llama_cpp"]
        rows = [["llama.cpp `llama-perplexity`", "the GGUF's blocks (its defaults: f16 KV cache)",
                 f"{ref['perplexity']:.3f} ± {ref['plus_minus']:.3f}", "1.000"]]  # fmt: skip
        for name, m in run["modes"].items():
            q = m["quantization"]
            weights = {"gguf": "the GGUF's blocks", None: "the GGUF dequantized"}.get(q, f"{q}, from the GGUF")
            rounded = ", rounded to int8 in the kernel" if q in ("gguf", "int8", "int4") else ""
            kv = f"; {m['kv_cache_dtype']} KV cache" if "kv_cache_dtype" in m else ""
            what = f"{weights}, {m['dtype']} activations{rounded}{kv}"
            rows.append([f"inferd `{name}`", what, f"{m['perplexity']:.3f}", f"{m['over_llama_cpp']:.3f}"])
        lines += [f"**{cpu_label(kind, runs)}**, {run_label(run)}; {w['chunks']} chunks of {w['ctx']} tokens, "
                  f"{w['chunks'] * w['scored_tokens_per_chunk']:,} tokens scored; ids: {w['ids']} "
                  f"(`benchmarks/results/perplexity_vs_llama_cpp-{kind}.json`)", ""]  # fmt: skip
        lines += [*table(["engine", "weights", "perplexity", "over llama.cpp's"], rows), ""]
    return "\n".join(lines)


# -- the server against offline ------------------------------------------------------------------------
def server_configs(run: dict) -> list[tuple]:
    quant = run.get("quantization_chosen", run.get("quantization"))  # what ran, where recorded
    return [(run.get("concurrency"), "-" if quant in (None, "none") else quant)] if "ratio" in run else []


def render_server_overhead() -> str:
    lines = []
    for kind, runs in kinds_of("server_overhead").items():
        rows = []
        for (concurrency, quant), run in sorted(newest(runs, server_configs).items()):
            pairs = [r["server"]["output_tokens_per_s"] / r["offline"]["output_tokens_per_s"] for r in run["runs"]]
            rows.append([
                str(concurrency), f"{short_dtype(run.get('dtype'))}{'' if quant == '-' else ' + ' + quant}",
                num(run["offline_output_tokens_per_s"]), num(run["server_output_tokens_per_s"]),
                f"**{run['ratio']:.3f}**", ", ".join(f"{p:.2f}" for p in pairs), run_label(run),
            ])  # fmt: skip
        lines += [f"**{cpu_label(kind, runs)}**, `benchmarks/results/server_overhead-{kind}.json`", ""]
        head = ["c", "mode", "offline out tok/s", "server out tok/s", "server / offline", "per pair", "run"]
        lines += [*table(head, rows), ""]
    return "\n".join(lines)


# -- kernels -------------------------------------------------------------------------------------------
def render_batch1() -> str:
    lines = []
    for kind, runs in kinds_of("batch1_step").items():
        run = runs[-1]
        rows = [[mode, num(m["weights_bytes"] / 1e6, 0), num(m["median_step_s"] * 1e3),
                 pct(m.get("fraction_of_bandwidth"))] for mode, m in run["modes"].items()]  # fmt: skip
        lines += [f"**{cpu_label(kind, runs)}**, {run_label(run)}; memory read bandwidth in the run "
                  f"{num(run.get('memory_read_gbs'))} GB/s", ""]  # fmt: skip
        lines += [*table(["mode", "weights read a step, MB", "batch-1 step, ms", "of the bandwidth"], rows), ""]
    return "\n".join(lines)


def render_kernels() -> str:
    lines = []
    for kind, runs in kinds_of("prefill_attention").items():
        run = runs[-1]
        rows = [[str(r["tokens"]), f"{r['native_ms']:.3f}", f"{r['sdpa_ms']:.3f}", times(r["speedup"])]
                for r in run["one_layer"]]  # fmt: skip
        rows += [[f"{r['tokens']} (whole prefill)", num(r["native_ms"]), num(r["sdpa_ms"]), times(r["speedup"])]
                 for r in run["whole_prefill"]]  # fmt: skip
        lines += [f"Prefill attention, **{cpu_label(kind, runs)}**, {run_label(run)} "
                  f"(`benchmarks/results/prefill_attention-{kind}.json`):", ""]  # fmt: skip
        kernel = {"amx-bf16": "AMX-BF16", "avx512-bf16": "AVX512_BF16"}.get(run.get("kernel_isa", "amx-bf16"))
        lines += [*table(["tokens", f"{kernel} kernel, ms", "torch SDPA, ms", "speed-up"], rows), ""]
    for kind, runs in kinds_of("kv_cache_dtype").items():
        run = runs[-1]
        names = list(run["tokens_in_2gib"])
        rows = [["tokens in the default 2 GiB", *(f"{run['tokens_in_2gib'][n]:,}" for n in names)]]
        for r in run["decode_kernel"]:
            rows.append([f"decode attention, 18 layers, {r['batch']} x {r['tokens']} tokens, ms",
                         *(num(r["ms"][n], 2) for n in names)])  # fmt: skip
        step = run["decode_step"]["ms"]
        rows.append(["a whole decode step, batch 32, ms", *(num(v) for v in step.values())])
        lines += [f"KV cache dtype, **{cpu_label(kind, runs)}**, {run_label(run)} "
                  f"(`benchmarks/results/kv_cache_dtype-{kind}.json`):", ""]  # fmt: skip
        lines += [*table(["", *names], rows), ""]
    return "\n".join(lines)


def render_vs_openvino() -> str:
    lines = []
    for kind, runs in kinds_of("vs_openvino").items():
        run = runs[-1]
        w = run["workload"]
        base, rows, flagged = run["engines"]["openvino"]["output_tok_s"], [], False
        for name, e in run["engines"].items():
            if name == "openvino":  # its prefix cache is off: every round's median stands
                rows.append([name, e["weights"], num(base), "—"])
                continue
            tok_s, first = cold(run, [r["output_tokens"] / r["seconds"] for r in e["rounds"]])
            flagged |= first
            rows.append([name, e["weights"], num(tok_s) + (FIRST_ONLY if first else ""), times(tok_s / base)])
        lines += [f"**{cpu_label(kind, runs)}**, {run_label(run)}; {w['requests']} requests "
                  f"({w['prompt_tokens_total']:,} prompt tokens, {w['output_tokens_total']:,} out), "
                  f"{w['max_num_seqs']} sequences, a {w['max_num_batched_tokens']}-token budget "
                  f"(`benchmarks/results/vs_openvino-{kind}.json`)", ""]  # fmt: skip
        lines += [*table(["engine", "weights", "output tok/s (median)", "vs OpenVINO"], rows), ""]
        lines += [FIRST_ONLY_NOTE, ""] if flagged else []
    return "\n".join(lines)


# -- the fleet simulator against real runs --------------------------------------------------------------
def render_autoscale() -> str:
    from benchmarks.autoscale_validate import headline

    stored = json.loads((RESULTS / "autoscale_validation.json").read_text())
    runs, load = len(stored["runs"]), stored["offered_load"]
    return (
        f"The simulator against real `inferd up` runs ({runs} runs of one replica at {load:g} of capacity, medians), "
        f"{headline(stored)}.\n"
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "autoscale": render_autoscale,
    "how-fast": render_how_fast,
    "vs-peers": render_vs_peers,
    "offline": render_offline,
    "quality": render_quality,
    "llama-perplexity": render_llama_perplexity,
    "server-overhead": render_server_overhead,
    "batch1": render_batch1,
    "vs-openvino": render_vs_openvino,
    "kernels": render_kernels,
}


def rendered(text: str) -> str:
    """`text` with every figures block rewritten from the results files."""

    def replace(m: re.Match) -> str:
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"unknown figures block {name!r}; known: {', '.join(RENDERERS)}")
        return m.group(1) + RENDERERS[name]() + m.group(4)

    return BLOCK.sub(replace, text)


def stale(docs=DOCS) -> list[str]:
    """The documents (and their blocks) that differ from what the results files render."""
    out = []
    for path in docs:
        text = path.read_text()
        new = rendered(text)
        if new != text:
            old_blocks = {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}
            names = [m.group("name") for m in BLOCK.finditer(new) if old_blocks.get(m.group("name")) != m.group("body")]
            out.append(f"{path.relative_to(ROOT)}: {', '.join(names)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 where a document differs; write nothing")
    args = ap.parse_args()
    if args.check:
        differ = stale()
        for line in differ:
            print(f"out of date: {line} (run: python -m benchmarks.report)", file=sys.stderr)
        return 1 if differ else 0
    for path in DOCS:
        text = path.read_text()
        new = rendered(text)
        if new != text:
            path.write_text(new)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
