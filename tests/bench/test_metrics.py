"""Metric functions on hand-built timings; every expected value is worked out by hand in the comments."""

from __future__ import annotations

import pytest

from inferd.bench.cost import best_level, cost_fields, cost_per_million
from inferd.bench.metrics import (
    RequestTiming,
    compute_run_metrics,
    e2el,
    error_kind,
    itls,
    meets_slos,
    parse_slos,
    peak_concurrency,
    peak_output_throughput,
    summarize_ms,
    tpot,
    ttft,
)


def req(send, chunks, end, out, inp=10, ok=True, error=None) -> RequestTiming:
    return RequestTiming(send, end, list(chunks), ok, error, inp, out)


def test_ttft_itl_e2el_tpot_exclude_the_first_token():
    t = req(1.0, [1.1, 1.15, 1.25, 1.30], 1.32, out=4)
    assert ttft(t) == pytest.approx(0.1)
    assert itls(t) == pytest.approx([0.05, 0.10, 0.05])
    assert e2el(t) == pytest.approx(0.32)
    # (E2EL - TTFT) / (n - 1) = (0.32 - 0.10) / 3
    assert tpot(t) == pytest.approx(0.22 / 3)


def test_itl_is_per_chunk_but_tpot_is_per_token():
    # 3 chunks carrying 6 tokens: 2 gaps, and TPOT divides by 5 tokens after the first
    t = req(0.0, [0.2, 0.4, 0.7], 0.7, out=6)
    assert itls(t) == pytest.approx([0.2, 0.3])
    assert tpot(t) == pytest.approx((0.7 - 0.2) / 5)


def test_single_token_has_no_tpot_and_no_itl():
    t = req(0.0, [0.3], 0.31, out=1)
    assert tpot(t) is None
    assert itls(t) == []
    assert ttft(req(0.0, [], 0.5, out=0)) is None


def test_summaries_interpolate_percentiles_linearly_like_numpy_and_vllm():
    s = summarize_ms([0.001, 0.002, 0.003, 0.004], (90, 99))
    assert (s.mean, s.median) == pytest.approx((2.5, 2.5))
    assert s.percentiles == pytest.approx({90: 3.7, 99: 3.97})
    assert s.std == pytest.approx(1.118034, rel=1e-6)  # population std of 1..4 ms: sqrt(1.25)
    fields = s.as_fields("ttft")
    assert set(fields) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"}
    assert summarize_ms([], (99,)).as_fields("itl")["p99_itl_ms"] == 0.0


def test_parse_slos():
    assert parse_slos(["ttft:500", "TPOT:50", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


# Four requests for the goodput tests. TTFT / TPOT / E2EL in ms:
#   a: 100 / (1000-100)/9 = 100 / 1000      b: 200 / (700-200)/9 = 55.6 / 700
#   c: 100 / (400-100)/9 = 33.3 / 400       d: 50 / single token -> TPOT counts 0 / 60
GOODPUT_REQS = [
    req(0.0, [0.1 + 0.1 * i for i in range(10)], 1.0, out=10),
    req(0.0, [0.2 + 0.5 / 9 * i for i in range(10)], 0.7, out=10),
    req(0.0, [0.1 + 0.3 / 9 * i for i in range(10)], 0.4, out=10),
    req(0.0, [0.05], 0.06, out=1),
]


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 150}, [True, False, True, True]),
        ({"tpot": 60}, [False, True, True, True]),
        ({"ttft": 150, "tpot": 60}, [False, False, True, True]),
        ({"e2el": 700}, [False, True, True, True]),  # at the limit counts as met
        ({"ttft": 100, "tpot": 34, "e2el": 400}, [False, False, True, True]),
        ({"ttft": 40}, [False, False, False, False]),
    ],
)
def test_goodput_with_several_slos(slos, good):
    assert [meets_slos(t, slos) for t in GOODPUT_REQS] == good
    m = compute_run_metrics(GOODPUT_REQS, start=0.0, end=2.0, slos=slos)
    assert m.good_completed == sum(good)
    assert m.request_goodput == pytest.approx(sum(good) / 2.0)
    outs = [t.output_tokens for t, g in zip(GOODPUT_REQS, good, strict=True) if g]
    assert m.output_goodput == pytest.approx(sum(outs) / 2.0)
    assert m.as_dict()["slo_attainment"] == pytest.approx(sum(good) / 4)


def test_failed_request_never_meets_slos():
    assert not meets_slos(req(0, [0.01], 0.02, out=1, ok=False, error="HTTP 500: x"), {"ttft": 1000})


