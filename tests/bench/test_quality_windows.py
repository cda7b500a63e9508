"""benchmarks.quality's window scoring, which benchmarks.perplexity_vs_llama_cpp scores llama.cpp's way: a
window scored from a position on counts only the tokens after it, whole or in prefill chunks."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.quality import window_nll
from inferd import LLM

pytestmark = pytest.mark.timeout(120)


def test_scoring_from_a_position_counts_the_tokens_after_it_only(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=128, kv_cache_memory=8 << 20, num_threads=1)
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    whole, n = window_nll(llm, ids)
    assert n == 39 and whole > 0
    half, m = window_nll(llm, ids, score_from=20)
    head, k = window_nll(llm, ids[:21])  # predicts ids[1..20]: the tokens the half left out
    assert (m, k) == (19, 20)
    assert math.isclose(head + half, whole, rel_tol=1e-4)
    chunked, m2 = window_nll(llm, ids, rows=6, score_from=20)  # a position inside a chunk, not at its start
    assert m2 == m and math.isclose(chunked, half, rel_tol=1e-4)
    assert window_nll(llm, ids, score_from=39) == (0.0, 0)
    llm.engine.check_idle()
