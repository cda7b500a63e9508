"""The handoff's parts without an engine: signed parameters, the lease table, the authenticated channel,
the proxy's pool choice and cost model."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from inferd.disagg.leases import Lease, LeaseTable
from inferd.disagg.params import BadTransferParams, KVLayout, KVTransferParams, prompt_digest
from inferd.disagg.proxy import CostModel, Pool, _prefill_body
from inferd.disagg.transport import KVClient, KVServer, TransferError, checksums, gather, scatter

SECRET = b"k"
LAYOUT = KVLayout(2, 4, 1, 2, "float32")


def _params(**kw) -> KVTransferParams:
    base = dict(
        peer="127.0.0.1:5",
        epoch="e",
        lease_id="l",
        expires_at=time.time() + 30,
        num_tokens=5,
        prompt_hash=prompt_digest([1, 2, 3, 4, 5], None),
        block_ids=(3, 9),
        checksums=("ab", "cd"),
        layout=LAYOUT,
    )
    return KVTransferParams(**{**base, **kw})


def test_params_round_trip_and_refusals():
    body = _params().to_dict(SECRET)
    assert KVTransferParams.from_dict(body, SECRET, frozenset({"127.0.0.1:5"})) == _params(
        expires_at=body["expires_at"]
    )
    with pytest.raises(BadTransferParams, match="not signed") as e:
        KVTransferParams.from_dict(body, b"other", frozenset({"127.0.0.1:5"}))
    assert e.value.reason == "bad_signature"
    with pytest.raises(BadTransferParams, match="not a configured peer") as e:
        KVTransferParams.from_dict(body, SECRET, frozenset({"127.0.0.1:6"}))
    assert e.value.reason == "untrusted_peer"
    for broken in ({**body, "block_ids": [3]}, {**body, "num_tokens": -1}, {**body, "checksums": ["zz", "cd"]}):
        broken["signature"] = _params().to_dict(SECRET)["signature"]  # even re-signed wrongly: refused
        with pytest.raises(BadTransferParams):
            KVTransferParams.from_dict(broken, SECRET, frozenset({"127.0.0.1:5"}))
    with pytest.raises(BadTransferParams, match="malformed") as e:  # signed with the key but the wrong shape
        from inferd.disagg.params import sign

        bad = {**body, "block_ids": [3]}
        bad["signature"] = sign(bad, SECRET)
        KVTransferParams.from_dict(bad, SECRET, frozenset({"127.0.0.1:5"}))
    assert e.value.reason == "malformed"
    with pytest.raises(BadTransferParams):
        KVTransferParams.from_dict([1, 2], SECRET, frozenset())


def test_lease_table_open_ack_expire():
    table = LeaseTable(read_timeout=5)
    now = time.time()
    table.add(Lease("a", (1, 2), now + 1))
    table.add(Lease("b", (3,), now + 1))
    assert table.open("a", now) == (1, 2)
    # "a" is held open by a reader until now + 5: only "b" expires at now + 2, and "a" opens no more
    assert [x.lease_id for x in table.expired(now + 2)] == ["b"]
    assert len(table) == 1 and table.open("a", now + 2) is None
    assert [x.lease_id for x in table.expired(now + 6)] == ["a"]
    assert not table.ack("a")  # gone: an acknowledgement after expiry reports it
    table.add(Lease("c", (4,), now + 10))
    assert table.ack("c") and [x.lease_id for x in table.take_released()] == ["c"] and len(table) == 0


def _caches(num_blocks: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, 4, 1, 2)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]


def test_block_bytes_round_trip():
    src, dst = _caches(), _caches()
    scatter(dst, [5, 0], gather(src, [1, 2]))
    assert checksums(dst, [5, 0]) == checksums(src, [1, 2]) != checksums(src, [2, 1])
    with pytest.raises(TransferError):
        scatter(dst, [5], gather(src, [1, 2]))


def test_channel_serves_leases_and_ignores_strangers():
    kv = _caches()
    table = LeaseTable()
    table.add(Lease("l1", (2, 6), time.time() + 30))
    server = KVServer("127.0.0.1", 0, SECRET, "ep", table, lambda: kv, None)
    server.start()
    peer = f"127.0.0.1:{server.port}"
    try:
        client = KVClient(SECRET, timeout=5)
        assert client.pull(peer, "ep", "l1", [1]) == gather(kv, [6])
        with pytest.raises(TransferError, match="another epoch"):
            client.pull(peer, "old-epoch", "l1", [0])
        with pytest.raises(TransferError, match="bad block indices"):
            client.pull(peer, "ep", "l1", [2])
        with pytest.raises(TransferError):  # a client without the secret gets no answer at all
            KVClient(b"wrong", timeout=5).pull(peer, "ep", "l1", [0])
        with socket.create_connection(("127.0.0.1", server.port)) as s:  # garbage: dropped
            s.sendall(b"\x00\x00\x00\x05\x00\x00\x00\x00hello")
            assert s.recv(10) == b""
        assert server.stats.rejected == 2
        assert client.ack(peer, "ep", "l1") and not client.ack(peer, "ep", "l1")
        with pytest.raises(TransferError, match="unknown or expired"):
            client.pull(peer, "ep", "l1", [0])
    finally:
        server.close()


def test_pool_picks_least_loaded():
    pool = Pool(["http://a", "http://b/"])
    first = pool.pick()
    first.in_flight += 1
    second = pool.pick()
    assert second is not first and second.url in ("http://a", "http://b")
    second.in_flight += 2
    assert pool.pick() is first


def test_cost_model_prefers_local_only_when_measured_cheaper():
    cost = CostModel()
    assert not cost.prefer_local(100, 0)  # nothing measured: go remote, which measures
    cost.remote_prefill_per_token.add(0.001)
    cost.local_prefill_per_token.add(0.002)
    cost.handoff_overhead.add(0.05)
    assert not cost.prefer_local(1000, 0)  # 2.0 s local vs 1.05 s remote
    assert cost.prefer_local(1000, 3)  # a queue of 3 prefills: 4.05 s remote
    assert cost.prefer_local(10, 0)  # short prompts: the handoff costs more than the prefill


def test_prefill_body_asks_for_one_token_and_a_lease():
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 3, "logprobs": 2}
    out = _prefill_body(body)
    assert out["max_tokens"] == 1 and out["n"] == 1 and not out["stream"] and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True} and out["logprobs"] is None
    chat = _prefill_body({"messages": [], "max_completion_tokens": 50, "logprobs": True, "top_logprobs": 3})
    assert chat["max_completion_tokens"] == 1 and chat["logprobs"] is False and chat["top_logprobs"] is None


def test_peers_admit_listed_channels_and_the_addresses_a_listed_name_resolves_to():
    from inferd.disagg.params import Peers

    answers = {"prefill.ns.svc": frozenset({"10.0.0.5", "10.0.0.6"})}
    calls = []

    def resolve(host):
        calls.append(host)
        return answers.get(host, frozenset())

    peers = Peers(["127.0.0.1:9100", "prefill.ns.svc:9100"], ttl_s=60, resolve=resolve)
    assert "127.0.0.1:9100" in peers and "10.0.0.5:9100" in peers and "10.0.0.6:9100" in peers
    assert "10.0.0.5:9101" not in peers  # the port must match too
    assert "10.0.0.7:9100" not in peers and "evil.example:9100" not in peers and 42 not in peers
    assert calls.count("prefill.ns.svc") == 1  # resolved once within the ttl
    answers["prefill.ns.svc"] = frozenset()
    assert "10.0.0.5:9100" in peers  # still cached
    assert not Peers([]) and Peers(["a:1"])
