"""`inferd profile` against a real (tiny) replica: a profile the simulator can load."""

from __future__ import annotations

import json

import pytest

from inferd.autoscale.profile import load_profile
from inferd.cli import main
from tests.conftest import build_tiny_model
from tests.gateway.procs import start_replica, wait_http


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_measures_a_running_replica(tmp_path, capsys):
    replica = start_replica(build_tiny_model("llama", tmp_path / "tiny"), tmp_path)
    try:
        wait_http(replica, "/health", timeout=90)
        out = tmp_path / "profile.json"
        argv = ["profile", "--base-url", replica.url, "--prompt-lens", "8,384", "--batches", "1,2"]
        argv += ["--output-len", "4", "--requests-per-point", "2", "--cold-start-s", "5", "--out", str(out)]
        assert main(argv) == 0
    finally:
        replica.stop()
    p = load_profile(str(out))
    assert p.prefill_tokens_per_s > 0 and p.decode_batch == [1, 2] and all(s > 0 for s in p.decode_step_s)
    assert p.max_num_seqs == 2 and p.cold_start_s == 5 and "measured" in p.description
    assert json.loads(out.read_text())["source"].startswith("inferd profile")
