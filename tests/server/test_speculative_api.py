"""Speculative decoding behind the OpenAI server: streamed and whole completions give every token plain
greedy decoding gives, and /metrics and the dashboard's summary count the drafts (vLLM's spec_decode_*)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd.cli import main
from inferd.server.dashboard import DashboardHub
from tests.engine.echo_model import echo_model
from tests.server.conftest import MODEL_NAME, start_server


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    folder = echo_model(tiny_models["llama"], tmp_path_factory.mktemp("echo") / "llama", 0.0)
    spec = start_server(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    plain = start_server(folder)
    yield spec, plain
    spec.stop()
    plain.stop()


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        s.name + "".join(f"{{{v}}}" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
        for f in text_string_to_metric_families(text)
        if f.name.startswith("inferd:spec_decode")
        for s in f.samples
    }


def _stream_text(url: str, body: dict) -> tuple[str, int]:
    text, chunks = "", 0
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    chunks += 1
    return text, chunks


def test_completions_match_plain_decoding_and_the_drafts_are_counted(servers):
    spec, plain = servers
    prompt = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    before = _counters(spec.url)
    a = httpx.post(spec.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(plain.url + "/v1/completions", json=body, timeout=60).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 24
    streamed, _ = _stream_text(spec.url, body)
    assert streamed == b["choices"][0]["text"]
    after = _counters(spec.url)
    drafted = after["inferd:spec_decode_num_draft_tokens_total"] - before["inferd:spec_decode_num_draft_tokens_total"]
    accepted = (
        after["inferd:spec_decode_num_accepted_tokens_total"] - before["inferd:spec_decode_num_accepted_tokens_total"]
    )
    assert drafted > 0 and accepted == drafted  # the echo model repeats its last token: every draft holds
    assert after["inferd:spec_decode_num_accepted_tokens_per_pos_total{0}"] > 0
    assert _counters(plain.url)["inferd:spec_decode_num_draft_tokens_total"] == 0
    spec.wait_idle()
    plain.wait_idle()
    # the dashboard's summary (read from the same engine stats; a second hub takes over the step events)
    summary = DashboardHub(spec.engine, spec.state.async_engine, MODEL_NAME).summary(time.monotonic())
    assert summary["spec_tokens_per_step"] > 1 and summary["spec_acceptance"] == 1.0


def test_the_bench_reports_the_servers_acceptance(servers, tmp_path):
    """`inferd bench serve --dataset quote` reads the drafts and acceptance from the server's counters."""
    spec, plain = servers
    for srv, name in ((spec, "spec"), (plain, "plain")):
        argv = ["bench", "serve", "--base-url", srv.url, "--model", MODEL_NAME, "--dataset", "quote",
                "--random-input-len", "40", "--random-output-len", "12", "--ignore-eos", "--num-prompts", "4",
                "--max-concurrency", "2", "--temperature", "0", "--no-progress", "--save-result",
                "--result-dir", str(tmp_path), "--result-filename", f"{name}.json"]  # fmt: skip
        assert main(argv) == 0
    got = json.loads((tmp_path / "spec.json").read_text())
    assert got["completed"] == 4 and got["spec_decode_num_draft_tokens"] > 0
    rate = got["spec_decode_num_accepted_tokens"] / got["spec_decode_num_draft_tokens"]
    assert 0 < got["spec_decode_acceptance_rate"] == rate <= 1  # "\n\n" also starts "\n\nText:" in the prompt
    assert got["spec_decode_mean_acceptance_length"] > 1
    off = json.loads((tmp_path / "plain.json").read_text())
    assert off["spec_decode_num_draft_tokens"] == 0 and off["spec_decode_acceptance_rate"] is None
    spec.wait_idle()
