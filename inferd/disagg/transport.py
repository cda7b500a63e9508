"""Moving KV blocks between processes: bytes out of and into the paged cache, shared memory, and TCP.

The paged cache is one (K, V) pair of tensors per layer, each [num_blocks, block_size, kv_heads, head_dim].
A block's *bytes* are its K and V rows in every layer, layer by layer; its checksum is a BLAKE2b of them,
so the decode side checks what landed in its own destination blocks against what the prefill side pinned.

Two ways to move them:

- **Shared memory** (one host): the prefill process keeps its whole cache in a named
  `multiprocessing.shared_memory` segment (`SharedKV.create`); the decode process maps it
  (`SharedKV.attach`) and copies the leased blocks straight into its destination blocks, one tensor
  copy per layer, no serialisation.
- **TCP** (any host): the prefill process serves its leases on an authenticated channel (`KVServer`);
  the decode process asks for the blocks it lacks (`KVClient.pull`) and scatters the bytes into its
  destination blocks.

Both go through the TCP channel for the lease itself: `open` (is it still live? hold it while I copy),
`pull` (open and send the bytes) and `ack` (done, free it). Every message carries an HMAC-SHA256 of its
header under the shared secret and a timestamp; a message without a valid one is dropped unanswered.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import torch

from inferd.disagg.leases import LeaseTable
from inferd.disagg.params import KVLayout

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_FRAME = struct.Struct(">II")  # header length, payload length
MAX_HEADER = 1 << 20
MAX_SKEW = 60.0  # seconds a message's timestamp may differ from the receiver's clock


class TransferError(Exception):
    """A pull that did not deliver: the lease is gone, the peer is down, the bytes do not match."""


# -- block bytes -------------------------------------------------------------------------------------
def layout_of(kv: KVCaches) -> KVLayout:
    k = kv[0][0]
    return KVLayout(len(kv), k.shape[1], k.shape[2], k.shape[3], str(k.dtype).removeprefix("torch."))


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as 32-bit words along its last dimension where they split evenly (torch's CPU index ops move
    bytes one at a time, about 6x slower on a block of K/V), else as bytes. Any dtype, fp8 included (torch's CPU
    index ops have no fp8 kernels): a copy through this view copies the bytes as they are."""
    b = t.view(torch.uint8)
    if b.shape[-1] % 4 == 0 and b.storage_offset() % 4 == 0:
        return b.view(torch.int32)
    return b


def _rows(kv: KVCaches, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Per layer, K then V of the given blocks as [m, block bytes] uint8 tensors on the CPU."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv[0][0].device)
    out = []
    for k, v in kv:
        for t in (k, v):
            rows = as_words(t).index_select(0, idx).contiguous().view(torch.uint8)
            out.append(rows.reshape(len(block_ids), -1).cpu())
    return out


def checksums(kv: KVCaches, block_ids: Sequence[int]) -> list[str]:
    """One BLAKE2b (128-bit) per block over its bytes in every layer."""
    if not block_ids:
        return []
    rows = [r.numpy() for r in _rows(kv, block_ids)]
    out = []
    for i in range(len(block_ids)):
        h = hashlib.blake2b(digest_size=16)
        for r in rows:
            h.update(r[i].data)
        out.append(h.hexdigest())
    return out


def gather(kv: KVCaches, block_ids: Sequence[int]) -> bytes:
    """The blocks' bytes, layer-major: layer 0 K rows, layer 0 V rows, layer 1 K rows, ..."""
    return b"".join(r.numpy().tobytes() for r in _rows(kv, block_ids))


def scatter(kv: KVCaches, block_ids: Sequence[int], payload: bytes | bytearray | memoryview) -> None:
    """Write `gather`'s bytes into the given blocks."""
    k0 = kv[0][0]
    m = len(block_ids)
    part = m * k0[0].numel() * k0.element_size()
    if len(payload) != part * 2 * len(kv):
        raise TransferError(f"payload has {len(payload)} bytes, expected {part * 2 * len(kv)}")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=k0.device)
    for i, t in enumerate(t for pair in kv for t in pair):
        dst = t.view(torch.uint8)  # as bytes: torch's CPU index_copy_ has no fp8 kernel
        rows = data[i * part : (i + 1) * part].reshape(m, *dst.shape[1:])
        dst.index_copy_(0, idx, rows.to(t.device))


