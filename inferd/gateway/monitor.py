"""The gateway's background loop: scrape each replica's `/metrics`, probe `/health`, re-read replica lists.

Scrapes run every `scrape.interval_s`, probes every `health.interval_s`, all replicas at once, each
bounded by its timeout so one hung replica delays nothing. After each round the wait queue is woken,
since fresh load data may show free capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import TYPE_CHECKING

import httpx

from inferd.gateway.replicas import Pool, Replica, parse_load

if TYPE_CHECKING:
    from inferd.gateway.service import Gateway

logger = logging.getLogger(__name__)


class Monitor:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self._task: asyncio.Task | None = None
        self._last_health = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                logger.exception("monitor round failed")
            await asyncio.sleep(self.gateway.state.config.scrape.interval_s)

    async def tick(self) -> None:
        """One round: discovery, scrapes, and probes when due."""
        st = self.gateway.state
        for pool in st.pools.values():
            if pool.refresh_discovery() | await self._resolve(pool):
                logger.info("pool %s: replicas now %s", pool.name, list(pool.replicas))
        replicas = [r for p in st.pools.values() for r in p.replicas.values()]
        if self.gateway.kv_index is not None:
            self.gateway.kv_index.retain({r.url for r in replicas})
        jobs = [self._scrape(r) for r in replicas]
        now = time.monotonic()
        if now - self._last_health >= st.config.health.interval_s:
            self._last_health = now
            jobs += [self._probe(r) for r in replicas]
        await asyncio.gather(*jobs)
        self.gateway.queue.wake_all()
        self.gateway.update_cache_worth(time.monotonic())
        if self.gateway.deletion_costs is not None:
            await self.gateway.deletion_costs.tick(replicas)

    async def _resolve(self, pool: Pool) -> bool:
        """Re-resolve the pool's DNS name when due; a failed lookup keeps the last answer."""
        dns = pool.config.replicas_dns
        now = time.monotonic()
        if dns is None or now - pool.dns_resolved_at < dns.interval_s:
            return False
        pool.dns_resolved_at = now
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(dns.name, dns.port, type=socket.SOCK_STREAM)
        except OSError as e:
            logger.warning(
                "pool %s: resolving %s failed (%s); keeping %d replicas", pool.name, dns.name, e, len(pool.replicas)
            )
            return False
        hosts = sorted({info[4][0] for info in infos})
        urls = [f"{dns.scheme}://{f'[{h}]' if ':' in h else h}:{dns.port}" for h in hosts]
        return pool.set_dns(urls)

    def _headers(self, replica: Replica) -> dict[str, str]:
        key = (
            self.gateway.state.pools[replica.pool].config.api_key if replica.pool in self.gateway.state.pools else None
        )
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _scrape(self, replica: Replica) -> None:
        timeout = self.gateway.state.config.scrape.timeout_s
        try:
            r = await self.gateway.client.get(f"{replica.url}/metrics", timeout=timeout, headers=self._headers(replica))
            if r.status_code == 200:
                replica.load = parse_load(r.text, time.monotonic())
        except (httpx.HTTPError, ValueError) as e:
            logger.debug("scrape of %s failed: %s", replica.url, e)
            return
        index, pools = self.gateway.kv_index, self.gateway.state.pools
        if index is not None and replica.pool in pools:
            await index.discover(
                self.gateway.client, replica.url, self._headers(replica), pools[replica.pool].config.block_size
            )

    async def _probe(self, replica: Replica) -> None:
        cfg = self.gateway.state.config.health
        try:
            r = await self.gateway.client.get(f"{replica.url}/health", timeout=cfg.timeout_s)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            replica.record_success()
        else:
            replica.record_failure(cfg)
