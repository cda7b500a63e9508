"""The console report: vLLM's serving-benchmark table, plus goodput, errors, token sources and cost."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1e6 else f"{v:.4g}"
    return str(v)


def _percentile_keys(run: dict, name: str) -> list[str]:
    keys = [k for k in run if k.startswith("p") and k.endswith(f"_{name}_ms") and k[1].isdigit()]
    return sorted(keys, key=lambda k: float(k[1 : -len(f"_{name}_ms")]))


def run_table(run: dict, title: str = "Serving Benchmark Result") -> Table:
    t = Table(title=title, show_header=False, title_style="bold", min_width=52)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("Successful requests", run["completed"]),
        ("Failed requests", run["failed"]),
        ("Maximum request concurrency", run.get("max_concurrency")),
        ("Request rate (req/s)", run.get("request_rate")),
        ("Benchmark duration (s)", run["duration"]),
        ("Total input tokens", run["total_input_tokens"]),
        ("Total generated tokens", run["total_output_tokens"]),
        ("Request throughput (req/s)", run["request_throughput"]),
        ("Output token throughput (tok/s)", run["output_throughput"]),
        ("Peak output token throughput (tok/s)", run["max_output_tokens_per_s"]),
        ("Peak concurrent requests", run["max_concurrent_requests"]),
        ("Total Token throughput (tok/s)", run["total_token_throughput"]),
    ]
    for label, v in rows:
        t.add_row(label, _fmt(v))
    src = run.get("token_count_source") or {}
    t.add_row("Token counts from", f"input: {src.get('input', '-')}, output: {src.get('output', '-')}")
    if run.get("slo_ms"):
        t.add_section()
        slo = " ".join(f"{k}:{v:g}" for k, v in run["slo_ms"].items())
        t.add_row(f"[bold]Goodput (SLO {slo} ms)", "")
        t.add_row("Request goodput (req/s)", _fmt(run["request_goodput"]))
        t.add_row("Output token goodput (tok/s)", _fmt(run["output_goodput"]))
        t.add_row("Requests meeting every SLO (%)", _fmt(100.0 * run["slo_attainment"]))
    if run.get("schema_checked"):
        t.add_section()
        t.add_row(f"[bold]JSON schemas ({run['schema_checked']} outputs checked)", "")
        for key, label in (("", "all"), ("_constrained", "with response_format"), ("_free", "asked in the prompt")):
            rate = run.get(f"schema_valid_rate{key}")
            t.add_row(f"Valid, {label} (%)", _fmt(None if rate is None else 100.0 * rate))
    if run.get("spec_decode_num_draft_tokens"):
        t.add_section()
        t.add_row("[bold]Speculative decoding (the server's counters)", "")
        t.add_row("Draft tokens proposed", _fmt(run["spec_decode_num_draft_tokens"]))
        t.add_row("Draft tokens accepted", _fmt(run["spec_decode_num_accepted_tokens"]))
        t.add_row("Acceptance rate (%)", _fmt(100.0 * run["spec_decode_acceptance_rate"]))
        t.add_row("Tokens per drafting step", _fmt(run["spec_decode_mean_acceptance_length"]))
    for name, heading, short in _SECTIONS:
        t.add_section()
        t.add_row(f"[bold]{heading}", "")
        t.add_row(f"Mean {short} (ms)", _fmt(run[f"mean_{name}_ms"]))
        t.add_row(f"Median {short} (ms)", _fmt(run[f"median_{name}_ms"]))
        for k in _percentile_keys(run, name):
            t.add_row(f"P{k[1 : -len(f'_{name}_ms')]} {short} (ms)", _fmt(run[k]))
    if run.get("errors_by_type"):
        t.add_section()
        t.add_row("[bold]Failed requests by error", "")
        for kind, n in sorted(run["errors_by_type"].items(), key=lambda kv: -kv[1]):
            t.add_row(kind, str(n))
    if run.get("price_per_hour") is not None:
        t.add_section()
        t.add_row(f"[bold]Cost (${run['price_per_hour']:g}/h x {run['replicas']} replicas)", "")
        t.add_row("$ per 1M output tokens", _fmt(run["cost_per_million_output_tokens"]))
        t.add_row("$ per 1M total tokens", _fmt(run["cost_per_million_total_tokens"]))
        if run.get("slo_ms"):
            t.add_row("$ per 1M output tokens at goodput", _fmt(run["goodput_cost_per_million_output_tokens"]))
            t.add_row("$ per 1M total tokens at goodput", _fmt(run["goodput_cost_per_million_total_tokens"]))
    return t


def sweep_table(runs: Sequence[dict], level_key: str) -> Table:
    t = Table(title="Sweep", title_style="bold")
    cols = [
        (level_key, level_key),
        ("completed", "ok"),
        ("failed", "failed"),
        ("request_throughput", "req/s"),
        ("output_throughput", "out tok/s"),
        ("mean_ttft_ms", "mean TTFT ms"),
        ("p99_ttft_ms", "p99 TTFT ms"),
        ("mean_tpot_ms", "mean TPOT ms"),
        ("p99_itl_ms", "p99 ITL ms"),
        ("request_goodput", "goodput req/s"),
        ("slo_attainment", "SLO met"),
        ("cost_per_million_output_tokens", "$/1M out"),
    ]
    cols = [c for c in cols if any(r.get(c[0]) is not None for r in runs)]
    for _, head in cols:
        t.add_column(head, justify="right")
    for r in runs:
        t.add_row(*(_fmt(r.get(k)) for k, _ in cols))
    return t


def best_line(best: dict | None, has_slos: bool) -> str:
    if not has_slos:
        return "no --slo given: no highest load meeting SLOs to report"
    if best is None:
        return "no level of the sweep met the SLOs"
    key = best["level_key"]
    line = (
        f"highest load meeting the SLOs ({100 * best['required_attainment']:g}% of requests): {key} {best[key]}, "
        f"{best['output_throughput']:.2f} out tok/s"
    )
    if best.get("cost_per_million_output_tokens") is not None:
        line += f", ${best['cost_per_million_output_tokens']:.4g} per 1M output tokens"
    return line


def wide_console() -> Console:
    """Rich wraps to 80 columns when output is not a terminal; a saved report should keep its table whole."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def print_result(result: dict, console: Console | None = None) -> None:
    console = console or wide_console()
    if "runs" not in result:
        console.print(run_table(result))
        return
    key = result["sweep"]["level_key"]
    for run in result["runs"]:
        console.print(run_table(run, title=f"Serving Benchmark Result ({key} {run.get(key)})"))
    console.print(sweep_table(result["runs"], key))
    console.print(best_line(result.get("best"), bool(result.get("slo_ms"))))
