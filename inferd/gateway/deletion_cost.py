"""Cache-aware scale-down on Kubernetes: each replica pod's `controller.kubernetes.io/pod-deletion-cost`.

When a Deployment scales down, its ReplicaSet deletes the pods with the lowest deletion cost first (then the
usual rules). Left alone every pod costs 0 and the victim is arbitrary, so an autoscaler (HPA, KEDA) may
remove the replica whose cache serves most of the traffic's prefixes. The gateway knows what each replica's
cache is worth: the tokens of the prefixes asked for lately that only it holds (`Replica.cache_worth`,
inferd/gateway/cache_worth.py, from the KV events where replicas publish them). Every `interval_s` it lists
the pods of its namespace, matches them to its replicas by pod IP, and patches the annotation to that worth
(in tokens, an integer) where it moved by more than a tenth: Kubernetes asks that the annotation not be
updated often, and the ordering only needs the ranks. `inferd up` orders its own scale-downs the same way
(`inferd.runtime.up.drain_order`).

It runs in the cluster with the pod's service account (a Role allowing pods get/list/patch, which
`inferd deploy k8s` renders with the gateway), talking to the API server over HTTPS with the account's token
and CA; a failure is logged and retried next round, never felt by a request.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from inferd.gateway.config import DeletionCostConfig
from inferd.gateway.replicas import Replica

logger = logging.getLogger(__name__)

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def cost_of(worth: float) -> int:
    """The annotation's value for a cache's worth (tokens): an int32, as Kubernetes requires."""
    return max(0, min(2**31 - 1, round(worth)))


def changed_enough(old: int | None, new: int) -> bool:
    return old is None or abs(new - old) > max(1, old // 10)


class DeletionCosts:
    def __init__(self, config: DeletionCostConfig):
        self.config = config
        self.namespace = config.namespace or _read(SERVICE_ACCOUNT / "namespace")
        self._client: httpx.AsyncClient | None = None
        self._last = float("-inf")
        self.patched = 0

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            c = self.config
            token = _read(Path(c.token_file)) if c.token_file else None
            self._client = httpx.AsyncClient(
                base_url=c.api_server,
                verify=c.ca_file if c.ca_file and Path(c.ca_file).exists() else True,
                headers={"Authorization": f"Bearer {token}"} if token else {},
                timeout=5.0,
            )
        return self._client

    async def tick(self, replicas: list[Replica], now: float | None = None) -> None:
        """Once every interval_s: patch the pods whose cost moved."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.config.interval_s:
            return
        self._last = now
        try:
            await self._update(replicas, now)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.warning("pod deletion costs not updated: %s", e)

    async def _update(self, replicas: list[Replica], now: float) -> None:
        http = self._http()
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        r = await http.get(path, params={"labelSelector": self.config.label_selector})
        r.raise_for_status()
        pods = {}
        for pod in r.json()["items"]:
            ip = (pod.get("status") or {}).get("podIP")
            if ip:
                pods[ip] = pod["metadata"]
        for replica in replicas:
            meta = pods.get(urlsplit(replica.url).hostname or "")
            if meta is None:
                continue
            old = (meta.get("annotations") or {}).get(ANNOTATION)
            new = cost_of(replica.cache_worth)
            if not changed_enough(int(old) if old is not None and old.lstrip("-").isdigit() else None, new):
                continue
            patch = {"metadata": {"annotations": {ANNOTATION: str(new)}}}
            p = await http.patch(
                f"{path}/{meta['name']}", json=patch, headers={"Content-Type": "application/merge-patch+json"}
            )
            p.raise_for_status()
            self.patched += 1

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
