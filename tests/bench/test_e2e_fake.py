"""The whole pipeline (CLI -> datasets -> load -> metrics -> report -> JSON -> plots -> compare) against a
small fake OpenAI-compatible streaming server, including the ways a run goes wrong."""

from __future__ import annotations

import json
import time

import pytest

from inferd.cli import main
from tests.bench.fake_server import FakeServer, free_port


@pytest.fixture(scope="module")
def server():
    with FakeServer() as url:
        yield url


def bench(url, *extra, model="fake", out=None, n=12):
    argv = ["bench", "serve", "--base-url", url, "--model", model, "--num-prompts", str(n), "--no-progress"]
    argv += ["--random-input-len", "32", "--random-output-len", "8"]
    if out is not None:
        argv += ["--result-dir", str(out), "--result-filename", "r.json", "--save-result"]
    return main(argv + list(extra))


def check_consistent(run: dict, sent: int):
    assert run["completed"] + run["failed"] == sent == run["num_prompts"]
    d = run["duration"]
    assert run["request_throughput"] == pytest.approx(run["completed"] / d)
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / d)
    assert run["total_token_throughput"] == pytest.approx((run["total_input_tokens"] + run["total_output_tokens"]) / d)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p95", "p99"):
            assert f"{stat}_{name}_ms" in run
    if run["completed"]:
        assert run["median_ttft_ms"] <= run["p99_ttft_ms"] <= run["p99_e2el_ms"] + 1e-6


