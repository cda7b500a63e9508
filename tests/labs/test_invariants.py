"""A lab's `must` claims are invariants that can fail: numbers that break one leave the claim false (its
relation is not flipped to fit them), the lab's text marks it, and `inferd lab <term>` and `inferd lab all`
exit non-zero, naming the claim."""

from __future__ import annotations

import pytest

from inferd.cli import main
from inferd.labs import base
from inferd.labs.base import Explanation, Lab, LabResult, Measurement, decide
from inferd.labs.runner import check_result

pytestmark = pytest.mark.timeout(120)

LEASES = "leases_left <= 0.0"
BROKEN_TEXT = "{leases_left} leases still held prefill blocks after the run."


def _explain(m: Measurement) -> Explanation:
    claim = decide(
        m.numbers,
        LEASES,
        must=True,
        yes="Every lease was freed ({leases_left} held).",
        no=BROKEN_TEXT,
    )
    return Explanation(["A lab made for this test."], [claim])


def _plot(m: Measurement, fig) -> None:
    fig.subplots(1, 1).bar([0], [m.numbers["leases_left"]])


def _lab(name: str, leases_left: float) -> Lab:
    measure = lambda ctx: Measurement({"leases_left": leases_left})  # noqa: E731
    return Lab(name, f"Term {name}", measure, _explain, _plot, definition="a definition")


def test_a_broken_invariant_keeps_its_relation_and_is_false():
    numbers = {"leases_left": 3.0}
    claim = decide(numbers, LEASES, must=True, yes="none held", no=BROKEN_TEXT)
    assert (claim.left, claim.op, claim.right) == ("leases_left", "<=", 0.0)  # not flipped to ">"
    assert not claim.holds(numbers) and claim.agrees is False and claim.broken(numbers)
    assert claim.text == "3 leases still held prefill blocks after the run."
    kept = decide({"leases_left": 0.0}, LEASES, must=True, yes="none held", no=BROKEN_TEXT)
    assert kept.holds({"leases_left": 0.0}) and kept.agrees is True and not kept.broken({"leases_left": 0.0})
    # a claim that is not an invariant still tells what happened, with the relation that did hold
    told = decide(numbers, LEASES, yes="none held", no=BROKEN_TEXT)
    assert told.op == ">" and told.holds(numbers) and not told.broken(numbers)


def test_a_must_claim_flipped_to_fit_its_numbers_is_still_reported():
    """A result file whose invariant was flipped to hold (agrees False) reads as broken, not as true."""
    flipped = base.Claim("3 leases still held.", "leases_left", ">", 0.0, agrees=False, must=True)
    result = LabResult("x", "X", "d", "m", True, {}, "date", {"leases_left": 3.0}, {}, {}, [flipped], flipped.text, "")
    assert flipped.holds(result.numbers)
    assert [p for p in check_result(result) if "invariant broken" in p and "3 leases still held." in p]


@pytest.fixture
def fake_labs(monkeypatch):
    labs = {"fine-lab": _lab("fine-lab", 0.0), "broken-lab": _lab("broken-lab", 2.0)}
    monkeypatch.setattr("inferd.labs.all_labs", lambda: list(labs.values()))
    monkeypatch.setattr("inferd.labs.find_lab", lambda name: labs.get(name))
    return labs


def _lab_cli(target: str, tmp_path, capsys) -> tuple[int, str, str]:
    rc = main(["lab", target, "--quick", "--model", "unused", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_inferd_lab_exits_non_zero_naming_the_broken_invariant(fake_labs, tmp_path, capsys):
    rc, out, err = _lab_cli("broken-lab", tmp_path, capsys)
    assert rc == 1
    assert "INVARIANT BROKEN: 2 leases still held prefill blocks after the run." in out
    assert "invariant broken (a false claim): '2 leases still held prefill blocks after the run.'" in err
    assert "leases_left <= 0.0, and it was 2 against 0" in err
    rc, out, err = _lab_cli("fine-lab", tmp_path, capsys)
    assert rc == 0 and "Every lease was freed (0 held)." in out and "invariant" not in err.lower()


def test_inferd_lab_all_exits_non_zero_when_one_lab_breaks_an_invariant(fake_labs, tmp_path, capsys):
    rc, out, err = _lab_cli("all", tmp_path, capsys)
    assert rc == 1
    assert "Every lease was freed (0 held)." in out  # the other lab still ran and printed
    assert "broken-lab: invariant broken (a false claim): '2 leases still held prefill blocks after the run.'" in err


def test_a_lab_quotes_the_glossary_and_one_the_glossary_lacks_brings_its_own_sentence():
    from inferd.labs import all_labs

    assert base.glossary("TTFT").startswith("latency from request arrival to the first token")
    assert base.glossary("continuous batching").startswith("instead of waiting")  # "Continuous (in-flight) batching"
    for lab in all_labs():
        assert lab.definition == (base.glossary(lab.term) or lab.definition) and len(lab.definition) > 40, lab.term
    with pytest.raises(ValueError, match="not in the glossary"):
        Lab("x", "Not a term", _explain, _explain, _explain)
