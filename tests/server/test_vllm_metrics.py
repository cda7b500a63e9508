"""`--metrics-names vllm`: every inferd: metric also under vLLM's name, the same values, and the gateway
(which reads either) counts a replica's load once."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd.gateway.replicas import parse_load
from tests.server.conftest import MODEL_NAME, start_server

# what llm-d's endpoint picker, KEDA examples and vLLM's dashboards read
VLLM_NAMES = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@pytest.fixture(scope="module")
def vllm_server(tiny_models):
    srv = start_server(tiny_models["llama"], settings={"metrics_names": "vllm"})
    yield srv
    srv.stop()


def test_every_inferd_metric_is_also_under_its_vllm_name(vllm_server):
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4}
    before = _samples(httpx.get(vllm_server.url + "/metrics", timeout=10).text)  # other tests share the server
    assert httpx.post(vllm_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(vllm_server.url + "/metrics", timeout=10).text
    samples = _samples(text)
    names = {n for n, _ in samples}
    assert set(VLLM_NAMES) <= names, set(VLLM_NAMES) - names
    inferd = {k: v for k, v in samples.items() if k[0].startswith("inferd:")}
    assert len(inferd) > 50
    for (name, labels), value in inferd.items():
        twin = ("vllm:" + name.removeprefix("inferd:"), labels)
        assert samples[twin] == value, twin
    ttft = ("vllm:time_to_first_token_seconds_count", (("model_name", MODEL_NAME),))
    assert samples[ttft] - before.get(ttft, 0) == 1
    generated = ("vllm:generation_tokens_total", (("model_name", MODEL_NAME),))
    assert samples[generated] - before.get(generated, 0) == 4
    gpu = ("vllm:gpu_cache_usage_perc", (("model_name", MODEL_NAME),))
    assert samples[gpu] == samples[("vllm:kv_cache_usage_perc", (("model_name", MODEL_NAME),))]


def test_the_gateway_counts_a_replica_with_both_names_once(vllm_server):
    body = {"model": MODEL_NAME, "prompt": "prefix queries to count", "max_tokens": 1}
    assert httpx.post(vllm_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(vllm_server.url + "/metrics", timeout=10).text
    both = parse_load(text, at=0.0)
    only_inferd = "\n".join(line for line in text.splitlines() if "vllm:" not in line) + "\n"
    only_vllm = "\n".join(line for line in text.splitlines() if "inferd:" not in line) + "\n"
    assert both == parse_load(only_inferd, at=0.0) == parse_load(only_vllm, at=0.0)
    assert both.prefix_queries > 0


def test_the_default_is_inferd_names_only(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert "inferd:num_requests_waiting" in text and "vllm:" not in text


def test_cache_config_info_describes_the_kv_cache(vllm_server):
    """vLLM's info gauge: capacity planners and dashboards read the KV cache's size and dtype from it."""
    samples = _samples(httpx.get(vllm_server.url + "/metrics", timeout=10).text)
    (labels,) = [dict(k[1]) for k in samples if k[0] == "inferd:cache_config_info"]
    assert labels["block_size"] == "16" and labels["cache_dtype"] == "auto" and labels["kv_dtype"] == "float32"
    assert int(labels["num_gpu_blocks"]) > 0 and labels["enable_prefix_caching"] == "True"
