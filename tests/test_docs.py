"""The documents speak of the project, not of how it was built, and their figures come from the results.

- Every figures block of README.md and docs/performance.md is what `python -m benchmarks.report` renders from
  benchmarks/results/ (so a page and the files cannot disagree).
- No working-session or issue-number narration in README, docs, code, tests, scripts or the results' file
  names: the development history is git's. "session" where it means an HTTP, aiohttp, Ray or pytest session
  is not matched (the patterns need a number or a narrating word beside it).
- README opens with the two set-up commands, within its line budget.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("docs", "inferd", "benchmarks", "tests", "scripts")
SUFFIXES = {".py", ".md", ".cpp", ".h", ".js", ".html", ".css", ".sh", ".txt", ".yaml", ".yml", ".toml"}
NARRATION = [
    re.compile(r"\bsessions? \d+", re.I),  # "session 12", "sessions 11-13"
    re.compile(r"\b(this|last|next|previous|that|same|earlier|one) session\b(?! (scope|fixture|hook))", re.I),
    re.compile(r"\bissues? #?\d+", re.I),  # "issue 9", "issue #3"
    re.compile(r"\b(the|speed|a neighbouring) issue'?s?\b", re.I),  # "the targets"
]
RESULT_NAME = re.compile(r"(^|[_-])s\d+[a-z]?([_.-]|$)|session", re.I)  # vs_peers_s16.json, _s12b


def _scanned_files() -> list[Path]:
    files = [REPO / "README.md"]
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")):
            rel = path.relative_to(REPO)
            if not path.is_file() or path.suffix not in SUFFIXES or "__pycache__" in rel.parts:
                continue
            if rel.parts[:2] == ("benchmarks", "results") or path == Path(__file__).resolve():
                continue  # recorded data (a run's own notes stay as written); this file names the patterns
            files.append(path)
    return files


def test_no_development_narration_in_docs_code_or_tests():
    hits = []
    for path in _scanned_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in NARRATION):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "history belongs in git, not in the project's documents:\n" + "\n".join(hits)


def test_result_files_are_named_by_benchmark_and_cpu_kind_not_by_when():
    from inferd.cpu import KINDS

    named = [p.name for p in (REPO / "benchmarks" / "results").rglob("*") if RESULT_NAME.search(p.name)]
    assert not named, named
    for path in (REPO / "benchmarks" / "results").glob("*-*.json"):
        assert path.stem.split("-", 1)[1] in KINDS, f"{path.name}: <benchmark>-<kind>.json with a kind of inferd.cpu"


def test_the_figures_in_readme_and_performance_are_the_results_files():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", "--check"], cwd=REPO, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr + done.stdout


def test_readme_opens_with_the_two_commands_and_stays_short():
    text = (REPO / "README.md").read_text()
    first = text.index("## ", text.index("\n") + 1)
    assert text[first:].startswith("## Two commands on a fresh machine")
    assert text.index("<!-- main-command -->") < text.index("<!-- test-command -->") < text.index("## How fast")
    assert "inferd doctor" in text and len(text.splitlines()) <= 160
