"""What a lab is: a glossary term, a measurement on this machine, and an explanation built from the numbers.

A lab measures (`Measurement`: flat numbers, plot series, the settings used), then explains: paragraphs of
plain text and `Claim`s. A claim is a sentence with its measured numbers in it *and* the relation it states
(`left op factor x right`, over the measurement's numbers), so anyone holding the JSON can check that the
sentence is true of the numbers (`Claim.holds`). Claims are decided from the numbers (`decide`): where this
machine bears the textbook out the lab says so; where it does not, the lab says that instead, with the
opposite relation, and `agrees` records which. A claim marked `must` is an invariant no machine may
contradict (paged concurrency above contiguous, goodput at or below throughput): its relation is fixed, so
numbers that break it leave a claim false of its numbers, which `inferd lab` reports, naming the claim,
before it exits non-zero.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from inferd.labs.context import LabContext

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def fmt(x: float) -> str:
    """How every number appears in a lab's text: three significant figures, no exponent for everyday sizes."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return str(x)
    if x == 0:
        return "0"
    a = abs(x)
    if float(x).is_integer() and a < 1e9:
        return f"{int(x):,}"
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a >= 0.001:
        return f"{x:.3g}"
    return f"{x:.2e}"


@dataclass
class Claim:
    """A sentence and the relation it states: numbers[left] op (numbers[right], or right if a number)."""

    text: str
    left: str
    op: str
    right: str | float
    agrees: bool | None = None  # True: the textbook holds here; False: this machine contradicts it
    must: bool = False

    def value(self, numbers: dict[str, float], side: str | float) -> float:
        return float(numbers[side]) if isinstance(side, str) else float(side)

    def holds(self, numbers: dict[str, float]) -> bool:
        return _OPS[self.op](self.value(numbers, self.left), self.value(numbers, self.right))

    def broken(self, numbers: dict[str, float]) -> bool:
        """A `must` claim its numbers contradict (or one a flipped relation once made to fit them)."""
        return self.must and (self.agrees is False or not self.holds(numbers))

    def shown_numbers(self, numbers: dict[str, float]) -> list[str]:
        """The formatted numbers this claim's text must contain."""
        return [fmt(float(numbers[s])) for s in (self.left, self.right) if isinstance(s, str)]


def decide(
    numbers: dict[str, float],
    relation: str,
    *,
    yes: str,
    no: str,
    textbook: bool = True,
    must: bool = False,
) -> Claim:
    """The claim `relation` ("left op right", right a key or a number, e.g. "paged > contiguous"), told with
    `yes` where the numbers bear it out, else with `no` and the opposite relation. A `must` claim is an
    invariant: told with `no` where the numbers break it, it keeps its relation, so it is false of them and
    the run that made it fails. Templates name numbers as {key}, formatted with `fmt`."""
    left, op, right_text = relation.split()
    try:
        right: str | float = float(right_text)
    except ValueError:
        right = right_text
    probe = Claim("", left, op, right)
    shown = {k: fmt(v) for k, v in numbers.items() if isinstance(v, int | float)}
    if probe.holds(numbers):
        return Claim(yes.format(**shown), left, op, right, True if textbook else None, must)
    if must:
        return Claim(no.format(**shown), left, op, right, False, must)
    return Claim(no.format(**shown), left, _NEGATE[op], right, False if textbook else None, must)


@dataclass
class Measurement:
    """What a lab measured: flat numbers (claims refer to them), series for the plot, the settings used."""

    numbers: dict[str, float] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    measured_here: bool | None = None  # None: as the lab says; False: these numbers are a stored result's

    def decide(self, relation: str, **told) -> Claim:
        """`decide` over this measurement's numbers."""
        return decide(self.numbers, relation, **told)


@dataclass
class Explanation:
    intro: list[str]  # what the term is, in plain words, with this run's numbers
    claims: list[Claim]
    why: list[str] = field(default_factory=list)  # why it matters for a platform
    # what the claims are about: a stored result's claims are its own run's, not this machine's
    claims_heading: str = "What this machine showed:"

    def text(self, title: str) -> str:
        parts = [title, *self.intro]
        if self.claims:
            parts.append(self.claims_heading + "\n" + "\n".join(f"- {_marked(c)}" for c in self.claims))
        parts += self.why
        return "\n\n".join(parts)


def _marked(claim: Claim) -> str:
    return f"INVARIANT BROKEN: {claim.text}" if claim.must and claim.agrees is False else claim.text


@dataclass(frozen=True)
class Lab:
    """One glossary term made to happen. `measure` runs the experiment; `explain` and `plot` only read it."""

    name: str  # the CLI's name for it: `inferd lab kv-cache`
    term: str  # the glossary's heading
    definition: str  # the glossary's own sentence, quoted in the output
    measure: Callable[[LabContext], Measurement]
    explain: Callable[[Measurement], Explanation]
    plot: Callable[[Measurement, Figure], None]
    measured_here: bool = True  # False: the lab reports a stored result (and says so)
    timed: bool = True  # False: its numbers are sizes and counts, which a busy machine does not change


@dataclass
class LabResult:
    """A lab's run, as written to <out>/<name>.json."""

    lab: str
    term: str
    definition: str
    model: str
    quick: bool
    machine: dict
    date: str
    numbers: dict[str, float]
    series: dict[str, Any]
    settings: dict[str, Any]
    claims: list[Claim]
    text: str
    plot: str  # the PNG's file name, beside the JSON
    measured_here: bool = True  # False: the numbers are a stored result's, with its own date and machine

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LabResult:
        return cls(**{**d, "claims": [Claim(**c) for c in d["claims"]]})
