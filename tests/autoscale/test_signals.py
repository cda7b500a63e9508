"""Signals from `/metrics` pages and from a real Prometheus: rates, quantiles and the predicted TTFT."""

from __future__ import annotations

import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferd.autoscale.prom import start_prometheus, write_targets
from inferd.autoscale.signals import (
    DirectSource,
    Measured,
    PrometheusSource,
    buckets_around,
    histogram_quantile,
    parse_scrape,
)
from tests.net import free_port

VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160]


class FakeReplica:
    """The inferd: metrics a replica exposes, driven by the test."""

    def __init__(self, ttft_buckets: list[float] = VLLM_TTFT):
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.waiting = Gauge("inferd:num_requests_waiting", "", lbl, registry=r).labels("m")
        self.running = Gauge("inferd:num_requests_running", "", lbl, registry=r).labels("m")
        self.kv = Gauge("inferd:kv_cache_usage_perc", "", lbl, registry=r).labels("m")
        self.requests = Counter("inferd:request_success", "", [*lbl, "finished_reason"], registry=r)
        self.prompt = Counter("inferd:prompt_tokens", "", lbl, registry=r).labels("m")
        self.generated = Counter("inferd:generation_tokens", "", lbl, registry=r).labels("m")
        self.ttft = Histogram("inferd:time_to_first_token_seconds", "", lbl, registry=r, buckets=ttft_buckets)
        self.ttft = self.ttft.labels("m")
        self.prefill = Histogram("inferd:request_prefill_time_seconds", "", lbl, registry=r).labels("m")

    def serve_one(self, ttft: float, prompt: int = 100, prefill_s: float = 0.05, output: int = 10) -> None:
        self.requests.labels("m", "length").inc()
        self.prompt.inc(prompt)
        self.generated.inc(output)
        self.ttft.observe(ttft)
        self.prefill.observe(prefill_s)

    def page(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int) -> ThreadingHTTPServer:
        """`/metrics` in the text format, as `inferd serve` answers (never OpenMetrics, which renames `a:b`)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = fake.page().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


def test_histogram_quantile_interpolates_within_the_bucket_as_promql_does():
    assert histogram_quantile(0.5, {1.0: 0, 2.0: 10, math.inf: 10}) == pytest.approx(1.5)
    assert histogram_quantile(0.95, {1.0: 5, 2.0: 5, math.inf: 10}) == 2.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.95, {1.0: 0, math.inf: 0}) is None


def test_coarse_buckets_misread_a_quantile_and_buckets_around_the_slo_do_not():
    # TTFTs spread evenly over 1.0..1.3 s; the true p95 is 1.285 s
    values = [1.0 + 0.3 * (i + 0.5) / 200 for i in range(200)]
    true_p95 = sorted(values)[int(0.95 * 200)]

    def p95(bounds: list[float]) -> float:
        cum = {b: float(sum(v <= b for v in values)) for b in bounds} | {math.inf: float(len(values))}
        return histogram_quantile(0.95, cum)

    assert p95(VLLM_TTFT) > 2.3  # read back between 1 and 2.5 s: almost twice the truth
    fine = buckets_around([1.2], VLLM_TTFT)
    assert abs(p95(fine) - true_p95) / true_p95 < 0.05


def test_direct_scrapes_give_rates_quantiles_and_the_predicted_ttft():
    rep = FakeReplica()
    src = DirectSource(window_s=10)
    src.add([("http://r1", parse_scrape(rep.page(), 0.0))], 0.0)
    for _ in range(20):
        rep.serve_one(ttft=0.3, prompt=200, prefill_s=0.1)
    rep.waiting.set(3)
    rep.kv.set(0.5)
    m = src.add([("http://r1", parse_scrape(rep.page(), 4.0))], 4.0)
    assert (m.waiting, m.kv_cache_usage) == (3, 0.5)
    assert m.request_rate == pytest.approx(5.0) and m.prompt_token_rate == pytest.approx(1000.0)
    assert 0.25 < m.ttft_p95_s <= 0.5 and m.itl_p95_s is None
    assert m.prefill_tokens_per_s == pytest.approx(2000.0) and m.mean_prompt_tokens == pytest.approx(200.0)
    # 3 queued ahead on one replica + its own: 4 prompts of 200 tokens at 2000 tokens/s
    s = m.signals(at=4.0, ready=1, gateway_waiting=0)
    assert s.predicted_ttft_s == pytest.approx(0.4) and s.token_rate == pytest.approx(1000.0 + 50.0)
    assert Measured().predicted_ttft(ready=1) is None  # nothing measured yet


def test_a_scrape_outside_the_window_drops_out_and_a_restarted_counter_counts_from_zero():
    rep = FakeReplica()
    src = DirectSource(window_s=5)
    src.add([("u", parse_scrape(rep.page(), 0.0))], 0.0)
    for _ in range(10):
        rep.serve_one(ttft=0.1)
    src.add([("u", parse_scrape(rep.page(), 1.0))], 1.0)
    m = src.add([("u", parse_scrape(rep.page(), 10.0))], 10.0)
    assert m.request_rate == 0.0  # the ten requests are older than the window
    fresh = FakeReplica()  # the process restarted: counters back at zero
    fresh.serve_one(ttft=0.1)
    m = src.add([("u", parse_scrape(fresh.page(), 11.0))], 11.0)
    assert m.request_rate == pytest.approx(1 / 10)  # one request since the base scrape at t=1


def test_pools_read_in_turn_keep_their_own_history():
    a, b = FakeReplica(), FakeReplica()
    src = DirectSource(window_s=10)
    for t in (0.0, 2.0):
        for _ in range(4 if t else 0):
            a.serve_one(ttft=0.1)
        ma = src.add([("http://a", parse_scrape(a.page(), t))], t, pool="prefill")
        mb = src.add([("http://b", parse_scrape(b.page(), t))], t, pool="decode")
    assert ma.request_rate == pytest.approx(2.0) and mb.request_rate == 0.0  # reading b forgot none of a


@pytest.mark.timeout(90)
def test_a_real_prometheus_reads_the_signals_through_its_http_api(tmp_path):
    rep = FakeReplica(ttft_buckets=buckets_around([0.5], VLLM_TTFT))
    port = free_port()
    server = rep.serve(port)
    prom = start_prometheus(tmp_path, free_port(), scrape_interval_s=0.5)
    source = PrometheusSource(prom.url, window_s=4)
    stop = threading.Event()

    def traffic() -> None:  # 10 requests/s, TTFTs cycling over 0.40..0.58 s
        i = 0
        while not stop.is_set():
            rep.serve_one(ttft=0.40 + 0.02 * (i % 10), prompt=100, prefill_s=0.05)
            i += 1
            time.sleep(0.1)

    t = threading.Thread(target=traffic, daemon=True)
    try:
        rep.waiting.set(2)
        write_targets(tmp_path / "targets", "pool-a", [f"http://127.0.0.1:{port}"])
        t.start()
        # Prometheus applies discovered targets at most every 5 s; then a window and a bit of data
        deadline, first, m = time.monotonic() + 40, None, None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            m = source.read("pool-a", [], time.monotonic())
            first = first or (time.monotonic() if m.request_rate > 0 else None)
            if first is not None and time.monotonic() - first > 5:
                break
        assert m is not None and m.waiting == 2
        assert m.request_rate == pytest.approx(10.0, rel=0.35)  # sleep jitter on a busy machine
        assert m.mean_prompt_tokens == pytest.approx(100.0, rel=0.01)
        assert m.prefill_tokens_per_s == pytest.approx(2000.0, rel=0.01)
        assert 0.5 <= m.ttft_p95_s <= 0.6  # true p95 0.58 s, buckets 5% apart around 0.5 s
        assert source.read("no-such-pool", [], 0).ttft_p95_s is None
    finally:
        stop.set()
        t.join(5)
        source.close()
        prom.stop()
        server.shutdown()


def test_the_server_takes_histogram_buckets_from_its_flags():
    from inferd.cli import build_parser
    from inferd.engine.engine import EngineStats
    from inferd.server.metrics import ServerMetrics, parse_buckets

    args = build_parser().parse_args(["serve", "--ttft-buckets", "0.5,0.1,0.45", "--itl-buckets", "0.05"])
    assert args.ttft_buckets == [0.1, 0.45, 0.5] and args.itl_buckets == [0.05]
    for bad in ("", "a,b", "-1,2", "inf"):
        with pytest.raises(ValueError):
            parse_buckets(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ttft-buckets", "0,1"])
    metrics = ServerMetrics("m", ttft_buckets=[0.45, 0.5])
    metrics.attach(lambda: (EngineStats(0, 0, 0.0, 0, 0, 0), 0))
    metrics.ttft.observe(0.47)
    text = generate_latest(metrics.registry).decode()
    assert 'inferd:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 1.0' in text
    assert 'le="0.45"' in text and 'le="0.25"' not in text


def test_the_autoscaler_service_turns_prometheus_answers_into_the_desired_replicas_gauge():
    from inferd.autoscale.gauge import AutoscalerService
    from inferd.fleet.spec import parse_fleet

    spec = parse_fleet(
        "models:\n  - name: m\n    pools:\n      - name: p\n        replicas: 1\n"
        "        autoscaling: {min_replicas: 1, max_replicas: 4, targets: {waiting: 2}, interval_s: 5}\n"
    )
    answers = {
        'count(up{pool="p"} == 1)': 1.0,
        'count(up{pool="p"} == 0)': None,
        "sum(inferd_gateway_queue_size)": 1.0,
        'sum(inferd:num_requests_waiting{pool="p"})': 5.0,
    }

    class FakePrometheus(PrometheusSource):
        def query(self, promql: str) -> float | None:
            return answers.get(promql)

    service = AutoscalerService(spec, FakePrometheus("http://unused", window_s=30))
    d = service.round(100.0)["p"]
    assert (d.current, d.desired) == (1, 3)  # (5 waiting + 1 at the gateway) / 2 per replica
    assert service.round(101.0) == {}  # the next decision waits for the pool's interval
    text = generate_latest(service.fleet.registry).decode()
    assert 'inferd_autoscaler_desired_replicas{pool="p"} 3.0' in text
