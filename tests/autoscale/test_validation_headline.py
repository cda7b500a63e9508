"""The simulator's accuracy as README and docs/autoscaling.md state it comes from the stored validation result
(benchmarks/results/autoscale_validation.json), out of sample first: the profile measured before the runs is
what a user plans with; the profile refitted from a run's own steps has seen the run it predicts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.autoscale_validate import headline

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
STORED = json.loads((REPO / "benchmarks" / "results" / "autoscale_validation.json").read_text())


def _flat(path: Path) -> str:
    return " ".join(path.read_text().split())


def _errors(p50: float, p95: float, throughput: float) -> dict:
    return {
        "ttft_p50_s": {"relative_error": p50},
        "ttft_p95_s": {"relative_error": p95},
        "request_throughput": {"relative_error": throughput},
    }


def test_the_headline_leads_with_the_out_of_sample_figures():
    text = headline({"compare": _errors(0.42, 0.61, 0.03), "compare_refit": _errors(0.04, 0.07, 0.01)})
    assert text == (
        "out of sample (simulated from the profile measured before the runs): TTFT p50 42% and p95 61% off, "
        "throughput 3% off; in sample (the profile refitted from each run's own steps): TTFT p50 4% and p95 7% off"
    )


def test_readme_states_the_stored_result_out_of_sample_first():
    readme = _flat(REPO / "README.md")
    assert headline(STORED) in readme
    paragraph = readme[readme.index("The simulator against real `inferd up` runs") :]
    paragraph = paragraph[: paragraph.index("docs/autoscaling.md")]
    first = re.search(r"(\d+)%", paragraph).group(1)
    assert f"{first}%" == f"{STORED['compare']['ttft_p50_s']['relative_error']:.0%}"  # not the in-sample one


def test_the_autoscaling_docs_state_the_stored_result_and_its_runs():
    docs = _flat(REPO / "docs" / "autoscaling.md")
    assert headline(STORED) in docs

    def per_run(part: str, key: str) -> str:
        a, b, c = (f"{r[part][key]['relative_error']:.0%}" for r in STORED["runs"])
        return f"{a}, {b} and {c}"

    assert f"p95 {per_run('compare', 'ttft_p95_s')} off, p50 {per_run('compare', 'ttft_p50_s')}" in docs
    assert f"p95 {per_run('compare_refit', 'ttft_p95_s')} off, p50 {per_run('compare_refit', 'ttft_p50_s')}" in docs
