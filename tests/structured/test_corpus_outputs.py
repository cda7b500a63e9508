"""Every schema of the corpus (inferd/bench/schemas/README.md says where each came from) constrains a
random-weight model: its outputs are JSON the schema accepts, though nothing but the mask makes them so.

xgrammar approximates a few keywords (it treats `oneOf` as `anyOf`, and ignores `allOf` over `required`,
`not`, `dependencies` and `if`); schemas using them must still yield JSON, but may not validate. A random
model can also write a string until `max_tokens`: those outputs end with `length`, and each of their tokens
was still one the grammar allowed (the matcher accepted it, or the runner would have logged it)."""

from __future__ import annotations

import json
import logging

import pytest

from inferd import LLM, SamplingParams
from inferd.bench.schemas import approximated, is_valid, load_schemas
from inferd.structured.spec import Constraint
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"]), max_model_len=1024, num_blocks=2048, dtype="float32", max_num_seqs=64)


def test_outputs_under_every_corpus_schema_are_valid(llm, caplog):
    schemas = load_schemas()
    prompts = prompt_set(VOCAB, lengths=(5, 12, 30, 47))
    # a high temperature spreads the random model's choices, so strings close within max_tokens more often
    params = [
        SamplingParams(temperature=6.0, seed=i, max_tokens=600, structured=Constraint.json(s["schema"]))
        for i, s in enumerate(schemas)
    ]
    with caplog.at_level(logging.WARNING, logger="inferd.engine.runner"):
        outs = llm.generate([prompts[i % 4] for i in range(len(schemas))], params)
    assert not [r for r in caplog.records if "outside its grammar" in r.getMessage()]
    stopped, invalid, approximated_invalid = 0, [], []
    for entry, out in zip(schemas, outs, strict=True):
        c = out.outputs[0]
        if c.finish_reason != "stop":
            continue
        stopped += 1
        json.loads(c.text)
        ok, why = is_valid(entry["schema"], c.text)
        if not ok:
            (approximated_invalid if approximated(entry["schema"]) else invalid).append((entry["name"], why))
    assert not invalid, invalid
    assert stopped >= 0.7 * len(schemas), f"only {stopped} of {len(schemas)} outputs ended within max_tokens"
    assert len(approximated_invalid) <= 8, approximated_invalid
    assert_idle(llm)
