"""Run labs and write what they found: <out>/<lab>.json and <lab>.png, the capstone report (Markdown with
the plots, ending in cost per million tokens) and, with --write-docs, docs/glossary/<lab>.md.

A lab's text is built from its measurement by its `explain`; the JSON keeps the numbers, the claims and the
relation each claim states, so `check_result` can verify any result file: every claim true of its
numbers, and every number a claim rests on printed in its sentence.
"""

from __future__ import annotations

import json
from pathlib import Path

from inferd.labs.base import Lab, LabResult, fmt
from inferd.labs.context import LabContext, describe_machine, machine_line


def run_lab(lab: Lab, ctx: LabContext) -> LabResult:
    """Measure (or reuse this run's measurement), explain, plot, write JSON and PNG into ctx.out."""
    m = ctx.measurements.get(lab.name)
    if m is None:
        m = lab.measure(ctx)
        ctx.measurements[lab.name] = m
    explanation = lab.explain(m)
    explanation.intro.insert(0, f"{lab.term}, in the glossary's words: {lab.definition}")
    machine = describe_machine(str(ctx.torch_device))
    here = lab.measured_here if m.measured_here is None else m.measured_here
    if here and lab.timed and (caveat := busy_caveat(machine)):
        explanation.why.append(caveat)
    title = f"{lab.term}: measured on {ctx.model_label}" if here else f"{lab.term}: a stored result"
    result = LabResult(
        lab=lab.name,
        term=lab.term,
        definition=lab.definition,
        model=ctx.model_label,
        quick=ctx.quick,
        machine=machine,
        date=ctx.date,
        numbers=m.numbers,
        series=m.series,
        settings=m.settings,
        claims=explanation.claims,
        text=explanation.text(title),
        plot=f"{lab.name}.png",
        measured_here=here,
    )
    ctx.out.mkdir(parents=True, exist_ok=True)
    _save_plot(lab, m, ctx.out / result.plot)
    (ctx.out / f"{lab.name}.json").write_text(json.dumps(result.to_dict(), indent=2, default=_jsonable) + "\n")
    return result


def busy_caveat(machine: dict) -> str | None:
    """A warning when other work shared the CPUs during the lab: its times then include waiting for a core."""
    load, cores = machine["load_average_at_start"][0], machine.get("cpu_count") or 1
    if load <= cores:
        return None
    return (
        f"Caution: this machine was busy while the lab ran (load average {load:.1f} on {cores} cores), so its "
        "times include waiting for a core and overstate what the model and hardware need; ratios between "
        "runs of the same lab hold up better than absolute times. Run it again on an idle machine."
    )


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON data")


def _save_plot(lab: Lab, m, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    lab.plot(m, fig)
    fig.suptitle(lab.term)
    fig.savefig(path, dpi=90)


def check_result(result: LabResult) -> list[str]:
    """What is wrong with a result: invariants its numbers break, claims false of their own numbers, numbers
    missing from the text."""
    problems = []
    for c in result.claims:
        if c.broken(result.numbers):
            must = _relation(c, result)
            problems.append(f"{result.lab}: invariant broken (a false claim): {c.text!r} (it must be that {must})")
        elif not c.holds(result.numbers):
            problems.append(f"{result.lab}: false claim: {c.text!r} ({c.left} {c.op} {c.right})")
        for shown in c.shown_numbers(result.numbers):
            if shown not in c.text:
                problems.append(f"{result.lab}: claim does not show {shown}: {c.text!r}")
        if c.text not in result.text:
            problems.append(f"{result.lab}: claim missing from the text: {c.text!r}")
    return problems


def _relation(c, result: LabResult) -> str:
    """'used_plus_cost > limit, and it was 90 against 100'."""
    shown = [f"{fmt(c.value(result.numbers, side))}" for side in (c.left, c.right)]
    return f"{c.left} {c.op} {c.right}, and it was {shown[0]} against {shown[1]}"


# -- the capstone report and the glossary pages --------------------------------------------------------
def write_report(results: list[LabResult], ctx: LabContext, report_dir: Path) -> Path:
    """README-style Markdown: per term, the explanation and the plot; then cost per million tokens."""
    lines = [
        "# Inference serving, measured on this machine",
        "",
        f"Machine: {machine_line(results[0].machine)}. Model: {ctx.model_label}. Date: {ctx.date}.",
        _provenance(results),
        "",
    ]
    lines += _contradictions(results)
    for r in results:
        lines += [f"## {r.term}", "", _markdown(r.text, drop_title=True), "", f"![{r.term}]({r.plot})", ""]
    lines += _cost_section(results, ctx)
    path = report_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _provenance(results: list[LabResult]) -> str:
    stored = [r.term for r in results if not r.measured_here]
    checked = "every claim is checked against the numbers in the lab's JSON."
    if not stored:
        return f"Every number below was measured in this run; {checked}"
    return (
        f"Every number below was measured in this run except under {', '.join(stored)}, which "
        f"{'shows' if len(stored) == 1 else 'show'} a stored run's figures with that run's own date and "
        f"machine; {checked}"
    )


def _contradictions(results: list[LabResult]) -> list[str]:
    """The claims where this machine did not bear the glossary out, gathered up front."""
    found = [(r.term, c.text) for r in results for c in r.claims if c.agrees is False]
    if not found:
        return ["This machine bore out every textbook claim the labs test.", ""]
    lines = [f"**Where this machine contradicts the textbook** ({len(found)} of the labs' claims):", ""]
    return lines + [f"- {term}: {text}" for term, text in found] + [""]


def _cost_section(results: list[LabResult], ctx: LabContext) -> list[str]:
    cost = next((r for r in results if r.lab == "cost"), None)
    lines = ["## Capstone: cost per million tokens", ""]
    if cost is None:
        return lines + ["The cost lab did not run."]
    n = cost.numbers
    lines += [
        f"At **${fmt(n['price_per_hour'])} per hour** for this machine, serving {ctx.model_label} here costs:",
        "",
        "| measured at | output tokens/s | $ per million output tokens |",
        "|---|---|---|",
        f"| the best goodput under the SLOs | {fmt(n['goodput_tok_s'])} | {fmt(n['cost_goodput'])} |",
        f"| raw throughput at the same load | {fmt(n['throughput_tok_s'])} | {fmt(n['cost_throughput'])} |",
        f"| batch 1 (no batching) | {fmt(n['batch1_tok_s'])} | {fmt(n['cost_batch1'])} |",
        "",
        "The goodput row is the one to plan with: it counts only tokens of requests that met the SLOs.",
    ]
    return lines


def _markdown(text: str, drop_title: bool) -> str:
    parts = text.split("\n\n")
    return "\n\n".join(parts[1:] if drop_title else parts)


def write_glossary_page(result: LabResult, docs_dir: Path) -> Path:
    """docs/glossary/<lab>.md: the term, the run's explanation with this machine's numbers, the plot."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    if result.measured_here:
        origin = (
            f"Measured by `inferd lab {result.lab}` on {machine_line(result.machine)}, {result.date}, with "
            f"{result.model}. Run it on your machine to get your numbers."
        )
    else:
        origin = (
            f"Written by `inferd lab {result.lab}` on {machine_line(result.machine)}, {result.date}, from a "
            "stored result: its figures were not measured then, and the run they come from is named below, "
            "with its own date and machine."
        )
    lines = [
        f"# {result.term}",
        "",
        origin,
        "",
        _markdown(result.text, drop_title=True),
        "",
        f"![{result.term}]({result.plot})",
    ]
    path = docs_dir / f"{result.lab}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
