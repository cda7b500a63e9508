"""KV connectors: K/V that comes from, or goes to, outside this engine (docs/disaggregation.md).

`KVConnector` has the shape of vLLM's KV connector v1, so other transports slot in:

- scheduler side (step thread, between steps): `get_num_new_matched_tokens` (how many of a waiting
  request's tokens beyond its local prefix hit can be loaded from outside), `update_state_after_alloc`
  (blocks are allocated for them: remember what to load where), `build_connector_meta` (the loads of
  this step, handed to the runner inside the step record), `request_finished` (keep the blocks of a
  finished request for someone else to read?), `housekeeping` (free what others are done with);
- worker side (in `ModelRunner.execute`, before the forward pass): `register_kv_caches`,
  `start_load_kv` (this connector loads synchronously: the blocks are in place when it returns, and it
  reports which loads succeeded), `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`.

A request whose load fails is recomputed locally from its prefix hit: the scheduler frees the blocks the
load was writing, which were never entered in the prefix cache, so no one can read half-loaded K/V.

`DisaggConnector` is the prefill/decode handoff: a prefill instance pins a finished prompt's blocks
under a lease (`inferd.disagg.leases`) and hands out signed transfer parameters; a decode instance pulls
the blocks its own prefix cache lacks over shared memory or TCP (`inferd.disagg.transport`), checks
their checksums and goes on as if it had prefilled.

Transfer parameters a decode instance cannot trust (not signed under its secret, malformed, naming a peer
outside its allow-list, or another prompt's) are not the client's fault: the proxy passes on what a prefill
instance wrote, and the usual cause is an operator's (`INFERD_KV_SECRET` differing between the pools). So the
request is prefilled here, as one without parameters, and answered; nothing of the lease is read or
contacted. Each rejection is counted by reason and logged once per claimed peer and reason, not per request.
A client sending forged parameters directly gets the same: an answer it could have had without them.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from inferd.disagg.leases import Lease, LeaseTable
from inferd.disagg.metrics import DisaggCollector
from inferd.disagg.params import OTHER_PROMPT, BadTransferParams, KVTransferParams, prompt_digest
from inferd.disagg.settings import DisaggSettings
from inferd.disagg.transport import (
    KVCaches,
    KVClient,
    KVServer,
    SharedKV,
    TransferError,
    checksums,
    copy_blocks,
    host_identity,
    layout_of,
    scatter,
)
from inferd.engine.kv_cache import KVCacheManager
from inferd.errors import InvalidRequestError
from inferd.request import Request, RequestStatus

logger = logging.getLogger(__name__)

TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
_EXPIRY_MARGIN = 1.0  # seconds: a lease this close to its end is not worth starting a pull on
_LOGGED_MAX = 64  # (claimed peer, reason) pairs whose rejection is logged; later ones are only counted
_REJECTION_HINTS = {
    "bad_signature": "is INFERD_KV_SECRET (--kv-secret) the same on every prefill and decode instance?",
    "untrusted_peer": "is the prefill instance's KV channel in --kv-peers or --kv-peers-file?",
}


# -- the interface -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    """Load blocks `src_indices` of a lease into this engine's `dst_block_ids`."""

    request_id: str
    params: KVTransferParams
    src_indices: list[int]
    dst_block_ids: list[int]
    num_tokens: int  # the request's computed tokens once loaded (prefix hit + loaded)


