"""`inferd serve` checks its flags before it loads the model: a flag missing for the role, given for another
role, out of range, unreadable, or a port already taken exits at once with status 2 and what to change.

Each case names a model that does not exist: had the model been looked for first, the error would be about
the model, so the message itself shows the check came before the load; the time bound shows it came before
the heavy imports too."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from inferd.procs import ROOT, child_env

pytestmark = pytest.mark.timeout(60)

FAST_S = 3.0


def _serve(*flags: str) -> tuple[int, str, float]:
    env = child_env()
    env.pop("INFERD_KV_SECRET", None)
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--model", "/nonexistent/model"]
    t0 = time.monotonic()
    done = subprocess.run([*argv, *flags], capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)
    return done.returncode, done.stderr, time.monotonic() - t0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--role", "decode"], "--role decode needs --kv-secret"),
        (["--role", "prefill"], "--role prefill needs --kv-secret"),
        (["--role", "decode", "--kv-secret", "s"], "--role decode needs --kv-peers"),
        (["--kv-peers", "127.0.0.1:9100"], "--kv-peers is for --role decode; this instance is --role both"),
        (["--role", "prefill", "--kv-secret", "s", "--kv-peers-file", "x"], "--kv-peers-file is for --role decode"),
        (["--role", "decode", "--kv-secret", "s", "--kv-peers", "h:1", "--kv-port", "9"], "--kv-port is for --role"),
        (["--kv-transport", "tcp"], "--kv-transport is for --role prefill or decode"),
        (["--role", "prefill", "--kv-secret", "s", "--kv-lease-ttl", "0"], "--kv-lease-ttl 0: must be more than 0"),
        (["--role", "prefill", "--kv-secret", "s", "--kv-port", "70000"], "--kv-port 70000"),
        (["--max-request-body", "eight"], "--max-request-body: cannot read memory size 'eight'"),
        (["--max-waiting-requests", "-1"], "--max-waiting-requests -1: must be 0 or more"),
        (["--drain-timeout", "-5"], "--drain-timeout -5: must be 0 or more"),
        (["--port", "70000"], "--port 70000"),
        (["--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
    ],
)
def test_a_bad_flag_exits_at_once_with_what_to_change(flags, message):
    rc, err, took = _serve(*flags)
    assert rc == 2 and message in err, err
    assert "does not exist" not in err and "Traceback" not in err, err
    assert took < FAST_S, f"{took:.1f} s"


def test_a_port_already_taken_exits_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc, err, took = _serve("--port", str(s.getsockname()[1]))
    assert rc == 2 and "cannot listen there" in err, err
    assert took < FAST_S, f"{took:.1f} s"


def test_good_flags_get_as_far_as_the_model():
    """The checks refuse nothing that is right: a complete decode command fails only on the missing model."""
    rc, err, _ = _serve("--role", "decode", "--kv-secret", "s", "--kv-peers", "127.0.0.1:9100", "--port", "0")
    assert rc == 2 and "does not exist" in err, err
