"""Run labs and write what they found: <out>/<lab>.json and <lab>.png, the report (Markdown with the plots; the
cost lab, last, is its capstone) and, with --write-docs, docs/glossary/<lab>.md. `check_result` verifies a
result: every claim true of its numbers, and every number a claim rests on in its sentence."""

from __future__ import annotations

import json
from pathlib import Path

from inferd.labs.base import Lab, LabResult, fmt, glossary
from inferd.labs.context import LabContext, describe_machine, machine_line


def run_lab(lab: Lab, ctx: LabContext) -> LabResult:
    """Measure (or reuse this run's measurement), explain, plot, write JSON and PNG into ctx.out."""
    m = ctx.measured(lab)
    explanation = lab.explain(m)
    quoted = "in the glossary's words" if glossary(lab.term) else "in a sentence"
    explanation.intro.insert(0, f"{lab.term}, {quoted}: {lab.definition}")
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
    caveat = f"Caution: this machine was busy while the lab ran (load average {load:.1f} on {cores} cores), so "
    caveat += "its times include waiting for a core and overstate what the model and hardware need; ratios "
    caveat += "between runs of the same lab hold up better than absolute times. Run it again on an idle machine."
    return caveat


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON data")


def _save_plot(lab: Lab, m, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot, so no GUI backend: savefig renders the PNG with Agg

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    lab.plot(m, fig)
    fig.suptitle(lab.term)
    fig.savefig(path, dpi=90)


def check_result(result: LabResult) -> list[str]:
    """What is wrong with a result: invariants its numbers break, claims false of their own numbers, numbers
    missing from the text."""
    problems, lab, n = [], result.lab, result.numbers
    for c in result.claims:
        if c.broken(n):
            was = " against ".join(fmt(c.value(n, side)) for side in (c.left, c.right))
            must = f"it must be that {c.left} {c.op} {c.right}, and it was {was}"
            problems.append(f"{lab}: invariant broken (a false claim): {c.text!r} ({must})")
        elif not c.holds(n):
            problems.append(f"{lab}: false claim: {c.text!r} ({c.left} {c.op} {c.right})")
        problems += [f"{lab}: claim does not show {s}: {c.text!r}" for s in c.shown_numbers(n) if s not in c.text]
        if c.text not in result.text:
            problems.append(f"{lab}: claim missing from the text: {c.text!r}")
    return problems


# -- the capstone report and the glossary pages --------------------------------------------------------
def _body(r: LabResult) -> list[str]:
    """The explanation without its title line, and the plot."""
    return [r.text.split("\n\n", 1)[1], "", f"![{r.term}]({r.plot})"]


def write_report(results: list[LabResult], ctx: LabContext, report_dir: Path) -> Path:
    """README-style Markdown: the claims this machine contradicted, then per term the explanation and the plot."""
    stored = [r.term for r in results if not r.measured_here]
    provenance = "Every number below was measured in this run"
    if stored:
        provenance += f" except under {', '.join(stored)}, which {'shows' if len(stored) == 1 else 'show'} a stored "
        provenance += "run's figures with that run's own date and machine"
    found = [f"- {r.term}: {c.text}" for r in results for c in r.claims if c.agrees is False]
    lines = [
        "# Inference serving, measured on this machine",
        "",
        f"Machine: {machine_line(results[0].machine)}. Model: {ctx.model_label}. Date: {ctx.date}.",
        provenance + "; every claim is checked against the numbers in the lab's JSON.",
        "",
        f"**Where this machine contradicts the textbook** ({len(found)} of the labs' claims):\n\n" + "\n".join(found)
        if found
        else "This machine bore out every textbook claim the labs test.",
        "",
    ]
    for r in results:
        lines += [f"## {r.term}", "", *_body(r), ""]
    path = report_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_glossary_page(result: LabResult, docs_dir: Path) -> Path:
    """docs/glossary/<lab>.md: the term, the run's explanation with this machine's numbers, the plot."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    where = f"`inferd lab {result.lab}` on {machine_line(result.machine)}, {result.date}"
    if result.measured_here:
        origin = f"Measured by {where}, with {result.model}. Run it on your machine to get your numbers."
    else:
        origin = f"Written by {where}, from a stored result: its figures were not measured then, and the run they "
        origin += "come from is named below, with its own date and machine."
    path = docs_dir / f"{result.lab}.md"
    path.write_text("\n".join([f"# {result.term}", "", origin, "", *_body(result)]) + "\n")
    return path
