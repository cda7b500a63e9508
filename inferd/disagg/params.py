"""The transfer parameters of one KV handoff, as they travel in `kv_transfer_params` (vLLM's field name).

A prefill instance answers a request that asked for `{"do_remote_decode": true}` with a lease on the
blocks holding its prompt's K/V: which instance (`peer`, `epoch`), which lease, until when, which blocks,
a checksum per block and a hash of the prompt the blocks belong to. It signs all of it with HMAC-SHA256
under the secret it shares with the decode instances. The decode side uses no lease that is malformed,
unsigned or signed with another key, or that names a peer outside its allow-list: it decides so before it
touches a block or opens a connection, so a client can neither forge a lease nor point the decode side at
another host. Such a request is prefilled on the decode side instead (inferd.engine.kv_connector); the
reason travels in `BadTransferParams.reason`, a label of `inferd:kv_transfer_params_rejected`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import time
from collections.abc import Container, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from inferd.measure.model import kv_bytes_per_token

VERSION = 1
_HEX = set("0123456789abcdef")


# why kv_transfer_params were not used (the `reason` label of inferd:kv_transfer_params_rejected)
UNSIGNED = "bad_signature"  # no signature, or not this instance's secret's: forged, altered, another secret
MALFORMED = "malformed"  # signed under the secret, but not a lease this version reads
UNTRUSTED_PEER = "untrusted_peer"  # signed, naming a KV channel outside the allow-list
OTHER_PROMPT = "other_prompt"  # signed for another prompt (or cache_salt)


class BadTransferParams(ValueError):
    """kv_transfer_params that cannot be used: malformed, forged, or from an untrusted peer."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """What must match for blocks to be copied as bytes: shape of a block in every layer, and the dtype."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}.get(self.dtype, 4)
        return self.block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, elem)