def copy_blocks(src: KVCaches, src_ids: Sequence[int], dst: KVCaches, dst_ids: Sequence[int]) -> None:
    """Block copy between two caches of the same layout (shared memory -> own cache)."""
    s = torch.tensor(list(src_ids), dtype=torch.long, device=src[0][0].device)
    d = torch.tensor(list(dst_ids), dtype=torch.long, device=dst[0][0].device)
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for a, b in ((sk, dk), (sv, dv)):
            to, fro = as_words(b), as_words(a)
            if to.dtype != fro.dtype:  # one side's rows do not split into words: both as bytes
                to, fro = b.view(torch.uint8), a.view(torch.uint8)
            to.index_copy_(0, d, fro.index_select(0, s).to(b.device))


def host_identity() -> str:
    """This machine, as far as shared memory is concerned: hostname plus boot id."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


# -- shared memory -----------------------------------------------------------------------------------
_CREATED_HERE: set[str] = set()  # segments this process created (and its resource tracker owns)


class SharedKV:
    """A paged KV cache living in one named shared memory segment: [layers, 2, blocks, bs, heads, dim]."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: KVLayout, num_blocks: int, owner: bool):
        self.shm = shm
        self.name = shm.name
        self.num_blocks = num_blocks
        self.owner = owner
        dtype = getattr(torch, layout.dtype)
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        n = 1
        for s in shape:
            n *= s
        flat = torch.frombuffer(shm.buf, dtype=dtype, count=n)
        t = flat.view(shape)
        self.kv: KVCaches = [(t[i, 0], t[i, 1]) for i in range(layout.num_layers)]

    @staticmethod
    def _size(layout: KVLayout, num_blocks: int) -> int:
        return layout.block_bytes * num_blocks

    @classmethod
    def create(cls, name: str, layout: KVLayout, num_blocks: int) -> SharedKV:
        shm = shared_memory.SharedMemory(name=name, create=True, size=cls._size(layout, num_blocks))
        _CREATED_HERE.add(shm.name)
        return cls(shm, layout, num_blocks, owner=True)

    @classmethod
    def attach(cls, name: str, layout: KVLayout, num_blocks: int) -> SharedKV:
        shm = shared_memory.SharedMemory(name=name)
        # Python 3.11 registers an attached segment with the resource tracker, which would unlink it when
        # this process exits: the segment belongs to the prefill process
        if shm.name not in _CREATED_HERE:
            with contextlib.suppress(Exception):
                resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        if shm.size < cls._size(layout, num_blocks):
            shm.close()
            raise TransferError(f"shared memory segment {name} is smaller than its KV cache")
        return cls(shm, layout, num_blocks, owner=False)

    def close(self) -> None:
        self.kv = []
        with contextlib.suppress(Exception):
            self.shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


# -- the authenticated channel -----------------------------------------------------------------------
def _mac(header: dict, secret: bytes) -> str:
    body = {k: v for k, v in header.items() if k != "mac"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, header: dict, secret: bytes, payload: bytes = b"") -> None:
    header = {**header, "ts": time.time()}
    header["mac"] = _mac(header, secret)
    raw = json.dumps(header).encode()
    sock.sendall(_FRAME.pack(len(raw), len(payload)) + raw)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError("the connection closed mid-message")
        got += k
    return buf


def _recv(sock: socket.socket, secret: bytes, max_payload: int) -> tuple[dict, bytearray]:
    hlen, plen = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if hlen > MAX_HEADER or plen > max_payload:
        raise TransferError("message too large")
    try:
        header = json.loads(_recv_exact(sock, hlen))
    except ValueError:
        raise TransferError("malformed message") from None
    mac = header.get("mac") if isinstance(header, dict) else None
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(header, secret)):
        raise TransferError("message not signed with the shared secret")
    ts = header.get("ts")
    if not isinstance(ts, (int, float)) or abs(time.time() - ts) > MAX_SKEW:
        raise TransferError("message timestamp out of range")
    payload = _recv_exact(sock, plen) if plen else bytearray()
    return header, payload


