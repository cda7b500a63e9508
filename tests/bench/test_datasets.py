from __future__ import annotations

import json

import pytest

from inferd.bench.datasets import QuoteDataset, RandomDataset, SharedPrefixDataset, ShareGPTDataset, length_range
from inferd.bench.tokenizers import LocalTokenizer
from inferd.errors import InferdError


class CharTokenizer:
    """One token per character and one BOS: lengths are known exactly."""

    name = "chars"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def num_special_tokens(self):
        return 1


@pytest.fixture(scope="module")
def local_tok(tmp_path_factory):
    from tests.conftest import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return LocalTokenizer(str(path))


def test_length_range_matches_vllm():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(1, 0.5) == (1, 2)
    with pytest.raises(InferdError):
        length_range(10, 1.0)


def test_random_dataset_exact_lengths_and_distinct_prompts():
    ds = RandomDataset(CharTokenizer(), input_len=40, output_len=7, seed=3)
    reqs = ds.take(30) + ds.take(30)
    assert all(r.prompt_len == 40 and len(r.prompt) == 39 for r in reqs)  # 39 characters + the BOS
    assert all(r.output_len == 7 for r in reqs)
    assert len({r.prompt for r in reqs}) == 60


def test_random_dataset_is_deterministic_by_seed(local_tok):
    a = RandomDataset(local_tok, 64, 16, range_ratio=0.5, seed=11)
    b = RandomDataset(local_tok, 64, 16, range_ratio=0.5, seed=11)
    c = RandomDataset(local_tok, 64, 16, range_ratio=0.5, seed=12)
    ra, rb, rc = a.take(20), b.take(20), c.take(20)
    assert ra == rb
    assert [r.prompt for r in ra] != [r.prompt for r in rc]
    for r in ra:
        assert 8 <= r.output_len <= 24
        assert r.prompt_len == len(local_tok.encode(r.prompt)) + local_tok.num_special_tokens()
        assert 30 <= r.prompt_len <= 98  # asked 32..96; a cut word may re-tokenize a token either way
    assert len({r.output_len for r in ra}) > 1 and len({r.prompt_len for r in ra}) > 1


def test_quote_prompts_hold_their_passage_at_the_asked_length():
    ds = QuoteDataset(CharTokenizer(), input_len=200, output_len=50, seed=1)
    reqs = ds.take(10)
    frame = QuoteDataset.INSTRUCTION.format(passage="")
    for r in reqs:
        passage = r.prompt.split("Text:\n", 1)[1].rsplit("\n\nCopy:", 1)[0]
        assert r.prompt == QuoteDataset.INSTRUCTION.format(passage=passage)
        assert r.prompt_len == 200 == len(frame) + len(passage) + 1  # the BOS
        assert r.output_len == 50
    assert len({r.prompt for r in reqs}) == 10
    assert [r.prompt for r in QuoteDataset(CharTokenizer(), 200, 50, seed=1).take(10)] == [r.prompt for r in reqs]


def test_shared_prefix_groups():
    ds = SharedPrefixDataset(CharTokenizer(), prefix_len=30, num_prefixes=3, suffixes_per_prefix=4, suffix_len=10,
                             output_len=5, seed=0)  # fmt: skip
    assert ds.default_count == 12
    reqs = ds.take(ds.default_count)
    prefixes = {r.prompt[:29] for r in reqs}  # 29 characters + BOS = 30 tokens
    assert len(prefixes) == 3
    assert sorted(sum(r.prompt.startswith(p) for r in reqs) for p in prefixes) == [4, 4, 4]
    assert len({r.prompt for r in reqs}) == 12
    assert all(r.prompt_len == 29 + 1 + 10 + 1 for r in reqs)  # prefix, space, suffix, BOS
    again = SharedPrefixDataset(CharTokenizer(), 30, 3, 4, 10, 5, seed=0).take(12)
    assert again == reqs
    assert not prefixes & {r.prompt[:29] for r in ds.take(12)}  # the next draw (a sweep level) has fresh prefixes


def _sharegpt(path, n):
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"question number {i} " * 3},
                {"from": "gpt", "value": "ok " * i},
            ]
        }
        for i in range(n)
    ]
    data.append({"conversations": [{"from": "human", "value": "x"}]})  # one turn: skipped
    data.append(
        {
            "conversations": [
                {"role": "user", "content": "role style prompt"},
                {"role": "assistant", "content": "fine reply"},
            ]
        }
    )
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_seeded_filtered_and_exhaustible(tmp_path):
    path = _sharegpt(tmp_path / "sg.json", 20)
    tok = CharTokenizer()
    a, b = ShareGPTDataset(path, tok, seed=1).take(10), ShareGPTDataset(path, tok, seed=1).take(10)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in ShareGPTDataset(path, tok, seed=2).take(10)]
    assert all(r.output_len >= 4 and r.prompt_len == len(r.prompt) for r in a)
    fixed = ShareGPTDataset(path, tok, seed=1, output_len=9).take(5)
    assert {r.output_len for r in fixed} == {9}
    with pytest.raises(InferdError, match="too few"):
        ShareGPTDataset(path, tok, seed=1).take(100)
    with pytest.raises(InferdError):
        ShareGPTDataset(tmp_path / "missing.json", tok)


