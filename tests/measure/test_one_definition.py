"""One definition per measured concept: the source holds one percentile, one arrival-process generator, one
hardware probe of each kind, one count of weight and KV bytes and one tiny-model builder, all in the
measuring library (`inferd/measure`, and `inferd/models/tiny.py` for the builder). A second copy fails here
with where it is.

Read from the source (AST, not text), so a comment or a docstring naming a percentile is not a definition.
A concept is copied by defining a function of its name, or by calling what only its home should call
(numpy's percentile, a random generator's gamma or exponential draws, transformers' `from_config`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("inferd", "benchmarks")

# (file, function) pairs that share a name with a concept but are something else
NOT_A_COPY = {
    ("inferd/autoscale/signals.py", "histogram_quantile"),  # PromQL's estimate from bucket counts
    ("inferd/autoscale/signals.py", "quantile"),  # writes that PromQL query
    ("benchmarks/report.py", "pct"),  # formats a fraction as a percent
    ("inferd/models/layers.py", "weight_bytes"),  # a layer's own storage, which the library sums
    ("inferd/models/quant.py", "weight_bytes"),
    ("inferd/models/gguf_blocks.py", "weight_bytes"),
    ("inferd/labs/kserve.py", "weight_bytes"),  # the resident weights, embedding included: another quantity
}


@dataclass(frozen=True)
class Concept:
    name: str
    home: str  # the one file that implements it
    defines: str | None = None  # function names that would be a copy (a regex, searched)
    calls: frozenset[str] = frozenset()  # attributes or names only the home may call
    owners: frozenset[str] | None = None  # only calls on these names count (np.percentile, not ours)
    tops: tuple[str, ...] = SOURCES


CONCEPTS = [
    Concept(
        "percentile",
        "inferd/measure/stats.py",
        defines=r"(?i)(percentile|quantile|pct)$",
        calls=frozenset({"percentile", "nanpercentile", "quantile", "nanquantile", "quantiles"}),
        owners=frozenset({"np", "numpy", "statistics"}),
    ),
    Concept(
        "arrival process",
        "inferd/measure/arrivals.py",
        calls=frozenset({"expovariate", "exponential", "gamma", "gammavariate", "poisson"}),
    ),
    Concept("hardware probe", "inferd/measure/hardware.py", defines=r"(?i)bandwidth|matmul_peak|peak_g?flops"),
    Concept(
        "weight and KV bytes", "inferd/measure/model.py", defines=r"^(weight_bytes|kv_bytes_per_token|model_facts)$"
    ),
    Concept(
        "tiny-model builder",
        "inferd/models/tiny.py",
        calls=frozenset({"from_config", "train_from_iterator"}),
        tops=(*SOURCES, "tests"),
    ),
]


def _trees(tops: tuple[str, ...]):
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _copies(concept: Concept, rel: str, tree: ast.Module):
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            if concept.defines and re.search(concept.defines, n.name) and (rel, n.name) not in NOT_A_COPY:
                yield f"{rel}:{n.lineno} defines {n.name}"
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if name in concept.calls and (concept.owners is None or owner in concept.owners):
                yield f"{rel}:{n.lineno} calls {name}"


@pytest.mark.parametrize("concept", CONCEPTS, ids=lambda c: c.name)
def test_each_concept_has_one_implementation(concept):
    found = [hit for rel, tree in _trees(concept.tops) if rel != concept.home for hit in _copies(concept, rel, tree)]
    assert not found, f"a second {concept.name} (the one is in {concept.home}):\n" + "\n".join(found)
