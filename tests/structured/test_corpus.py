"""The schema corpus: big enough, every entry traceable to its source, each a valid JSON Schema that xgrammar
compiles, and a checker (`is_valid`) that does reject what a schema forbids."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inferd.bench.schemas import checked_formats, is_valid, load_schemas
from tests.conftest import build_tokenizer

SCHEMAS = load_schemas()
BY_NAME = {e["name"]: e["schema"] for e in SCHEMAS}


def test_corpus_size_and_provenance():
    assert len(SCHEMAS) >= 100
    assert len(BY_NAME) == len(SCHEMAS), "names are unique"
    for e in SCHEMAS:
        assert set(e) == {"name", "source", "schema"}, e["name"]
        src = e["source"]
        assert set(src) == {"repo", "path", "commit"}, e["name"]
        assert src["path"], e["name"]
        if src["repo"].startswith("pypi:"):
            assert "==" in src["repo"], e["name"]  # a package pinned to the version it was copied from
        else:
            owner, _, repo = src["repo"].partition("/")
            assert owner and repo, e["name"]
            assert isinstance(src["commit"], str) and len(src["commit"]) == 40, e["name"]
        assert isinstance(e["schema"], dict) and e["schema"], e["name"]


def test_corpus_mixes_features():
    text = [json.dumps(e["schema"]) for e in SCHEMAS]
    for keyword in ('"enum"', '"required"', '"$ref"', '"anyOf"', '"oneOf"', '"pattern"', '"format"', '"items"'):
        assert sum(keyword in t for t in text) >= 3, keyword
    assert len({e["source"]["repo"] for e in SCHEMAS}) >= 4


@pytest.mark.parametrize("entry", SCHEMAS, ids=lambda e: e["name"])
def test_is_a_valid_json_schema(entry):
    schema = entry["schema"]
    jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)


@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    tok = build_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)


@pytest.mark.parametrize("entry", SCHEMAS, ids=lambda e: e["name"])
def test_compiles_with_xgrammar(compiler, entry):
    compiler.compile_json_schema(json.dumps(entry["schema"]), any_whitespace=False, strict_mode=True)


@pytest.mark.parametrize("entry", [e for e in SCHEMAS if e["schema"].get("required")], ids=lambda e: e["name"])
def test_empty_object_misses_required_keys(entry):
    ok, why = is_valid(entry["schema"], "{}")
    assert not ok
    assert "required" in why


VALID_SAMPLE = {
    "name": "Ada",
    "age": 36,
    "skills": ["math"],
    "grade": "A",
    "email": "ada@example.org",
    "work_history": [{"company": "AE", "duration": 10, "position": "analyst"}],
}


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("vllm/sample_json_schema", {k: v for k, v in VALID_SAMPLE.items() if k != "age"}, "'age' is a required"),
        ("vllm/sample_json_schema", {**VALID_SAMPLE, "grade": "E"}, "does not match"),
        ("vllm/sample_json_schema", {**VALID_SAMPLE, "extra": 1}, "Additional properties"),
        ("vllm/sample_json_schema", {**VALID_SAMPLE, "work_history": [VALID_SAMPLE["work_history"][0]] * 4}, "long"),
        ("jsonschemabench/Github_trivial/o41591", {"pets": {"amount": 41}}, "is not one of [42]"),
        ("jsonschemabench/Github_trivial/o41591", {"pets": {"amount": "42"}}, "is not of type 'integer'"),
        ("jsonschemabench/Github_medium/o15711", {"tag": {"name": "x", "visibility": "secret"}}, "is not one of"),
        ("jsonschemabench/Github_medium/o11684", {"email": "nobody", "expressions": []}, "is not a 'email'"),
        ("kubernetes/hostalias-v1", {"hostnames": ["a"]}, "'ip' is a required"),
    ],
)
def test_is_valid_rejects_violations(name, text, reason):
    ok, why = is_valid(BY_NAME[name], json.dumps(text))
    assert not ok
    assert reason in why, why


@pytest.mark.parametrize(
    "name, text",
    [
        ("vllm/sample_json_schema", VALID_SAMPLE),
        ("jsonschemabench/Github_trivial/o41591", {"pets": {"amount": 42}}),
        ("jsonschemabench/Github_medium/o15711", {"tag": {"name": "x", "visibility": "public"}}),
        ("jsonschemabench/Github_medium/o11684", {"email": "a@b.org", "expressions": []}),
        ("kubernetes/hostalias-v1", {"ip": "10.0.0.1", "hostnames": None}),
    ],
)
def test_is_valid_accepts_conforming(name, text):
    assert is_valid(BY_NAME[name], json.dumps(text)) == (True, "")


def test_is_valid_rejects_non_json():
    ok, why = is_valid(BY_NAME["vllm/sample_json_schema"], '{"name": "Ada",')
    assert not ok and why.startswith("not JSON")


def test_format_checking():
    assert {"date", "email", "ipv4", "uuid"} <= set(checked_formats())
    uuid_schema = {"type": "string", "format": "uuid"}
    assert is_valid(uuid_schema, '"123e4567-e89b-12d3-a456-426614174000"')[0]
    assert not is_valid(uuid_schema, '"not-a-uuid"')[0]
    assert not is_valid({"format": "date"}, '"2024-13-40"')[0]
    assert not is_valid({"format": "ipv4"}, '"300.1.1.1"')[0]