class ConstantTokenizer(CharTokenizer):
    """A broken tokenizer: the same tokens whatever the text."""

    name = "constant"

    def encode(self, text):
        return [ord(c) for c in "abc"]


class EmptyTokenizer(CharTokenizer):
    name = "empty"

    def encode(self, text):
        return []


@pytest.mark.timeout(30)
def test_too_few_distinct_short_prompts_is_an_error_not_a_hang(local_tok):
    ds = RandomDataset(local_tok, input_len=2, output_len=4, seed=0)  # one token (plus BOS): few such texts exist
    with pytest.raises(InferdError, match="distinct prompts.*--random-input-len"):
        ds.take(300)
    small = RandomDataset(local_tok, input_len=2, output_len=4, seed=0).take(5)  # a few are there
    assert len({r.prompt for r in small}) == 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tok", [ConstantTokenizer(), EmptyTokenizer()], ids=["constant", "empty"])
def test_broken_tokenizer_is_an_error_not_a_hang(tok):
    with pytest.raises(InferdError, match="tokenizer"):
        RandomDataset(tok, input_len=16, output_len=4).take(10)
    with pytest.raises(InferdError, match="tokenizer"):
        SharedPrefixDataset(tok, 8, 2, 4, 8, 4).take(8)


def test_redraw_budget_is_bounded():
    class Counting(CharTokenizer):
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return [ord(c) for c in text[:1]]  # one character: 26-ish distinct one-token prompts at most

    with pytest.raises(InferdError):
        RandomDataset(Counting(), input_len=2, output_len=4).take(1000)
    assert Counting.calls < 10 * (2 * 1000 + 100)  # a few encodes per draw, within the draw budget


def test_json_schema_requests_carry_their_schema_and_the_constraint_at_the_ratio():
    from inferd.bench.datasets import JsonSchemaDataset

    half = JsonSchemaDataset(CharTokenizer(), output_len=50, structured_output_ratio=0.5, seed=3)
    reqs = half.take(200)
    assert len({r.prompt for r in reqs}) == 200 and all(r.output_len == 50 for r in reqs)
    assert all(json.dumps(r.schema, separators=(",", ":")) in r.prompt for r in reqs)
    constrained = [r for r in reqs if r.extra_body]
    assert 70 < len(constrained) < 130  # about half, seeded
    assert all(r.extra_body["response_format"]["json_schema"]["schema"] == r.schema for r in constrained)
    assert not any(r.extra_body for r in JsonSchemaDataset(CharTokenizer(), 50, 0.0).take(20))
    small = JsonSchemaDataset(CharTokenizer(), 50, max_schema_chars=300)
    assert 0 < len(small.schemas) < len(half.schemas) and all(len(text) <= 300 for _, text in small.schemas)
    with pytest.raises(InferdError, match="structured-output-ratio"):
        JsonSchemaDataset(CharTokenizer(), 50, structured_output_ratio=1.5)


def test_a_prompt_salt_keeps_the_schemas_and_changes_every_prompt_from_its_start():
    from inferd.bench.datasets import JsonSchemaDataset

    a = JsonSchemaDataset(CharTokenizer(), 50, 1.0, seed=4, salt="-constrained").take(30)
    b = JsonSchemaDataset(CharTokenizer(), 50, 0.0, seed=4, salt="-free").take(30)
    assert [r.schema for r in a] == [r.schema for r in b]
    # the prompts part before their tag ends, so no block of one is a prefix-cache hit for the other
    assert all(x.prompt[: x.prompt.index(".")] != y.prompt[: y.prompt.index(".")] for x, y in zip(a, b, strict=True))


def test_schema_validity_counts_valid_outputs_per_group():
    from inferd.bench.client import RequestOutput
    from inferd.bench.datasets import BenchRequest
    from inferd.bench.runner import schema_validity

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"response_format": {"type": "json_schema"}}
    cases = [(rf, '{"a": 1}', True), (rf, '{"a": "x"}', True), (None, '{"a": 2}', True), (None, "nope", True),
             (None, '{"a": 3}', False), (None, "", True)]  # fmt: skip
    reqs = [BenchRequest("p", 1, 5, extra, schema) for extra, _, _ in cases]
    outs = [RequestOutput(i, 1, 5, success=ok, text=text) for i, (_, text, ok) in enumerate(cases)]
    assert schema_validity(reqs, outs) == {
        "schema_checked": 5,
        "schema_constrained": 2,
        "schema_valid_rate": 2 / 5,
        "schema_valid_rate_constrained": 1 / 2,
        "schema_valid_rate_free": 1 / 3,
    }
    assert schema_validity([BenchRequest("p", 1, 5)], outs[:1]) == {}