@dataclass
class KVConnectorMetadata:
    """The connector's part of a step record."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class LoadResult:
    finished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class KVConnector(ABC):
    # -- scheduler side --
    @abstractmethod
    def add_request(self, request_id: str, params: dict | None, token_ids: list[int], salt: str | None, n: int):
        """Check a new request's kv_transfer_params; raise InvalidRequestError to refuse it (400)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the local prefix hit that can be loaded from outside (0: compute them)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None: ...

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None: ...

    @abstractmethod
    def request_finished(self, request: Request, kv: KVCacheManager) -> bool:
        """True if the connector took over the request's blocks (it frees them in housekeeping)."""

    @abstractmethod
    def take_transfer_params(self, request_id: str) -> dict | None:
        """The kv_transfer_params to return with a finished request."""

    @abstractmethod
    def housekeeping(self, kv: KVCacheManager) -> None:
        """On the step thread: free blocks whose holders are done or whose time ran out."""

    @property
    @abstractmethod
    def needs_wakeup(self) -> bool:
        """Blocks are held for others: the engine loop must run housekeeping even when idle."""

    # -- worker side --
    @abstractmethod
    def register_kv_caches(self, kv_caches: KVCaches) -> KVCaches:
        """Take the runner's caches; may return replacements (e.g. the same tensors in shared memory)."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> LoadResult: ...

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads are synchronous here: every layer is in place once start_load_kv returns."""
        return None

    def save_kv_layer(self, layer: int, kv_layer: Any, attn_metadata: Any) -> None:
        """The handoff leaves K/V where the forward pass wrote it and lends the blocks out: nothing to save."""
        return None

    def wait_for_save(self) -> None:
        return None

    def close(self) -> None:
        return None


# -- metrics -----------------------------------------------------------------------------------------
@dataclass
class DisaggStats:
    """Counters read by the metrics endpoint (inferd.disagg.metrics)."""

    role: str
    remote_prefills: int = 0  # decode: requests whose prompt K/V came from a prefill instance
    transfers: dict[str, int] = field(default_factory=dict)  # decode: pulls by transport (shm, tcp)
    local_prefills: dict[str, int] = field(default_factory=dict)  # decode: recomputed here, by reason
    bytes_transferred: int = 0
    blocks_transferred: int = 0
    blocks_prefix_hit: int = 0  # blocks a lease offered that the local prefix cache already had
    transfer_buckets: list[int] = field(default_factory=lambda: [0] * len(TRANSFER_BUCKETS))
    transfer_count: int = 0
    transfer_sum: float = 0.0
    transfer_failures: int = 0
    checksum_failures: int = 0
    leases_created: int = 0
    leases_released: int = 0  # acknowledged by a decode instance
    lease_expiries: int = 0
    leases_active: int = 0
    blocks_leased: int = 0
    # kv_transfer_params not used, by reason: prefilled locally (decode) or refused with a 400 (prefill)
    params_rejected: dict[str, int] = field(default_factory=dict)

    def local(self, reason: str) -> None:
        self.local_prefills[reason] = self.local_prefills.get(reason, 0) + 1

    def reject(self, reason: str) -> None:
        self.params_rejected[reason] = self.params_rejected.get(reason, 0) + 1

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_count += 1
        self.transfer_sum += seconds
        for i, bound in enumerate(TRANSFER_BUCKETS):
            if seconds <= bound:
                self.transfer_buckets[i] += 1


