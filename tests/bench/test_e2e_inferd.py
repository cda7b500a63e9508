"""`inferd bench serve` against a real `inferd serve` with a tiny random model: the acceptance run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import httpx
import pytest

from inferd.cli import main
from tests.bench.fake_server import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("inferd.server") is None, reason="inferd serve not built yet")


@pytest.fixture(scope="module")
def inferd_server(tiny_models, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--model", str(tiny_models["llama"]), "--port", str(port),
           "--max-model-len", "512", "--kv-cache-memory", "64MiB"]  # fmt: skip
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"inferd serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"inferd serve did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, str(tiny_models["llama"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_bench_against_inferd_serve(inferd_server, tmp_path):
    url, model = inferd_server
    argv = ["bench", "serve", "--base-url", url, "--model", model, "--num-prompts", "8", "--no-progress",
            "--random-input-len", "24", "--random-output-len", "6", "--ignore-eos", "--sweep", "concurrency:1,4",
            "--slo", "ttft:60000", "--price-per-hour", "1.0", "--save-detailed", "--plot",
            "--result-dir", str(tmp_path), "--result-filename", "inferd.json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "inferd.json").read_text())
    assert result["tokenizer_id"] == "server:vllm"  # read from inferd's /tokenize
    assert result["server_models"] and result["server_models"][0]["id"] == model
    for run in result["runs"]:
        assert run["completed"] + run["failed"] == 8 and run["failed"] == 0
        assert run["token_count_source"] == {"input": "usage", "output": "usage"}
        assert run["output_lens"] == [6] * 8  # ignore_eos: every request runs to max_tokens
        # prompts were cut to 24 tokens of the server's tokenizer, BOS included
        assert all(23 <= n <= 25 for n in run["input_lens"])
        d = run["duration"]
        assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / d)
        assert run["total_token_throughput"] == pytest.approx((run["total_input_tokens"] + 48) / d)
        assert 0 < run["mean_ttft_ms"] <= run["mean_e2el_ms"] and run["mean_tpot_ms"] > 0
    assert result["best"]["max_concurrency"] == 4
    assert (tmp_path / "inferd_sweep.png").exists() and (tmp_path / "inferd_rateinf_c4_ttft_itl.png").exists()


def test_wrong_model_name_against_inferd(inferd_server, capsys):
    url, _ = inferd_server
    argv = ["bench", "serve", "--base-url", url, "--model", "no-such-model", "--num-prompts", "2", "--no-progress",
            "--random-input-len", "8", "--random-output-len", "2", "--tokenizer-source", "server"]  # fmt: skip
    rc = main(argv)
    err = capsys.readouterr().err
    # inferd's /tokenize checks the model too, so the run stops before sending load, with a message either way
    assert rc == 2 and "check --model" in err and model_hint(err)


def model_hint(err: str) -> bool:
    return "not 'no-such-model'" in err


def test_bench_json_schema_dataset_counts_valid_outputs(inferd_server, tmp_path):
    """Real schemas, half sent as response_format: the tiny random model writes valid JSON only under the
    constraint, so the constrained outputs that finished are valid and the free ones are not."""
    url, model = inferd_server
    argv = ["bench", "serve", "--base-url", url, "--model", model, "--dataset", "json-schema", "--num-prompts", "12",
            "--max-schema-chars", "300", "--structured-output-ratio", "0.5", "--random-output-len", "120",
            "--max-concurrency", "4", "--no-progress", "--seed", "1", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "schemas.json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "schemas.json").read_text())
    assert result["completed"] == 12 and result["schema_checked"] == 12
    assert 0 < result["schema_constrained"] < 12
    assert result["schema_valid_rate_free"] == 0.0
    assert result["schema_valid_rate_constrained"] > 0.0
