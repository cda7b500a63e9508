"""`inferd up` with a disaggregated model: a prefill pool, a decode pool and the proxy in front, end to end.

The fleet comes up, serves streamed and whole completions through the gateway with the prompt's KV handed
from a prefill replica to a decode replica; under load each pool grows from 1 to 2 replicas under its own
policy (request rate for prefill, running requests for decode), every replica takes part in handoffs (the
decode replica started first accepts KV from the prefill replica started later, the new decode replica is
used by the proxy), both pools come back to 1, no request fails, and after SIGTERM no process is left.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import build_tiny_model
from tests.fleet.test_up import wait_for
from tests.gateway.procs import replica_metrics, spawn, wait_http
from tests.net import free_port

FLEET = """\
models:
  - name: tiny
    model: {model}
    engine: {{max_model_len: 512, attention_backend: torch, num_threads: 1, max_num_seqs: 4, num_blocks: 128}}
    pools:
      - name: tiny-prefill
        role: prefill
        replicas: 1
        resources: {{cpu: 1}}
        autoscaling:
          min_replicas: 1
          max_replicas: 2
          targets: {{waiting: null, kv_cache_usage: null, request_rate: 1.5}}
          interval_s: 0.5
          window_s: 3
          scale_down_stabilization_s: 2
          cooldown_s: 2
      - name: tiny-decode
        role: decode
        replicas: 1
        resources: {{cpu: 1}}
        autoscaling:
          min_replicas: 1
          max_replicas: 2
          targets: {{waiting: null, kv_cache_usage: null, running: 1}}
          interval_s: 0.5
          window_s: 3
          scale_down_stabilization_s: 3
          cooldown_s: 2
gateway:
  scrape: {{interval_s: 0.25}}
"""

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def listed(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def processes_naming(text: str) -> list[int]:
    """Processes whose command line names `text` (this test's temporary folder: only the fleet's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def stream_text(url: str, body: dict) -> str:
    text, done = [], False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c.get("text") or "" for c in event["choices"]]
    assert done
    return "".join(text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_disaggregated_fleet_hands_kv_over_and_scales_both_pools_to_two_and_back(tmp_path):
    model = build_tiny_model("llama", tmp_path / "tiny")
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET.format(model=model))
    port, metrics_port = free_port(), free_port()
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "inferd.cli", "up", "--config", str(config), "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port), "--state-dir", str(state), "--drain-timeout", "5"]
    argv += ["--status-every", "1"]
    up = spawn("up", argv, port, tmp_path)
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    prefill_list, decode_list = state / "tiny-prefill.replicas", state / "tiny-decode.replicas"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    statuses: list[int] = []
    stops = [threading.Event() for _ in range(4)]

    def send(i: int) -> None:
        while not stops[i].is_set():
            if i % 2:
                statuses.append(200 if stream_text(up.url, body) else 0)
            else:
                statuses.append(httpx.post(f"{up.url}/v1/completions", json=body, timeout=120).status_code)

    def pool_state(pool: str, state: str) -> float:
        for line in httpx.get(metrics, timeout=2).text.splitlines():
            if line.startswith(f'inferd_fleet_replicas{{pool="{pool}",state="{state}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return -1.0

    try:
        wait_http(up, "/metrics", timeout=90)
        # the first request waits at the gateway until a decode replica is ready and the proxy is listed
        first = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        wait_for(lambda: len(listed(prefill_list)) == 1, 60, "the prefill replica")
        assert stream_text(up.url, body) == first.json()["choices"][0]["text"]
        (proxy,) = listed(state / "tiny-decode.front")
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(send, i) for i in range(4)]
            try:
                wait_for(lambda: len(listed(prefill_list)) == len(listed(decode_list)) == 2, 120, "two of each")
                prefills, decodes = listed(prefill_list), listed(decode_list)
                served = len(statuses)
                wait_for(lambda: len(statuses) >= served + 8, 60, "requests served by both pools at two")
                leases = {u: replica_metrics(u).get("inferd:kv_leases_created_total", 0) for u in prefills}
                pulled = {u: replica_metrics(u) for u in decodes}
                for i in (0, 2, 3):  # one streaming client goes on: the decode pool (running <= 1) scales down under it
                    stops[i].set()
                wait_for(lambda: len(listed(decode_list)) == 1, 60, "the decode pool's scale-down")
                wait_for(lambda: pool_state("tiny-decode", "draining") == 0, 60, "the decode replica's drain")
            finally:
                for e in stops:
                    e.set()
                for f in futures:
                    f.result(timeout=150)
        assert all(n > 0 for n in leases.values()), leases  # the first decode replica took KV from the newcomer
        for d in pulled.values():
            assert d["inferd:remote_prefills_total"] > 0 and d["inferd:kv_transfer_blocks_total"] > 0, d
            assert d.get("inferd:kv_transfer_params_rejected_total", 0) == 0
        assert replica_metrics(proxy)["inferd:disagg_proxy_prefills_total"] >= len(statuses)
        peers = state / "tiny-prefill.kv-peers"
        # unlisted for the proxy first; admitted as a KV peer until its process has drained and exited
        wait_for(lambda: len(listed(prefill_list)) == 1, 60, "the prefill pool's scale-down")
        wait_for(lambda: len(listed(peers)) == 1, 60, "the drained prefill replica's exit")
        wait_for(lambda: pool_state("tiny-prefill", "draining") == 0, 10, "no prefill replica draining")
        assert statuses and set(statuses) == {200}, statuses
        assert httpx.post(f"{up.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        up.stop()
        if up.alive():
            up.kill()
        leftover = processes_naming(str(tmp_path))
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
    assert up.popen.returncode == 0, up.log_tail()
    assert not leftover, leftover
    for url in [proxy, *decodes, *prefills]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=1)
    summary = json.loads((state / "summary.json").read_text())
    assert summary["pools"] == {
        "tiny-prefill": {"model": "tiny", "role": "prefill"},
        "tiny-decode": {"model": "tiny", "role": "decode"},
    }
    assert all(h > 0 for h in summary["replica_hours"].values()) and summary["proxies"]["tiny"] == proxy
    scales = [(e["pool"], e["text"].split(":", 1)[0]) for e in summary["events"] if e["kind"] == "scale"]
    for pool in ("tiny-prefill", "tiny-decode"):
        assert (pool, "1 -> 2") in scales and (pool, "2 -> 1") in scales, scales
    log = up.log.read_text()
    assert "disaggregation proxy of tiny" in log and "tiny-prefill (prefill)" in log and "tiny-decode (decode)" in log


