"""Every schema of the corpus (inferd/bench/schemas/README.md says where each came from) constrains a
random-weight model: its outputs are JSON the schema accepts, though nothing but the mask makes them so.

A schema with keywords the mask cannot enforce is refused when the constraint is made (a 400 at the API);
xgrammar reads `oneOf` as `anyOf`, so outputs under a `oneOf` must be JSON but may match two branches. A random
model can also write a string until `max_tokens`: those outputs end with `length`, and each of their tokens
was still one the grammar allowed (the matcher accepted it, or the runner would have logged it)."""

from __future__ import annotations

import json
import logging

import pytest

from inferd import LLM, SamplingParams
from inferd.bench.schemas import is_valid, load_schemas
from inferd.errors import InvalidRequestError
from inferd.structured.enforceable import unenforceable
from inferd.structured.spec import Constraint
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"]), max_model_len=1024, num_blocks=2048, dtype="float32", max_num_seqs=64)


def test_outputs_under_every_corpus_schema_are_valid(llm, caplog):
    schemas = [e for e in load_schemas() if not unenforceable(e["schema"])]
    assert len(schemas) >= 100
    prompts = prompt_set(VOCAB, lengths=(5, 12, 30, 47))
    # a high temperature spreads the random model's choices, so strings close within max_tokens more often
    params = [
        SamplingParams(temperature=6.0, seed=i, max_tokens=600, structured=Constraint.json(s["schema"]))
        for i, s in enumerate(schemas)
    ]
    with caplog.at_level(logging.WARNING, logger="inferd.engine.runner"):
        outs = llm.generate([prompts[i % 4] for i in range(len(schemas))], params)
    assert not [r for r in caplog.records if "outside its grammar" in r.getMessage()]
    stopped, invalid, one_of_invalid = 0, [], []
    for entry, out in zip(schemas, outs, strict=True):
        c = out.outputs[0]
        if c.finish_reason != "stop":
            continue
        stopped += 1
        json.loads(c.text)
        ok, why = is_valid(entry["schema"], c.text)
        if not ok:
            (one_of_invalid if '"oneOf"' in json.dumps(entry["schema"]) else invalid).append((entry["name"], why))
    assert not invalid, invalid
    assert stopped >= 0.7 * len(schemas), f"only {stopped} of {len(schemas)} outputs ended within max_tokens"
    assert len(one_of_invalid) <= 2, one_of_invalid
    assert_idle(llm)


def test_the_corpus_schemas_the_mask_cannot_enforce_are_refused_naming_where():
    refused = [e for e in load_schemas() if unenforceable(e["schema"])]
    assert refused  # the corpus holds real schemas of both kinds
    for entry in refused:
        with pytest.raises(InvalidRequestError) as e:
            Constraint.json(entry["schema"], param="response_format.json_schema.schema")
        assert e.value.param == "response_format.json_schema.schema"
        assert unenforceable(entry["schema"])[0] in str(e.value)
