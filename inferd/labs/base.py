"""What a lab is: a glossary term, a measurement on this machine, and an explanation built from the numbers.

A lab measures (`Measurement`: flat numbers, plot series, settings), then explains: plain paragraphs and
`Claim`s. A claim is a sentence with its numbers in it and the relation it states over them (`left op right`),
so anyone holding the JSON can check it (`Claim.holds`). `decide` tells the textbook's sentence where the
numbers bear it out, else the other one with the opposite relation (`agrees` records which). A `must` claim is
an invariant no machine may contradict: its relation never flips, so numbers that break it leave a false
claim, which `inferd lab` names before it exits non-zero.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from inferd.labs.context import LabContext

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def fmt(x: float) -> str:
    """How every number appears in a lab's text: three significant figures, no exponent for everyday sizes."""
    if not math.isfinite(x):
        return str(x)
    if float(x).is_integer() and abs(x) < 1e9:
        return f"{int(x):,}"  # 0 and -0.0 too: "0"
    for least, spec in ((100, ",.0f"), (10, ".1f"), (1, ".2f"), (0.001, ".3g")):
        if abs(x) >= least:
            return format(x, spec)
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


def decide(numbers: dict, relation: str, *, yes: str, no: str, textbook: bool = True, must: bool = False) -> Claim:
    """The claim `relation` ("left op right", right a key or a number), told with `yes` where the numbers bear
    it out, else with `no` and the opposite relation (a `must` claim keeps its relation, and is false). The
    templates name numbers as {key}, formatted with `fmt`; `textbook=False`: neither side is the glossary's."""
    left, op, right_text = relation.split()
    right = right_text if right_text in numbers else float(right_text)
    shown = {k: fmt(v) for k, v in numbers.items() if isinstance(v, int | float)}
    if Claim("", left, op, right).holds(numbers):
        return Claim(yes.format(**shown), left, op, right, True if textbook else None, must)
    flipped = op if must else _NEGATE[op]
    return Claim(no.format(**shown), left, flipped, right, False if textbook or must else None, must)


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

    def must(self, relation: str, **told) -> Claim:
        """An invariant over this measurement's numbers: `decide` with must=True."""
        return decide(self.numbers, relation, must=True, **told)

    def either(self, relation: str, **told) -> Claim:
        """A claim with no textbook side, either sentence a finding: `decide` with textbook=False."""
        return decide(self.numbers, relation, textbook=False, **told)

    def ends(self, *keys: str) -> None:
        """numbers `<key>_lo` and `<key>_hi`: the first and last point of each series (a sweep's two ends)."""
        for k in keys:
            self.numbers[f"{k}_lo"], self.numbers[f"{k}_hi"] = self.series[k][0], self.series[k][-1]


@dataclass
class Explanation:
    intro: list[str]  # what the term is, in plain words, with this run's numbers
    claims: list[Claim]
    why: list[str] = field(default_factory=list)  # why it matters for a platform
    # what the claims are about: a stored result's claims are its own run's, not this machine's
    claims_heading: str = "What this machine showed:"

    def text(self, title: str) -> str:
        marked = [f"- {'INVARIANT BROKEN: ' if c.must and c.agrees is False else ''}{c.text}" for c in self.claims]
        claims = [self.claims_heading + "\n" + "\n".join(marked)] if self.claims else []
        return "\n\n".join([title, *self.intro, *claims, *self.why])


def glossary(term: str) -> str | None:
    """The glossary's own sentence for `term` (glossary.txt beside this module: the glossary the labs make
    happen), its heading read without parenthesised parts, hyphens as spaces ("TTFT (Time To First Token)" is TTFT)."""
    key = lambda name: re.sub(r"\s*\([^)]*\)", "", name).strip().lower().replace("-", " ")
    for line in (Path(__file__).parent / "glossary.txt").read_text().splitlines():
        heading, colon, text = line.partition(": ")
        if colon and key(heading) == key(term):
            return text.strip()
    return None


@dataclass(frozen=True)
class Lab:
    """One glossary term made to happen. `measure` runs the experiment; `explain` and `plot` only read it."""

    name: str  # the CLI's name for it: `inferd lab kv-cache`
    term: str  # the glossary's heading
    measure: Callable[[LabContext], Measurement]
    explain: Callable[[Measurement], Explanation]
    plot: Callable[[Measurement, Figure], None]
    measured_here: bool = True  # False: the lab reports a stored result (and says so)
    timed: bool = True  # False: its numbers are sizes and counts, which a busy machine does not change
    definition: str = ""  # the term in a sentence: the glossary's own, or the lab's for a term it lacks

    def __post_init__(self) -> None:
        if not self.definition:
            if (quoted := glossary(self.term)) is None:
                raise ValueError(f"{self.term!r} is not in the glossary: give its lab a definition")
            object.__setattr__(self, "definition", quoted)


def lines(
    fig: Figure, x: list, ys: dict[str, list], style="o-", hline: tuple[str, float] | None = None, **axes
) -> Axes:
    """One panel: each series of `ys` against `x`, labelled by its key, and a dashed reference line `hline`
    (label, y); `axes`: title, labels, scales."""
    ax = fig.subplots()
    for label, y in ys.items():
        ax.plot(x, y, style, label=label)
    if hline:
        ax.axhline(hline[1], color="gray", ls="--", label=hline[0])
    ax.set(**axes)
    if len(ys) > 1 or hline:
        ax.legend()
    return ax


def bars(fig: Figure, values: dict[str, float], **axes) -> Axes:
    """One panel: a bar per key of `values`; `axes`: title, labels, scales."""
    ax = fig.subplots()
    ax.bar(list(values), list(values.values()))
    ax.set(**axes)
    return ax


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