@dataclass
class ServerStats:
    bytes_served: int = 0
    blocks_served: int = 0
    rejected: int = 0  # messages dropped for a bad signature or shape


class KVServer:
    """The prefill side of the channel: opens, serves and acknowledges leases from `table`."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        epoch: str,
        table: LeaseTable,
        kv: Callable[[], KVCaches],
        shm: SharedKV | None,
    ):
        self.secret, self.epoch, self.table, self.kv, self.shm = secret, epoch, table, kv, shm
        self.stats = ServerStats()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="inferd-kv-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(30)
        try:
            header, _ = _recv(sock, self.secret, 0)
        except (TransferError, OSError, struct.error) as e:
            self.stats.rejected += 1
            logger.warning("kv channel: dropped a message: %s", e)
            return
        try:
            reply, payload = self._answer(header)
            _send(sock, reply, self.secret, payload)
        except OSError as e:
            logger.info("kv channel: reply failed: %s", e)

    def _answer(self, h: dict) -> tuple[dict, bytes]:
        op, lease_id = h.get("op"), h.get("lease_id")
        if h.get("epoch") != self.epoch or not isinstance(lease_id, str):
            return {"ok": False, "error": "unknown lease (another epoch of this instance)"}, b""
        if op == "ack":
            return {"ok": self.table.ack(lease_id)}, b""
        block_ids = self.table.open(lease_id)
        if block_ids is None:
            return {"ok": False, "error": "unknown or expired lease"}, b""
        if op == "open":
            shm = {"shm": self.shm.name, "num_blocks": self.shm.num_blocks} if self.shm else {}
            return {"ok": True, "block_ids": list(block_ids), **shm}, b""
        if op == "pull":
            indices = h.get("indices")
            if not isinstance(indices, list) or not all(
                isinstance(i, int) and 0 <= i < len(block_ids) for i in indices
            ):
                return {"ok": False, "error": "bad block indices"}, b""
            payload = gather(self.kv(), [block_ids[i] for i in indices])
            self.stats.bytes_served += len(payload)
            self.stats.blocks_served += len(indices)
            return {"ok": True}, payload
        return {"ok": False, "error": f"unknown op {op!r}"}, b""


class KVClient:
    """The decode side of the channel."""

    def __init__(self, secret: bytes, timeout: float = 10.0, max_payload: int = 1 << 34):
        self.secret = secret
        self.timeout = timeout
        self.max_payload = max_payload

    def call(self, peer: str, header: dict[str, Any]) -> tuple[dict, bytearray]:
        host, _, port = peer.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout) as sock:
                _send(sock, header, self.secret)
                reply, payload = _recv(sock, self.secret, self.max_payload)
        except (OSError, ValueError, struct.error) as e:
            raise TransferError(f"prefill instance {peer} unreachable: {e}") from None
        if not reply.get("ok"):
            raise TransferError(f"prefill instance {peer}: {reply.get('error', 'refused')}")
        return reply, payload

    def open(self, peer: str, epoch: str, lease_id: str) -> dict:
        return self.call(peer, {"op": "open", "epoch": epoch, "lease_id": lease_id})[0]

    def pull(self, peer: str, epoch: str, lease_id: str, indices: list[int]) -> bytearray:
        return self.call(peer, {"op": "pull", "epoch": epoch, "lease_id": lease_id, "indices": indices})[1]

    def ack(self, peer: str, epoch: str, lease_id: str) -> bool:
        """Release the lease; True if it was still live (nothing could have overwritten its blocks)."""
        try:
            self.call(peer, {"op": "ack", "epoch": epoch, "lease_id": lease_id})
        except TransferError:
            return False
        return True
