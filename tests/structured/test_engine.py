"""Constrained decoding in the engine: every output of a random-weight model follows its grammar (only the
mask can make it so), unconstrained rows in the same batch are untouched, preemption keeps the grammar's
place, and bad constraints are refused at admission."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from inferd import LLM, SamplingParams
from inferd.errors import InvalidRequestError
from inferd.structured.spec import Constraint
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set

PROMPTS = prompt_set(VOCAB, lengths=(5, 12, 30, 47))

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
}


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"]), max_model_len=512, num_blocks=256, dtype="float32")


def _sampled(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=200, **kw) for i in range(n)]


def test_json_schema_outputs_parse_and_validate(llm):
    params = _sampled(12, structured=Constraint.json(PERSON))
    outs = llm.generate([PROMPTS[i % 4] for i in range(12)], params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert_idle(llm)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (Constraint("regex", r"[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        (Constraint.choice(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (
            Constraint("grammar", 'root ::= ("yes" | "no") " " [0-9] [0-9]?'),
            lambda t: re.fullmatch(r"(yes|no) \d\d?", t),
        ),
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ]
    for constraint, ok in cases:
        outs = llm.generate(PROMPTS, _sampled(4, structured=constraint))
        for o in outs:
            c = o.outputs[0]
            if constraint.kind == "json_object" and c.finish_reason == "length":
                continue  # any JSON object: a random model may nest until max_tokens
            assert c.finish_reason == "stop" and ok(c.text), (constraint.kind, c.text)
    assert_idle(llm)


def test_a_permissive_grammar_changes_no_greedy_token(llm):
    """Any text at all: the same greedy tokens. The grammar reads UTF-8 and a random model writes byte tokens
    no character continues, so both runs keep to ASCII tokens (by logit_bias, which meets the grammar too)."""
    tok = llm.engine.tokenizer
    ascii_only = {str(i): -100 for i in range(VOCAB) if any(ord(ch) > 127 for ch in tok.decode([i]))}
    free = SamplingParams(temperature=0, max_tokens=40, logit_bias=ascii_only)
    anything = SamplingParams(
        temperature=0, max_tokens=40, logit_bias=ascii_only, structured=Constraint("regex", r"[\s\S]*")
    )
    plain = llm.generate(PROMPTS, free)
    constrained = llm.generate(PROMPTS, anything)
    assert all(o.outputs[0].text.isascii() for o in plain)
    assert [o.outputs[0].token_ids for o in constrained] == [o.outputs[0].token_ids for o in plain]


def test_greedy_rows_under_a_grammar_take_the_tiled_argmax_and_agree_with_full_logits(llm, monkeypatch):
    """Greedy constrained rows pick their token in the LM head's fused argmax under the grammar's bitmask;
    with logprobs (which need full logits) the same requests go through the sampler's masking: same tokens."""
    model = llm.engine.model
    real, masked_calls = model.greedy_tokens, []

    def counting(hidden, mask=None):
        masked_calls.append(mask is not None)
        return real(hidden, mask)

    monkeypatch.setattr(model, "greedy_tokens", counting)
    c = Constraint.json(PERSON)
    fast = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, structured=c))
    assert any(masked_calls)
    masked_calls.clear()
    full = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, structured=c, logprobs=1))
    assert not any(masked_calls)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]
    assert_idle(llm)


def test_plain_rows_beside_constrained_ones_are_unchanged(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], greedy)
    mixed = llm.generate(PROMPTS, [greedy, *_sampled(2, structured=Constraint.json(PERSON)), greedy][:3] + [greedy])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[3].outputs[0].token_ids == llm.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)


def test_preempted_requests_keep_their_place_in_the_grammar(tiny_models):
    small = LLM(str(tiny_models["llama"]), max_model_len=320, num_blocks=24, block_size=16, dtype="float32")
    params = _sampled(8, structured=Constraint.json(PERSON))
    outs = small.generate([PROMPTS[i % 4] for i in range(8)], params)
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert_idle(small)


def test_n_copies_each_follow_the_grammar(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, structured=Constraint.json(PERSON))
    (out,) = llm.generate([PROMPTS[2]], p)
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    p = SamplingParams(temperature=0, max_tokens=5, structured=Constraint("regex", "a{20}"))
    (out,) = llm.generate([PROMPTS[0]], p)
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text.startswith("a")
    assert_idle(llm)


def test_min_tokens_yields_to_a_finished_grammar(llm):
    p = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured=Constraint.choice(["ok"]))
    (out,) = llm.generate([PROMPTS[0]], p)
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("ok", "stop")


def test_logit_bias_moves_the_greedy_choice(llm):
    greedy = SamplingParams(temperature=0, max_tokens=1)
    (top,) = llm.generate([PROMPTS[1]], greedy)[0].outputs[0].token_ids
    forced = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, logit_bias={"7": 100}))
    assert forced[0].outputs[0].token_ids == [7, 7, 7]
    banned = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, logit_bias={top: -100}))
    assert banned[0].outputs[0].token_ids != [top]


@pytest.mark.parametrize(
    "params, param",
    [
        (dict(structured=Constraint("regex", "a(b")), "structured_outputs"),
        (dict(structured=Constraint("grammar", "root ::= undefined_rule")), "structured_outputs"),
        (
            dict(structured=Constraint.json({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
            "structured_outputs",
        ),
        (dict(logit_bias={str(VOCAB + 5): 1.0}), "logit_bias"),
        (dict(logit_bias={"3": 500}), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(structured=Constraint.choice(["a"]), ignore_eos=True), "ignore_eos"),
    ],
)
def test_bad_constraints_are_refused_at_admission(llm, params, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, **params))
    assert e.value.param == param
    assert_idle(llm)


def test_compiled_grammars_are_cached(llm):
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    stats = llm.engine.grammars.stats
    misses = stats.misses
    for _ in range(3):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, structured=Constraint.json(schema)))
    assert stats.misses == misses + 1


def test_a_process_leaving_while_the_tables_build_waits_for_them(tiny_models, tmp_path):
    """The tokenizer tables build on a background thread; a process that exits while xgrammar builds (its own
    threads running) died in std::terminate. Python waits for the build (here made to take a second) and the
    process exits cleanly."""
    marker = tmp_path / "built"
    script = f"""
import time, xgrammar
from transformers import AutoTokenizer
from inferd.structured.grammar import GrammarCompiler
real = xgrammar.TokenizerInfo.from_huggingface
def slow(*a, **k):
    time.sleep(1.0)
    info = real(*a, **k)
    open({str(marker)!r}, "w").write("built")
    return info
xgrammar.TokenizerInfo.from_huggingface = slow
tok = AutoTokenizer.from_pretrained({str(tiny_models["qwen3"])!r})
GrammarCompiler(tok, len(tok), [])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "built"