@dataclass(frozen=True)
class KVTransferParams:
    """A signed lease on a prefill instance's blocks."""

    peer: str  # host:port of the prefill instance's KV transfer channel
    epoch: str  # the prefill process's random id: a restarted process honours no old lease
    lease_id: str
    expires_at: float  # unix time; after it the prefill side may have freed the blocks
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    prompt_hash: str  # prompt_digest of the prompt and cache salt the blocks were computed for
    block_ids: tuple[int, ...]  # on the prefill instance, in order
    checksums: tuple[str, ...]  # one per block, of its bytes in every layer (transport.block_checksum)
    layout: KVLayout
    shm: str | None = None  # shared memory segment with the prefill's KV tensors, when it offers one
    host: str | None = None  # the prefill's host identity: shared memory is only tried on the same host
    version: int = VERSION

    def to_dict(self, secret: bytes) -> dict[str, Any]:
        body = asdict(self)
        body["block_ids"] = list(self.block_ids)
        body["checksums"] = list(self.checksums)
        body["signature"] = sign(body, secret)
        return body

    @classmethod
    def from_dict(cls, body: Any, secret: bytes, allowed_peers: Container[str]) -> KVTransferParams:
        """Check and parse what a client sent; raises BadTransferParams with the reason."""
        if not isinstance(body, dict):
            raise BadTransferParams("kv_transfer_params must be an object", MALFORMED)
        signature = body.get("signature")
        if not isinstance(signature, str) or not hmac.compare_digest(signature, sign(body, secret)):
            raise BadTransferParams("kv_transfer_params are not signed by a trusted prefill instance", UNSIGNED)
        try:
            params = cls._parse(body)
        except (KeyError, TypeError, ValueError) as e:
            raise BadTransferParams(f"kv_transfer_params are malformed: {e}", MALFORMED) from None
        if params.peer not in allowed_peers:
            raise BadTransferParams(
                f"kv_transfer_params name peer {params.peer!r}, which is not a configured peer", UNTRUSTED_PEER
            )
        return params

    @classmethod
    def _parse(cls, b: dict) -> KVTransferParams:
        if b.get("version") != VERSION:
            raise ValueError(f"version {b.get('version')!r}, expected {VERSION}")
        block_ids = tuple(_int(x, "block_ids") for x in _list(b["block_ids"], "block_ids"))
        checksums = tuple(_hex(x, "checksums") for x in _list(b["checksums"], "checksums"))
        layout = b["layout"]
        if not isinstance(layout, dict):
            raise TypeError("layout must be an object")
        params = cls(
            peer=_str(b["peer"], "peer"),
            epoch=_str(b["epoch"], "epoch"),
            lease_id=_str(b["lease_id"], "lease_id"),
            expires_at=float(_num(b["expires_at"], "expires_at")),
            num_tokens=_int(b["num_tokens"], "num_tokens"),
            prompt_hash=_hex(b["prompt_hash"], "prompt_hash"),
            block_ids=block_ids,
            checksums=checksums,
            layout=KVLayout(
                num_layers=_int(layout["num_layers"], "layout.num_layers"),
                block_size=_int(layout["block_size"], "layout.block_size"),
                num_kv_heads=_int(layout["num_kv_heads"], "layout.num_kv_heads"),
                head_dim=_int(layout["head_dim"], "layout.head_dim"),
                dtype=_str(layout["dtype"], "layout.dtype"),
            ),
            shm=None if b.get("shm") is None else _str(b["shm"], "shm"),
            host=None if b.get("host") is None else _str(b["host"], "host"),
        )
        if len(block_ids) != len(checksums):
            raise ValueError("block_ids and checksums differ in length")
        if params.layout.block_size < 1 or len(block_ids) != -(-params.num_tokens // params.layout.block_size):
            raise ValueError("block_ids do not cover num_tokens")
        return params


def sign(body: dict, secret: bytes) -> str:
    """HMAC-SHA256 of the canonical JSON of `body` without its signature."""
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    try:
        text = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return ""
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def prompt_digest(token_ids: list[int], cache_salt: str | None) -> str:
    """What ties a lease to its prompt: the decode side refuses blocks computed for another one."""
    h = hashlib.sha256()
    h.update(json.dumps([cache_salt, token_ids], separators=(",", ":")).encode())
    return h.hexdigest()


def _str(x: Any, name: str) -> str:
    if not isinstance(x, str) or not x or len(x) > 256:
        raise TypeError(f"{name} must be a non-empty string")
    return x


def _int(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise TypeError(f"{name} must be a non-negative integer")
    return x


def _num(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number")
    return x


def _hex(x: Any, name: str) -> str:
    if not isinstance(x, str) or not x or len(x) > 128 or not set(x) <= _HEX:
        raise TypeError(f"{name} must be hex strings")
    return x


def _list(x: Any, name: str) -> list:
    if not isinstance(x, list):
        raise TypeError(f"{name} must be a list")
    return x


class Peers:
    """The decode side's allow-list of prefill KV channels, `host:port` each.

    A channel is admitted when it is listed as written, or when its host is an address that a listed DNS
    name resolves to on the same port: on Kubernetes the prefill pool's headless Service names every ready
    pod, and each pod advertises its own IP (`--kv-advertise-host $(POD_IP)`). Names are resolved again at
    most every `ttl_s`; a name that does not resolve admits nothing.

    With `file`, the entries written there (one a line, `#` comments) are admitted too, read again whenever
    the file changes (checked on every lookup: one `stat`): `inferd up` lists a prefill replica's channel
    there before the replica starts and removes it once the process is gone, so a decode replica accepts
    KV from prefill replicas started after it. A missing file admits nothing.
    """

    def __init__(self, entries: Iterable[str], ttl_s: float = 5.0, resolve=None, file: str | Path | None = None):
        self.static = frozenset(entries)
        self.file = None if file is None else Path(file)
        self.ttl_s = ttl_s
        self._resolve = resolve or _addresses
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}
        self._listed: tuple[tuple | None, frozenset[str]] = (None, frozenset())  # (file's stat key, its entries)

    @property
    def entries(self) -> frozenset[str]:
        return self.static | self._from_file()

    def _from_file(self) -> frozenset[str]:
        if self.file is None:
            return frozenset()
        try:
            st = self.file.stat()
        except OSError:
            return frozenset()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._listed[0] != key:
            try:
                lines = self.file.read_text().splitlines()
            except OSError:
                return frozenset()
            entries = frozenset(x.split("#", 1)[0].strip() for x in lines) - {""}
            self._listed = (key, entries)  # one assignment: threads reading it see the old or the new pair
        return self._listed[1]

    def __bool__(self) -> bool:
        return bool(self.static) or self.file is not None

    def __contains__(self, peer: object) -> bool:
        if not isinstance(peer, str):
            return False
        entries = self.entries
        if peer in entries:
            return True
        host, _, port = peer.rpartition(":")
        return any(
            e_port == port and host in self._addresses_of(e_host)
            for e_host, _, e_port in (e.rpartition(":") for e in entries)
        )

    def _addresses_of(self, host: str) -> frozenset[str]:
        now = time.monotonic()
        hit = self._cache.get(host)
        if hit is None or now - hit[0] > self.ttl_s:
            hit = (now, self._resolve(host))
            self._cache[host] = hit
        return hit[1]


def _addresses(host: str) -> frozenset[str]:
    try:
        return frozenset(info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except OSError:
        return frozenset()
