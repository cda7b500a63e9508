"""`inferd lab list | <term> | all`: run the glossary labs (see inferd/labs/__init__.py)."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from inferd.errors import InferdError


def register(sub) -> None:
    p = sub.add_parser(
        "lab",
        help="make a glossary term happen on this machine: measure it, explain it, plot it",
        description="`inferd lab list`, `inferd lab <term>` (e.g. prefill, kv-cache, goodput), or `inferd lab all`.",
    )
    p.add_argument("target", help="list, all, or a lab's name (see `inferd lab list`)")
    p.add_argument("--quick", action="store_true", help="a tiny random model built on the fly: seconds, not minutes")
    p.add_argument("--model", default=None, help="model to measure (default: gemma3-270m; with --quick the tiny one)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda")
    p.add_argument("--out", type=Path, default=Path("lab-results"), help="where JSON and plots go")
    p.add_argument("--report", type=Path, default=None, help="with `all`: write the capstone report here")
    p.add_argument("--fleet", type=Path, default=None, help="fleet spec the KServe lab renders (examples/fleet.yaml)")
    p.add_argument("--price-per-hour", type=float, default=None, help="$ per hour of this machine (cost lab)")
    p.add_argument("--write-docs", action="store_true", help="also write <docs-dir>/<lab>.md with these numbers")
    p.add_argument("--docs-dir", type=Path, default=Path("docs/glossary"), help="where --write-docs writes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from inferd.labs import all_labs, find_lab
    from inferd.labs.context import LabContext
    from inferd.labs.runner import check_result, run_lab, write_glossary_page, write_report

    if args.target == "list":
        print("\n".join(f"{lab.name:22s} {lab.term}" for lab in all_labs()))
        return 0
    if args.price_per_hour is not None and args.price_per_hour <= 0:
        raise InferdError("--price-per-hour must be a positive number of dollars")
    if args.write_docs and args.quick:
        raise InferdError("--write-docs writes the glossary pages from a real model; drop --quick")
    labs = all_labs() if args.target == "all" else [find_lab(args.target)]
    if labs == [None]:
        raise InferdError(f"no lab named {args.target!r}; the labs are: {', '.join(x.name for x in all_labs())}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # labs send hundreds of requests: no line each
    out = args.report if (args.report is not None and args.target == "all") else args.out
    ctx = LabContext(args.quick, args.model, out, args.device, args.price_per_hour, args.fleet)
    results, problems = [], []
    try:
        for lab in labs:
            print(f"== lab {lab.name}: running on {ctx.model_label} ...", file=sys.stderr, flush=True)
            try:
                result = run_lab(lab, ctx)
            except InferdError as e:  # e.g. an optional package missing: `all` goes on with the other labs
                if args.target != "all":
                    raise
                problems.append(f"lab {lab.name} did not run: {e}")
                print(f"lab {lab.name} did not run: {e}\n", file=sys.stderr, flush=True)
                continue
            results.append(result)
            problems += check_result(result)
            print(f"{result.text}\n\n(wrote {out / (lab.name + '.json')} and {out / result.plot})\n", flush=True)
            if args.write_docs:
                page = write_glossary_page(result, args.docs_dir)
                shutil.copyfile(out / result.plot, args.docs_dir / result.plot)
                print(f"(wrote {page})\n", flush=True)
    finally:
        ctx.close()
    if args.target == "all" and args.report is not None:
        print(f"report: {write_report(results, ctx, out)}")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0
