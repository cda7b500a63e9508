"""The KV connector in one process: a prefill engine and a decode engine hand K/V over through real
shared memory and a real TCP channel on loopback; outputs are compared with a plain engine's."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from inferd.config import make_engine_config
from inferd.disagg.params import sign
from inferd.engine.engine import Engine
from inferd.engine.kv_connector import DisaggConnector, DisaggSettings
from inferd.errors import InvalidRequestError
from inferd.sampling import SamplingParams

SECRET = b"test-secret"
BS = 16


def _engine(folder, num_blocks=64) -> Engine:
    config = make_engine_config(
        str(folder), max_model_len=256, num_blocks=num_blocks, block_size=BS, attention_backend="torch"
    )
    return Engine(config)


def _run(engine: Engine, rid: str, prompt, params: SamplingParams):
    engine.add_request(rid, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


class Pair:
    """A prefill engine, a decode engine trusting it, and a plain engine for reference."""

    def __init__(self, prefill: Engine, decode: Engine, both: Engine):
        self.prefill, self.decode, self.both = prefill, decode, both
        self.pc, self.dc = prefill.kv_connector, decode.kv_connector
        self._ids = 0

    def rid(self) -> str:
        self._ids += 1
        return f"{id(self)}-{self._ids}"

    def lease(self, prompt) -> dict:
        params = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        out = _run(self.prefill, self.rid(), prompt, params)
        assert out.kv_transfer_params is not None
        return out.kv_transfer_params

    def decode_with(self, prompt, kv: dict | None, **sampling):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, kv_transfer_params=kv, **sampling)
        return _run(self.decode, self.rid(), prompt, params).outputs[0].token_ids

    def reference(self, prompt, **sampling):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **sampling)
        return _run(self.both, self.rid(), prompt, params).outputs[0].token_ids

    def settle(self) -> None:
        """Let the acknowledgements arrive (they travel on the decode's acker thread), then free."""
        deadline = time.monotonic() + 5
        while len(self.pc.leases) and time.monotonic() < deadline:
            time.sleep(0.01)
            self.prefill.housekeeping()

    def check_idle(self) -> None:
        self.settle()
        self.prefill.check_idle()
        self.decode.check_idle()
        self.both.check_idle()


def _prefill(folder) -> Engine:
    engine = _engine(folder)
    engine.attach_kv_connector(DisaggConnector(DisaggSettings("prefill", SECRET), BS))
    return engine


def _decode(folder, prefill: Engine, transport: str) -> Engine:
    engine = _engine(folder)
    peers = frozenset({prefill.kv_connector.peer})
    engine.attach_kv_connector(DisaggConnector(DisaggSettings("decode", SECRET, peers=peers, transport=transport), BS))
    return engine


@pytest.fixture(scope="module")
def engines(tiny_models):
    """One prefill engine (its cache in shared memory), a decode engine per transport, a plain engine."""
    folder = tiny_models["llama"]
    prefill = _prefill(folder)
    out = {"prefill": prefill, "both": _engine(folder)}
    out.update({t: _decode(folder, prefill, t) for t in ("shm", "tcp")})
    yield out
    for engine in out.values():
        if engine.kv_connector is not None:
            engine.kv_connector.close()


@pytest.fixture(params=["shm", "tcp"])
def pair(request, engines):
    pair = Pair(engines["prefill"], engines[request.param], engines["both"])
    pair.decode.kv.reset_prefix_cache()  # each test starts without prefix hits on the decode side
    return pair


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _stats(connector) -> dict:
    s = connector.stats
    flat = {k: v for k, v in vars(s).items() if isinstance(v, int)}
    flat.update({f"local.{k}": v for k, v in s.local_prefills.items()})
    flat.update({f"transfers.{k}": v for k, v in s.transfers.items()})
    flat.update({f"rejected.{k}": v for k, v in s.params_rejected.items()})
    return flat


def _prompt(n: int, offset: int = 0) -> list[int]:
    """n token ids; prompts of different offsets share no prefix."""
    rng = random.Random(offset)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_greedy_equal_for_many_lengths(pair: Pair):
    """Partial blocks, exact blocks, one token: the decode side's tokens are a plain engine's."""
    before, lengths = _stats(pair.dc), [1, 15, 16, 17, 40, 100]
    for n in lengths:
        prompt = _prompt(n, offset=n)  # no shared prefixes: every block is pulled
        assert pair.decode_with(prompt, pair.lease(prompt)) == pair.reference(prompt), n
    d = _delta(before, _stats(pair.dc))
    assert d[f"transfers.{pair.dc.s.transport}"] == 5  # the one-token prompt needs no K/V
    assert d["local.nothing_to_pull"] == 1
    assert d["blocks_transferred"] == sum(-(-(n - 1) // BS) for n in lengths)
    assert "checksum_failures" not in d and "transfer_failures" not in d
    pair.check_idle()


def test_prefix_hits_pull_fewer_blocks(pair: Pair):
    before = _stats(pair.dc)
    shared = _prompt(48, offset=1)
    first = shared + _prompt(20, offset=2)
    assert pair.decode_with(first, pair.lease(first)) == pair.reference(first)
    assert _delta(before, _stats(pair.dc))["blocks_transferred"] == 5  # 68 tokens, all but the last: 5 blocks
    second = shared + _prompt(30, offset=3)  # its first 3 blocks are in the decode side's prefix cache
    assert pair.decode_with(second, pair.lease(second)) == pair.reference(second)
    d = _delta(before, _stats(pair.dc))
    assert d["blocks_prefix_hit"] == 3
    assert d["blocks_transferred"] == 5 + 2  # 78 tokens, all but the last: 5 blocks, minus the 3 it had
    pair.check_idle()


def test_sampling_parameters_carry_over(pair: Pair):
    prompt = _prompt(40, offset=4)
    sampling = dict(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=3, stop_token_ids=[7])
    assert pair.decode_with(prompt, pair.lease(prompt), **sampling) == pair.reference(prompt, **sampling)
    seeded = dict(temperature=1.0, seed=42, top_k=20)
    kv = pair.lease(prompt)
    got = _run(pair.decode, pair.rid(), prompt, SamplingParams(max_tokens=10, kv_transfer_params=kv, **seeded))
    want = _run(pair.both, pair.rid(), prompt, SamplingParams(max_tokens=10, **seeded))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    pair.check_idle()


def test_untrusted_params_are_prefilled_locally_before_any_block(pair: Pair, caplog):
    """Forged, altered, malformed, foreign or another prompt's parameters: the request is answered as one
    without them (a local prefill, the reference's tokens), nothing of the lease is read, each is counted by
    reason, and the warning comes once per claimed peer and reason, not per request."""
    prompt = _prompt(40, offset=5)
    kv = pair.lease(prompt)
    unsigned = [
        {**kv, "lease_id": "0" * 32},  # changed after signing
        {**kv, "peer": "10.0.0.1:9"},  # changed after signing
        {k: v for k, v in kv.items() if k != "signature"},
        {"do_remote_decode": True},
        {**kv, "block_ids": "nope"},
        {},
        {**kv, "signature": "0" * 64},
    ]
    pair.dc._logged.clear()  # noqa: SLF001  (the decode engines are the module's: count this test's warnings)
    before = _stats(pair.dc)
    with caplog.at_level("WARNING", logger="inferd.engine.kv_connector"):
        for params in unsigned:
            assert pair.decode_with(prompt, params) == pair.reference(prompt)
        assert pair.decode_with(_prompt(40, offset=6), kv) == pair.reference(_prompt(40, offset=6))  # other prompt
        foreign = {**kv, "signature": sign(kv, b"another-secret")}  # what a decode with another secret sees
        for _ in range(2):
            assert pair.decode_with(prompt, foreign) == pair.reference(prompt)
    n_unsigned = len(unsigned) + 2
    assert _delta(before, _stats(pair.dc)) == {
        "rejected.bad_signature": n_unsigned,
        "rejected.other_prompt": 1,
        "local.params_rejected": n_unsigned + 1,
    }
    warnings = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    peers = {kv["peer"], "10.0.0.1:9", "(none)"}
    assert len(warnings) == len(peers) + 1, warnings  # bad_signature per claimed peer, other_prompt once
    assert sum("INFERD_KV_SECRET" in w for w in warnings) == len(peers)
    # a peer outside the allow-list, correctly signed: prefilled locally too, and no 400
    other = DisaggConnector(DisaggSettings("decode", SECRET, peers=frozenset({"127.0.0.1:1"})), BS)
    other.add_request("x", kv, prompt, None, 1)
    assert other.stats.params_rejected == {"untrusted_peer": 1} and not other._incoming  # noqa: SLF001
    # the genuine lease still works after all that
    assert pair.decode_with(prompt, kv) == pair.reference(prompt)
    pair.check_idle()


def test_a_prefill_instance_refuses_what_is_not_a_prefill_request(pair: Pair):
    before = _stats(pair.pc)
    with pytest.raises(InvalidRequestError, match="do_remote_decode"):
        pair.prefill.add_request(pair.rid(), _prompt(8), SamplingParams(kv_transfer_params={"peer": "x"}))
    with pytest.raises(InvalidRequestError, match="n=1"):
        params = SamplingParams(n=2, temperature=1.0, kv_transfer_params={"do_remote_decode": True})
        pair.prefill.add_request(pair.rid(), _prompt(8), params)
    assert _delta(before, _stats(pair.pc)) == {"rejected.not_a_prefill_request": 1, "rejected.n_above_1": 1}
    assert not pair.prefill.has_unfinished_requests()


def test_used_lease_is_never_read_again(pair: Pair):
    """A replayed lease (already acknowledged, its blocks freed and reused): recomputed locally."""
    prompt = _prompt(50, offset=7)
    kv = pair.lease(prompt)
    assert pair.decode_with(prompt, kv) == pair.reference(prompt)
    for i in range(3):  # reuse the freed blocks for other prompts
        other = _prompt(60, offset=70 + i)
        pair.decode_with(other, pair.lease(other))
    pair.settle()
    pair.decode.kv.reset_prefix_cache()
    before = _stats(pair.dc)
    assert pair.decode_with(prompt, kv) == pair.reference(prompt)
    assert _delta(before, _stats(pair.dc)) == {"transfer_failures": 1, "local.transfer_failed": 1}
    pair.check_idle()


def test_checksum_mismatch_recomputes(pair: Pair):
    prompt = _prompt(40, offset=8)
    kv = pair.lease(prompt)
    k, _ = pair.pc.kv_caches[0]
    k[kv["block_ids"][1]] += 1.0  # the pinned bytes change under the lease
    before = _stats(pair.dc)
    assert pair.decode_with(prompt, kv) == pair.reference(prompt)
    d = _delta(before, _stats(pair.dc))
    assert d["checksum_failures"] == 1 and d["local.transfer_failed"] == 1 and "remote_prefills" not in d
    pair.check_idle()


def test_lease_expiry_frees_blocks_and_decode_recomputes(pair: Pair):
    pair.settle()
    ttl, pair.pc.s.lease_ttl = pair.pc.s.lease_ttl, 0.3
    try:
        prompt = _prompt(40, offset=9)
        kv = pair.lease(prompt)
    finally:
        pair.pc.s.lease_ttl = ttl
    before_p, before_d = _stats(pair.pc), _stats(pair.dc)
    assert pair.prefill.kv.usage > 0
    time.sleep(0.4)
    pair.prefill.housekeeping()  # the engine loop's timer
    assert _delta(before_p, _stats(pair.pc))["lease_expiries"] == 1
    assert pair.pc.stats.leases_active == 0 and pair.pc.stats.blocks_leased == 0
    assert pair.prefill.kv.usage == 0
    assert pair.decode_with(prompt, kv) == pair.reference(prompt)
    assert _delta(before_d, _stats(pair.dc)) == {"local.lease_expired": 1}
    pair.check_idle()


def test_sliding_window_model(tiny_models):
    folder = tiny_models["gemma3"]
    prefill = _prefill(folder)
    pair = Pair(prefill, _decode(folder, prefill, "auto"), _engine(folder))
    try:
        for n in [10, 57, 90]:  # windows of 24 tokens
            prompt = _prompt(n, offset=n)
            assert pair.decode_with(prompt, pair.lease(prompt)) == pair.reference(prompt), n
        assert pair.dc.stats.remote_prefills == 3 and pair.dc.stats.transfers == {"shm": 3}
        pair.check_idle()
    finally:
        pair.pc.close()
        pair.dc.close()


def test_both_role_refuses_transfer_params(engines):
    engine = engines["both"]
    with pytest.raises(InvalidRequestError, match="disaggregated"):
        engine.add_request("a", [5, 6, 7], SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    engine.check_idle()


def _run_all(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_preemption_on_the_decode_side(engines):
    """Three pulled requests outgrow a small decode cache: preempted ones are recomputed locally, same tokens."""
    folder = engines["both"].model_folder
    prefill = engines["prefill"]
    decode = _engine(folder, num_blocks=16)
    peers = frozenset({prefill.kv_connector.peer})
    decode.attach_kv_connector(DisaggConnector(DisaggSettings("decode", SECRET, peers=peers), BS))
    pair = Pair(prefill, decode, engines["both"])
    try:
        prompts = [_prompt(100, offset=500 + i) for i in range(3)]  # 7 blocks each, 9 once 40 tokens are out
        leases = [pair.lease(p) for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        pulled = {
            f"pre{i}": (p, replace(params, kv_transfer_params=kv))
            for i, (p, kv) in enumerate(zip(prompts, leases, strict=True))
        }
        outs = _run_all(decode, pulled)
        assert decode.scheduler.num_preemptions > 0
        assert pair.dc.stats.remote_prefills == 3
        assert outs == _run_all(pair.both, {f"pre{i}": (p, params) for i, p in enumerate(prompts)})
        pair.check_idle()
    finally:
        decode.kv_connector.close()
