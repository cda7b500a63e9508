"""Incremental detokenization never emits broken UTF-8, and stop strings are never streamed."""

from __future__ import annotations

import pytest

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.sampling import SamplingParams
from tests.conftest import build_tokenizer

TEXTS = ["Größe café naïve", "東京 こんにちは 🙂🚀", "The quick brown fox jumps over the lazy dog.", "a\n  b\tc"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _stream(tok, ids, params):
    d = IncrementalDetokenizer(tok, [], params)
    deltas = []
    for i, t in enumerate(ids):
        stop = d.add_token(t)
        last = stop is not None or i == len(ids) - 1
        if last:
            d.flush()
        deltas.append(d.take_delta(last))
        if stop:
            return deltas, stop
    return deltas, None


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_without_broken_chars(tokenizer, text):
    ids = tokenizer.encode(text)
    # byte-level BPE splits multi-byte characters across tokens: the stream must hold them back
    assert len(ids) > len(text.split())
    deltas, _ = _stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    deltas, stop = _stream(tokenizer, ids, SamplingParams(stop=["over the", "zzz"]))
    assert stop == "over the"
    assert "".join(deltas) == "The quick brown fox jumps "
    for i in range(len(deltas)):
        assert "over" not in "".join(deltas[: i + 1]) or "over the" in text  # never sent a partial stop
    assert not any("ov" in d for d in deltas)


def test_first_matching_stop_wins(tokenizer):
    ids = tokenizer.encode("Question: What is the capital of France?")
    _, stop = _stream(tokenizer, ids, SamplingParams(stop=["capital", "What"]))
    assert stop == "What"
