"""`inferd profile` against a real (tiny) replica: a profile the simulator can load."""

from __future__ import annotations

import json

import pytest

from inferd.autoscale.measure import MIN_CHUNK, StepRecorder, fit_prefill_rate
from inferd.autoscale.profile import Profile, load_profile
from inferd.cli import main
from tests.conftest import build_tiny_model
from tests.gateway.procs import start_replica, wait_http
from tests.net import free_port


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_measures_a_running_replica(tmp_path, capsys):
    replica = start_replica(build_tiny_model("llama", tmp_path / "tiny"), tmp_path)
    try:
        wait_http(replica, "/health", timeout=90)
        out = tmp_path / "profile.json"
        argv = ["profile", "--base-url", replica.url, "--prompt-lens", "8,384", "--batches", "1,2"]
        argv += ["--output-len", "32", "--requests-per-point", "4", "--cold-start-s", "5", "--out", str(out)]
        assert main(argv) == 0
    finally:
        replica.stop()
    p = load_profile(str(out))
    assert p.prefill_tokens_per_s > 0 and p.decode_batch == [1, 2] and all(s > 0 for s in p.decode_step_s)
    assert p.max_num_seqs == 2 and p.cold_start_s == 5 and "measured" in p.description
    source = json.loads(out.read_text())["source"]
    assert source.startswith("inferd profile")
    assert "steps' times" in source and "decode-only steps" in source  # read from the replica's step events
    assert p.max_num_batched_tokens == 512  # the engine's default budget, read from its steps


def test_prefill_rate_fitted_from_steps_recovers_a_known_rate():
    """Steps built from the simulator's model (decode step by batch + tokens / rate) give the rate back;
    short chunks (noise) and decode-only steps do not count."""
    decode = Profile("d", 1.0, [1, 8], [0.05, 0.12], 8)
    rate = 1500.0
    steps = [
        {"p": p, "n": n, "d": d, "dur": decode.step_s(max(1, d + n)) + p / rate}
        for p, n, d in [(256, 1, 0), (512, 2, 3), (248, 1, 7), (64, 1, 5)]
    ]
    steps += [{"p": 0, "n": 0, "d": 8, "dur": 5.0}, {"p": MIN_CHUNK - 1, "n": 1, "d": 2, "dur": 5.0}]
    assert fit_prefill_rate(steps, decode.step_s) == pytest.approx(rate)
    assert fit_prefill_rate(steps[:2], decode.step_s) is None  # too few to trust


def test_step_recorder_says_when_there_are_no_step_events():
    rec = StepRecorder(f"http://127.0.0.1:{free_port()}/dashboard/events", connect_timeout=5)
    assert not rec.ok and rec.stop() == []