def test_replica_argv_of_the_two_roles_and_the_gateway_sends_the_model_to_its_proxy(tmp_path):
    from inferd.fleet.spec import parse_fleet
    from inferd.runtime.up import LocalFleet, UpOptions, replica_argv

    spec = parse_fleet(FLEET.format(model="gemma3-270m"))
    fleet = LocalFleet(spec, UpOptions(state_dir=tmp_path))
    front = fleet.fronts["tiny-prefill"]
    assert fleet.fronts["tiny-decode"] is front and fleet.proxies() == [front]
    assert len(fleet.env["INFERD_KV_SECRET"]) >= 32  # in the environment, not on a command line
    p, d = fleet.pools["tiny-prefill"], fleet.pools["tiny-decode"]
    pa = replica_argv(spec, p, 1000, fleet.opts, 1001, front)
    da = replica_argv(spec, d, 1002, fleet.opts, None, front)
    assert pa[pa.index("--role") + 1] == "prefill" and pa[pa.index("--kv-port") + 1] == "1001"
    assert da[da.index("--role") + 1] == "decode" and da[da.index("--kv-peers-file") + 1] == str(front.peers_file)
    assert not any("secret" in a for a in pa + da)
    assert {str(front.prefill_file), str(front.decode_file)} <= set(front.proxy_argv("python", "WARNING"))
    fleet._publish(d)  # no decode replica ready (and no proxy running): the gateway lists nothing
    assert listed(front.front_file) == []
    (pool,) = spec.gateway_config(fleet.gateway_endpoints()).pools
    assert pool.name == "tiny-decode" and pool.replicas_file == front.front_file
    fleet.client.close()


def test_a_prefill_replica_stops_once_its_leases_are_pulled_and_a_prefill_pool_at_zero_wakes_with_its_model(
    tmp_path, monkeypatch
):
    import inferd.runtime.up as up
    from inferd.autoscale.signals import Measured
    from inferd.fleet.spec import parse_fleet

    spec = parse_fleet(FLEET.format(model="gemma3-270m"))
    fleet = up.LocalFleet(spec, up.UpOptions(state_dir=tmp_path))
    out = {"n": 1.0}
    monkeypatch.setattr(up, "leases_active", lambda client, url: out["n"])
    prefill = up.ReplicaProc("tiny-prefill", 1, None, 0.0, tmp_path / "log", kv_port=2, state="draining", term_at=10.0)
    assert not fleet._leases_done(prefill, 11.0)  # a decode replica has still to pull one of its leases
    assert fleet._leases_done(prefill, 10.0 + up.LEASE_WAIT_S)  # ... but not for ever
    out["n"] = 0.0
    assert fleet._leases_done(prefill, 11.0)
    decode = up.ReplicaProc("tiny-decode", 3, None, 0.0, tmp_path / "log", state="draining", term_at=10.0)
    out["n"] = 5.0
    assert fleet._leases_done(decode, 10.0)  # a decode replica has no leases to wait for

    p, d = fleet.pools["tiny-prefill"], fleet.pools["tiny-decode"]
    d.last = Measured()
    assert fleet._gateway_share(d, 3.0) == 3.0  # the decode pool owns the gateway's queue
    assert fleet._gateway_share(p, 0.0) == 0.0  # no prefill replica (none started) and nothing for the model
    assert fleet._gateway_share(p, 3.0) == 1.0  # requests wait at the gateway for the model
    d.last = Measured(running=2.0)
    assert fleet._gateway_share(p, 0.0) == 1.0  # the model has requests: one waiting, enough to wake it
    fleet.client.close()