def test_run_metrics_throughput_and_failures():
    timings = [
        req(0.0, [0.5, 1.0], 1.0, out=2, inp=100),
        req(0.5, [1.0, 1.5, 2.0], 2.0, out=3, inp=50),
        req(1.0, [], 1.1, out=0, ok=False, error="HTTP 500: boom"),
        req(1.0, [], 1.2, out=0, ok=False, error="ConnectError: refused"),
        req(1.0, [], 1.3, out=0, ok=False, error="HTTP 500: again"),
    ]
    m = compute_run_metrics(timings, start=0.0, end=2.5).as_dict()
    assert (m["completed"], m["failed"]) == (2, 3)
    assert m["errors_by_type"] == {"HTTP 500": 2, "ConnectError": 1}
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (150, 5)
    assert m["duration"] == 2.5
    assert m["request_throughput"] == pytest.approx(2 / 2.5)
    assert m["output_throughput"] == pytest.approx(5 / 2.5)
    assert m["total_token_throughput"] == pytest.approx(155 / 2.5)
    assert m["mean_ttft_ms"] == pytest.approx(500.0)  # both 0.5 s
    assert m["mean_itl_ms"] == pytest.approx(500.0)  # gaps 0.5, 0.5, 0.5
    # TPOT: (1.0 - 0.5) / 1 = 500 ms and (1.5 - 0.5) / 2 = 500 ms
    assert m["mean_tpot_ms"] == pytest.approx(500.0)
    assert m["mean_e2el_ms"] == pytest.approx(1250.0)  # 1.0 s and 1.5 s
    assert m["request_goodput"] is None and m["slo_attainment"] is None


def test_peak_output_throughput_buckets_by_second_and_weights_chunks():
    a = req(0.0, [0.1, 0.5, 0.9, 1.2], 1.2, out=4)
    assert peak_output_throughput([a], start=0.0) == 3  # three chunks in second 0
    b = req(0.0, [0.1, 0.5, 0.9, 1.2], 1.2, out=8)  # two tokens per chunk
    assert peak_output_throughput([b], start=0.0) == 6
    assert peak_output_throughput([a, b], start=0.0) == 9
    assert peak_output_throughput([], start=0.0) == 0


def test_peak_concurrency_counts_overlap_exactly():
    timings = [req(0.0, [], 1.0, 0), req(0.5, [], 2.0, 0), req(1.0, [], 3.0, 0), req(1.5, [], 1.6, 0)]
    # at 1.5: requests 2, 3, 4 (request 1 ended at 1.0, as request 3 started: no overlap)
    assert peak_concurrency(timings) == 3


def test_error_kind():
    assert error_kind("HTTP 404: The model `x` does not exist.") == "HTTP 404"
    assert error_kind("Timeout: no complete response within 1 s") == "Timeout"
    assert error_kind(None) == "unknown error"


def test_cost_per_million_formula():
    # $2/h x 3 replicas = $6/h; 100 tok/s = 360,000 tok/h -> $16.67 per million
    assert cost_per_million(2.0, 3, 100.0) == pytest.approx(6 / 360_000 * 1e6)
    assert cost_per_million(2.0, 1, 0.0) is None
    run = {"output_throughput": 100.0, "total_token_throughput": 400.0, "output_goodput": 50.0}
    c = cost_fields(run, 3.6, 1)
    assert c["cost_per_million_output_tokens"] == pytest.approx(10.0)
    assert c["cost_per_million_total_tokens"] == pytest.approx(2.5)
    assert c["goodput_cost_per_million_output_tokens"] == pytest.approx(20.0)
    assert c["goodput_cost_per_million_total_tokens"] is None
    assert cost_fields(run, None) == {}


def test_best_level_is_highest_load_meeting_the_slos():
    runs = [
        {"max_concurrency": 1, "slo_attainment": 1.0, "output_throughput": 10.0},
        {"max_concurrency": 4, "slo_attainment": 0.95, "output_throughput": 30.0},
        {"max_concurrency": 16, "slo_attainment": 0.5, "output_throughput": 50.0},
    ]
    best = best_level(runs, "max_concurrency", 0.9)
    assert best["max_concurrency"] == 4 and best["output_throughput"] == 30.0
    assert best_level(runs, "max_concurrency", 0.99)["max_concurrency"] == 1
    assert best_level(runs[2:], "max_concurrency", 0.9) is None
    rates = [{"request_rate": "inf", "slo_attainment": 1.0}, {"request_rate": 2.0, "slo_attainment": 1.0}]
    assert best_level(rates, "request_rate", 0.9)["request_rate"] == "inf"
