"""`inferd lab`: every term of the inference-serving glossary made to happen on the reader's machine.

Each lab (one module here, registered in `LAB_MODULES`) measures its term with the engine, the benchmark's
metrics or the gateway, prints a plain explanation built from the numbers, and writes JSON and a plot;
`inferd lab all --report DIR` adds a capstone report ending in cost per million tokens. The framework is
in `base` (labs, claims), `context` (what labs share, the servers they start), `runner` (run, write, report)
and `cli`; what a lab measures with is below it: the engine, timed serving on it (`inferd.bench.drive`),
the measuring library (`inferd.measure`), the launcher (`inferd.procs`) and the runtimes.
"""

from __future__ import annotations

import importlib

# in the order `inferd lab all` runs them (and the report lists them)
_MECHANICS = ["prefill", "decode", "disaggregated", "kv_cache", "paged_attention", "continuous_batching"]
_METRICS = ["ttft", "itl", "throughput", "goodput"]
_ENGINES = ["vllm", "tensorrt_llm", "sglang", "structured_generation", "speculative_decoding"]
_PLATFORMS = ["kserve", "ray_serve", "dynamo", "envoy_ai_gateway", "autoscaling"]
LAB_MODULES = [*_MECHANICS, *_METRICS, *_ENGINES, *_PLATFORMS, "gpu_economics", "cost"]


def all_labs() -> list:
    """Every lab, in order (each module defines `LAB`)."""
    return [importlib.import_module(f"inferd.labs.{m}").LAB for m in LAB_MODULES]


def find_lab(name: str):
    """A lab by its CLI name, its module name or its glossary term, case-insensitively."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return next((lab for lab in all_labs() if key in {lab.name, lab.term.lower().replace(" ", "-")}), None)