# -- the prefill/decode handoff ----------------------------------------------------------------------
class DisaggConnector(KVConnector):
    def __init__(self, settings: DisaggSettings, block_size: int):
        settings.validate()
        self.s = settings
        self.block_size = block_size
        self.stats = DisaggStats(settings.role)
        self.epoch = secrets.token_hex(8)
        self.host = host_identity()
        self.kv_caches: KVCaches = []
        self.layout = None
        # prefill side
        self.leases = LeaseTable(settings.read_timeout)
        self._outgoing: dict[str, dict] = {}
        self._server: KVServer | None = None
        self._shm: SharedKV | None = None
        # decode side
        self._incoming: dict[str, KVTransferParams] = {}  # by parent request id
        self._meta = KVConnectorMetadata()
        self._client = KVClient(settings.secret, settings.timeout)
        self._attached: dict[str, SharedKV] = {}
        self._acks: queue.SimpleQueue = queue.SimpleQueue()
        self._acker: threading.Thread | None = None
        self._logged: set[tuple[str, str]] = set()  # rejections already logged, by (claimed peer, reason)

    @property
    def peer(self) -> str:
        host = self.s.advertise_host or self.s.kv_host
        return f"{host}:{self._server.port}" if self._server else ""

    def collector(self, model_name: str) -> DisaggCollector:
        """The handoff's metrics, for the server's /metrics registry."""
        served = lambda: self._server.stats if self._server else None  # noqa: E731
        return DisaggCollector(model_name, lambda: self.stats, TRANSFER_BUCKETS, served)

    # -- worker side: caches ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: KVCaches) -> KVCaches:
        self.layout = layout_of(kv_caches)
        if self.s.role == "prefill":
            kv_caches = self._share(kv_caches)
            self._server = KVServer(
                self.s.kv_host,
                self.s.kv_port,
                self.s.secret,
                self.epoch,
                self.leases,
                lambda: self.kv_caches,
                self._shm,
            )
            self._server.start()
            logger.info("KV transfer channel on %s (epoch %s)", self.peer, self.epoch)
        else:
            self._acker = threading.Thread(target=self._ack_loop, name="inferd-kv-acks", daemon=True)
            self._acker.start()
        self.kv_caches = kv_caches
        return kv_caches

    def _share(self, kv_caches: KVCaches) -> KVCaches:
        """The prefill cache in a shared memory segment, so same-host decodes copy straight out of it."""
        if self.s.transport == "tcp" or kv_caches[0][0].device.type != "cpu":
            return kv_caches  # CUDA caches would go through CUDA IPC or NIXL (docs/disaggregation.md)
        try:
            self._shm = SharedKV.create(f"inferd-kv-{self.epoch}", self.layout, kv_caches[0][0].shape[0])
        except OSError as e:
            if self.s.transport == "shm":
                raise
            logger.warning("no shared memory for the KV cache (%s); decode instances will pull over TCP", e)
            return kv_caches
        # a new segment reads as zeros, as the runner's fresh caches do: nothing to copy (and no page touched)
        return self._shm.kv

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._acker is not None:
            self._acks.put(None)
        for shm in self._attached.values():
            shm.close()
        if self._shm is not None:
            self._shm.close()

    # -- scheduler side: requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, params: dict | None, token_ids: list[int], salt: str | None, n: int):
        if params is None:
            if self.s.role == "decode":
                self.stats.local("no_params")
            return
        if self.s.role == "prefill":
            if params.get("do_remote_decode") is not True:
                message = 'a prefill instance takes kv_transfer_params {"do_remote_decode": true} only'
                raise self._bad(message, "not_a_prefill_request")
            if n != 1:
                raise self._bad(
                    "a request handed to a decode instance must have n=1 here (the decode side fans out)", "n_above_1"
                )
            return
        try:
            lease = KVTransferParams.from_dict(params, self.s.secret, self.s.peers)
            if lease.prompt_hash != prompt_digest(token_ids, salt):
                raise BadTransferParams("kv_transfer_params belong to another prompt (or cache_salt)", OTHER_PROMPT)
        except BadTransferParams as e:
            self._rejected(request_id, params, e)
            return
        self._incoming[request_id] = lease

    def _bad(self, message: str, reason: str) -> InvalidRequestError:
        self.stats.reject(reason)
        return InvalidRequestError(message, param="kv_transfer_params")

    def _rejected(self, request_id: str, params: Any, e: BadTransferParams) -> None:
        """Parameters the decode side does not trust: the request prefills here, as one without them."""
        self.stats.reject(e.reason)
        self.stats.local("params_rejected")
        claimed = params.get("peer") if isinstance(params, dict) else None
        peer = claimed[:100] if isinstance(claimed, str) else "(none)"
        key = (peer, e.reason)
        if key in self._logged or len(self._logged) >= _LOGGED_MAX:
            logger.debug("request %s: kv_transfer_params rejected (%s); prefilling here", request_id, e)
            return
        self._logged.add(key)
        hint = _REJECTION_HINTS.get(e.reason)
        logger.warning(
            "kv_transfer_params claiming prefill peer %r rejected (%s): %s; such requests are prefilled here%s. "
            'Further ones are counted in inferd:kv_transfer_params_rejected_total{reason="%s"}, not logged',
            peer,
            e.reason,
            e,
            f" ({hint})" if hint else "",
            e.reason,
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        lease = self._incoming.get(request.parent_id)
        if lease is None:
            return 0
        # the last prompt token is always computed here: its logits give the first output token
        end = min(lease.num_tokens, request.num_tokens - 1)
        reason = None
        if lease.layout != self.layout:
            reason = "layout_mismatch"
        elif lease.expires_at <= time.time() + _EXPIRY_MARGIN:
            reason = "lease_expired"
        elif end <= num_computed_tokens:
            reason = "prefix_hit" if num_computed_tokens else "nothing_to_pull"
        if reason is None:
            return end - num_computed_tokens
        logger.info("request %s: prefilling here (%s)", request.request_id, reason)
        self.stats.local(reason)
        self._release(self._incoming.pop(request.parent_id))
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        lease = self._incoming.pop(request.parent_id)
        bs = self.block_size
        first, last = num_computed_tokens // bs, -(-(num_computed_tokens + num_external_tokens) // bs)
        self.stats.blocks_prefix_hit += first
        self._meta.loads.append(
            LoadSpec(
                request.request_id,
                lease,
                list(range(first, last)),
                block_ids[first:last],
                num_computed_tokens + num_external_tokens,
            )
        )

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not self._meta.loads:
            return None
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def request_finished(self, request: Request, kv: KVCacheManager) -> bool:
        if self.s.role == "decode":
            lease = self._incoming.pop(request.parent_id, None)
            if lease is not None:  # ended before it was scheduled: let the prefill side go at once
                self._release(lease)
            return False
        params = request.params.kv_transfer_params
        if not params or request.status == RequestStatus.FINISHED_ABORTED:
            return False
        if request.num_computed_tokens < request.num_prompt_tokens:
            return False
        self._lease(request, kv)
        return True

    def _lease(self, request: Request, kv: KVCacheManager) -> None:
        """Pin the blocks of the prompt and sign transfer parameters for them."""
        blocks = kv.hand_over(request)
        n = -(-request.num_prompt_tokens // self.block_size)
        kv.release_blocks(blocks[n:])
        pinned = blocks[:n]
        ids = tuple(b.block_id for b in pinned)
        lease = Lease(uuid.uuid4().hex, ids, time.time() + self.s.lease_ttl, owner=pinned)
        params = KVTransferParams(
            peer=self.peer,
            epoch=self.epoch,
            lease_id=lease.lease_id,
            expires_at=lease.expires_at,
            num_tokens=request.num_prompt_tokens,
            prompt_hash=prompt_digest(request.prompt_token_ids, request.cache_salt),
            block_ids=ids,
            checksums=tuple(checksums(self.kv_caches, ids)),
            layout=self.layout,
            shm=self._shm.name if self._shm else None,
            host=self.host if self._shm else None,
        )
        self.leases.add(lease)
        self.stats.leases_created += 1
        self._count_leases()  # the gauges move with the lease, not at the next housekeeping
        self._outgoing[request.request_id] = params.to_dict(self.s.secret)

    def take_transfer_params(self, request_id: str) -> dict | None:
        return self._outgoing.pop(request_id, None)

    def housekeeping(self, kv: KVCacheManager) -> None:
        if self.s.role != "prefill":
            return
        for lease in self.leases.take_released():
            kv.release_blocks(lease.owner)
            self.stats.leases_released += 1
        for lease in self.leases.expired():
            logger.warning(
                "lease %s expired before a decode instance acknowledged it; freeing its blocks", lease.lease_id
            )
            kv.release_blocks(lease.owner)
            self.stats.lease_expiries += 1
        self._count_leases()

    def _count_leases(self) -> None:
        self.stats.leases_active = len(self.leases)
        self.stats.blocks_leased = self.leases.num_blocks

    @property
    def needs_wakeup(self) -> bool:
        return len(self.leases) > 0

    # -- worker side: loads ---------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata) -> LoadResult:
        result = LoadResult()
        for spec in meta.loads:
            t0 = time.monotonic()
            try:
                transport = self._load(spec)
            except TransferError as e:
                logger.warning("request %s: KV pull failed (%s); prefilling here instead", spec.request_id, e)
                self._unmap(spec.params.shm)  # a dead prefill's segment is freed only once every mapping goes
                self.stats.transfer_failures += 1
                self.stats.local("transfer_failed")
                result.failed.append(spec.request_id)
                continue
            self.stats.observe_transfer(time.monotonic() - t0)
            self.stats.remote_prefills += 1
            self.stats.transfers[transport] = self.stats.transfers.get(transport, 0) + 1
            self.stats.blocks_transferred += len(spec.dst_block_ids)
            self.stats.bytes_transferred += len(spec.dst_block_ids) * spec.params.layout.block_bytes
            result.finished.append(spec.request_id)
        return result

    def _load(self, spec: LoadSpec) -> str:
        """Copy the blocks in and check them; returns the transport used, raises TransferError."""
        lease = spec.params
        released = False
        try:
            shm = self._shared(lease)
            if shm is not None:
                src = [lease.block_ids[i] for i in spec.src_indices]
                copy_blocks(shm.kv, src, self.kv_caches, spec.dst_block_ids)
                # the lease must still have been live when the copy ended, or the blocks may have been reused
                released = True
                if not self._client.ack(lease.peer, lease.epoch, lease.lease_id):
                    raise TransferError("the lease ended during the copy")
            else:
                payload = self._client.pull(lease.peer, lease.epoch, lease.lease_id, spec.src_indices)
                scatter(self.kv_caches, spec.dst_block_ids, payload)
            expected = [lease.checksums[i] for i in spec.src_indices]
            if checksums(self.kv_caches, spec.dst_block_ids) != expected:
                self.stats.checksum_failures += 1
                raise TransferError("checksum mismatch")
        finally:
            if not released:
                self._release(lease)
        return "shm" if shm is not None else "tcp"

    def _shared(self, lease: KVTransferParams) -> SharedKV | None:
        """The prefill's shared cache, opened under the lease; None to pull over TCP instead."""
        if self.s.transport == "tcp" or not lease.shm or lease.host != self.host:
            return None
        info = self._client.open(lease.peer, lease.epoch, lease.lease_id)  # holds the lease while we copy
        name, num_blocks = info.get("shm"), info.get("num_blocks")
        if name != lease.shm or not isinstance(num_blocks, int):
            raise TransferError("the prefill instance offers no shared memory for this lease")
        shm = self._attached.get(name)
        if shm is None:
            try:
                shm = SharedKV.attach(name, lease.layout, num_blocks)
            except (OSError, ValueError) as e:
                raise TransferError(f"cannot map shared memory {name}: {e}") from None
            self._attached[name] = shm
        return shm

    def _unmap(self, name: str | None) -> None:
        shm = self._attached.pop(name, None) if name else None
        if shm is not None:
            shm.close()

    def _release(self, lease: KVTransferParams) -> None:
        """Acknowledge a lease off the step thread (best effort: the prefill side expires it anyway)."""
        self._acks.put(lease)

    def _ack_loop(self) -> None:
        while True:
            lease = self._acks.get()
            if lease is None:
                return
            self._client.ack(lease.peer, lease.epoch, lease.lease_id)


def attach_disagg(settings: DisaggSettings | None, engine) -> DisaggConnector | None:
    """The engine's KV connector for `inferd serve --role prefill|decode` (None for `both`), attached."""
    if settings is None:
        return None
    connector = DisaggConnector(settings, engine.kv.block_size)
    engine.attach_kv_connector(connector)
    return connector