def test_single_run_json_detailed_plots(server, tmp_path, capsys):
    rc = bench(server, "--ignore-eos", "--max-concurrency", "4", "--save-detailed", "--plot",
               "--slo", "ttft:5000", "tpot:1000", "--price-per-hour", "3.6", "--label", "a", out=tmp_path)  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Time to First Token" in printed
    run = json.loads((tmp_path / "r.json").read_text())
    check_consistent(run, 12)
    assert run["failed"] == 0 and run["max_concurrency"] == 4 and run["request_rate"] == "inf"
    assert run["backend"] == "openai" and run["model_id"] == "fake" and run["tokenizer_id"] == "server:vllm"
    assert run["server_models"][0]["id"] == "fake" and run["machine"]["cpu_count"] >= 1
    assert run["settings"]["ignore_eos"] is True
    assert run["token_count_source"] == {"input": "usage", "output": "usage"}
    # the fake server counts one token per character plus a BOS; the dataset asked 32 tokens with the BOS
    assert run["input_lens"] == [32] * 12 and run["output_lens"] == [8] * 12
    assert run["total_output_tokens"] == 96 and run["max_concurrent_requests"] <= 4
    assert len(run["itls"]) == 12 and all(len(g) == 7 for g in run["itls"])
    assert run["request_goodput"] == pytest.approx(12 / run["duration"]) and run["slo_attainment"] == 1.0
    assert run["cost_per_million_output_tokens"] == pytest.approx(3.6 / (run["output_throughput"] * 3600) * 1e6)
    lines = (tmp_path / "r.requests.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["output_tokens"] == 8
    for name in ("r_ttft_itl.png", "r_timeline.png"):
        assert (tmp_path / name).stat().st_size > 5000


def test_sweep_best_level_plot_and_compare(server, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, label in ((a, "a"), (b, "b")):
        rc = bench(server, "--sweep", "concurrency:1,4", "--slo", "ttft:10000", "--plot", "--label", label,
                   "--price-per-hour", "1", out=out, n=8)  # fmt: skip
        assert rc == 0
    result = json.loads((a / "r.json").read_text())
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        check_consistent(run, 8)
    assert result["best"]["max_concurrency"] == 4  # every request meets a 10 s TTFT
    assert result["best"]["cost_per_million_output_tokens"] == result["runs"][1]["cost_per_million_output_tokens"]
    assert (a / "r_sweep.png").stat().st_size > 5000 and (a / "r_rateinf_c4_timeline.png").exists()
    capsys.readouterr()
    assert main(["bench", "compare", str(a / "r.json"), str(b / "r.json"), "--save", str(tmp_path / "cmp.json")]) == 0
    printed = capsys.readouterr().out
    assert "max_concurrency=1" in printed and "b / a" in printed
    ratios = json.loads((tmp_path / "cmp.json").read_text())
    assert ratios["max_concurrency=4"]["b"]["completed"] == 1.0


def _request_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_requests(server, tmp_path):
    def lens(name, seed):
        bench(server, "--sweep", "concurrency:2,2", "--save-detailed", "--random-range-ratio", "0.5",
              "--seed", str(seed), out=tmp_path / name, n=6)  # fmt: skip
        return [(r["input_tokens"], r["output_tokens"]) for r in _request_lines(tmp_path / name / "r.requests.jsonl")]

    x, y, z = lens("x", 0), lens("y", 0), lens("z", 1)
    assert len(x) == 12 and x == y and x != z
    assert x[:6] != x[6:]  # the second level drew new requests


def test_chat_endpoint_and_token_counts_without_usage(server, tmp_path):
    assert bench(server, "--endpoint", "chat", "--model", "no-usage", out=tmp_path, n=6) == 0
    run = json.loads((tmp_path / "r.json").read_text())
    check_consistent(run, 6)
    assert run["backend"] == "openai-chat" and run["completed"] == 6
    # no usage: outputs counted with the server's tokenizer (8 characters), inputs from the dataset
    assert run["token_count_source"] == {"input": "tokenizer", "output": "tokenizer"}
    assert run["total_output_tokens"] == 48


def test_server_errors_mid_run_are_counted_and_the_rest_kept(tmp_path):
    with FakeServer() as url:  # its own server: the failure pattern follows its request counter
        assert bench(url, "--model", "flaky", "--num-warmups", "0", "--max-concurrency", "3", out=tmp_path, n=30) == 0
    run = json.loads((tmp_path / "r.json").read_text())
    check_consistent(run, 30)
    # requests 3, 6, ..., 30 answer 500 (10); 5, 10, 20, 25 break off mid-stream (15 and 30 already failed)
    assert run["errors_by_type"] == {"HTTP 500": 10, "StreamError": 4}
    assert run["completed"] == 16 and run["total_output_tokens"] == 16 * 8


def test_wrong_model_fails_fast_with_a_clear_message(server, tmp_path, capsys):
    assert bench(server, model="nope") == 2
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "fix --model" in err and "'fake'" in err
    # without warm-ups every request fails, the run still ends and reports them
    assert bench(server, "--num-warmups", "0", model="nope", out=tmp_path, n=5) == 1
    run = json.loads((tmp_path / "r.json").read_text())
    assert run["completed"] == 0 and run["failed"] == 5 and run["errors_by_type"] == {"HTTP 404": 5}


def test_unreachable_server(capsys):
    t0 = time.monotonic()
    assert bench(f"http://127.0.0.1:{free_port()}") == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert time.monotonic() - t0 < 10


def test_per_request_timeout(server, tmp_path):
    rc = bench(server, "--model", "slow", "--num-warmups", "0", "--request-timeout", "0.5", out=tmp_path, n=3)
    assert rc == 1
    run = json.loads((tmp_path / "r.json").read_text())
    assert run["failed"] == 3 and run["errors_by_type"] == {"Timeout": 3} and run["duration"] < 5


def test_request_rate_spreads_the_sends(server, tmp_path):
    assert bench(server, "--request-rate", "20", "--save-detailed", out=tmp_path, n=20) == 0
    run = json.loads((tmp_path / "r.json").read_text())
    starts = run["start_times"]
    # 19 gaps at 20 req/s average 0.95 s; a seeded Poisson draw of 19 gaps lands well inside 0.3..3 s
    assert 0.3 < max(starts) < 3.0 and starts == sorted(starts)
    assert run["request_rate"] == 20.0 and run["burstiness"] == 1.0


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--sweep", "speed:1,2"], "--sweep"),
        (["--slo", "ttft"], "SLO"),
        (["--dataset", "sharegpt"], "--dataset-path"),
        (["--extra-body", "[1]"], "JSON object"),
    ],
)
def test_bad_flags_say_what_to_change(server, capsys, args, msg):
    assert bench(server, *args) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_too_few_distinct_short_prompts_exits_with_an_error(server, tmp_path_factory, capsys):
    from tests.conftest import build_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(folder)
    t0 = time.monotonic()
    rc = main(["bench", "serve", "--base-url", server, "--model", "fake", "--no-progress", "--tokenizer-source",
               "local", "--tokenizer", str(folder), "--random-input-len", "2", "--num-prompts", "300"])  # fmt: skip
    assert rc == 2 and time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "distinct prompts" in err and "--random-input-len" in err


@pytest.mark.timeout(60)
def test_server_tokenizer_returning_the_same_tokens_exits_with_an_error(capsys):
    fake = FakeServer(constant_tokens=True)
    with fake as url:
        t0 = time.monotonic()
        assert bench(url, n=50) == 2
        assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "same tokens" in err and err.startswith("error:")
    assert fake.app.state.tokenize_calls < 5000  # bounded retries (~100 draws), not ~230k calls
