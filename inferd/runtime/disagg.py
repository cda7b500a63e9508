"""Disaggregated models in `inferd up`: a prefill pool, a decode pool and one `inferd disagg proxy` in front.

The gateway sends the model's requests to the proxy (the decode pool's endpoint, as `inferd deploy k8s`
does); the proxy prefills on a prefill replica, hands the lease to a decode replica and relays its answer.
Both pools scale separately, each with its own policy, so everything that names replicas follows lists
that `inferd up` rewrites (atomically: a temporary file, then a rename) as replicas come and go:

- `<prefill pool>.replicas`: ready prefill replicas, for the proxy (`--prefill-file`) and Prometheus;
- `<decode pool>.replicas`: ready decode replicas, for the proxy (`--decode-file`) and Prometheus;
- `<prefill pool>.kv-peers`: the KV channel of every prefill replica alive (loading, ready or draining),
  for the decode replicas (`--kv-peers-file`);
- `<decode pool>.front`: the proxy, while a decode replica is ready, for the gateway (the decode pool's
  `replicas_file`).

**Why a peers file, not ports reserved up front.** A decode replica must accept KV from prefill replicas
started after it, and refuse any other channel. Reserving the KV ports of `max_replicas` prefill replicas
at start would leave ports nobody holds for minutes (another process can take one, and the prefill replica
given it then fails to start), and caps the pool at a number fixed before the run. Instead each prefill
replica gets a free port when it starts; its channel is written to the peers file *before* the process
starts (so before it can hand out a lease), and removed only once the process has exited (so leases of a
draining replica stay valid). A decode replica checks the file on every lease it is handed (one `stat`,
read again when it changed): the allow-list is exactly the prefill replicas alive, and a lease naming a
channel not in it is not used (the decode replica prefills the request itself), as with `--kv-peers`.

**Leaving without breaking requests.** A prefill replica scaled away is unlisted first (the proxy stops
picking it on its next request), then, once the gateway's grace has passed *and* it holds no lease that a
decode replica has still to pull (`inferd:kv_leases_active` 0, or the lease TTL has passed), it gets
SIGTERM and drains. A decode replica is unlisted, then drains like a `both` replica. With no prefill
replica ready the proxy prefills on the decode replicas (its `no_prefill_instance` fallback); with no
decode replica ready the gateway lists no endpoint for the model, so requests wait in its queue.

The KV secret is `$INFERD_KV_SECRET` if set, else a random one for the run; it reaches the replicas in
their environment, never on a command line.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferd.disagg.settings import SECRET_ENV, default

LEASE_WAIT_S = default("lease_ttl")  # the longest a draining prefill replica waits for its leases (their TTL)


def kv_secret() -> str:
    return os.environ.get(SECRET_ENV) or secrets.token_hex(32)


def write_list(path: Path, lines: list[str]) -> None:
    """Replace `path` with these lines at once (readers see the old list or the new one, never a part)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in lines))
    tmp.replace(path)


def kv_peer(port: int) -> str:
    """A prefill replica's KV channel as decode replicas name it (its `--kv-host` default, 127.0.0.1)."""
    return f"127.0.0.1:{port}"


def scraped_samples(client: httpx.Client, url: str, name: str, timeout: float | None = None) -> list:
    """Every sample called `name` on `url`'s /metrics (prometheus_client's Sample); none if it does not answer."""
    try:
        text = client.get(url + "/metrics", **({} if timeout is None else {"timeout": timeout})).text
    except httpx.HTTPError:
        return []
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def scraped_value(client: httpx.Client, url: str, name: str, timeout: float | None = None) -> float:
    """The first sample called `name` on `url`'s /metrics; 0 if it does not answer or has none."""
    samples = scraped_samples(client, url, name, timeout)
    return samples[0].value if samples else 0.0


def leases_active(client: httpx.Client, url: str) -> float:
    """A prefill replica's `inferd:kv_leases_active`; 0 if it does not answer (nothing to wait for then)."""
    return scraped_value(client, url, "inferd:kv_leases_active", timeout=1.0)


@dataclass(eq=False)
class DisaggFront:
    """One disaggregated model's proxy process and the lists that tie its pools together."""

    model: str
    prefill_pool: str
    decode_pool: str
    state_dir: Path
    port: int = 0
    popen: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def prefill_file(self) -> Path:
        return self.state_dir / f"{self.prefill_pool}.replicas"

    @property
    def decode_file(self) -> Path:
        return self.state_dir / f"{self.decode_pool}.replicas"

    @property
    def peers_file(self) -> Path:
        return self.state_dir / f"{self.prefill_pool}.kv-peers"

    @property
    def front_file(self) -> Path:
        return self.state_dir / f"{self.decode_pool}.front"

    @property
    def log(self) -> Path:
        return self.state_dir / "logs" / f"{self.model}-proxy.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def proxy_argv(self, python: str, log_level: str) -> list[str]:
        argv = [python, "-m", "inferd.cli", "--log-level", log_level, "disagg", "proxy"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        return argv + ["--prefill-file", str(self.prefill_file), "--decode-file", str(self.decode_file)]

    def start(self, port: int, spawn: Callable[[list[str], Path], subprocess.Popen], python: str, level: str) -> None:
        """Start the proxy on `port` and wait (up to a minute) until it answers."""
        self.port, self.started = port, time.monotonic()
        self.popen = spawn(self.proxy_argv(python, level), self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"the disaggregation proxy of {self.model} exited:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the disaggregation proxy of {self.model} did not answer in 60s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def publish_peers(self, kv_ports: list[int]) -> None:
        write_list(self.peers_file, [kv_peer(p) for p in kv_ports])

    def publish_front(self, decode_ready: bool) -> None:
        """The gateway sees the proxy only while it can serve: alive, with a decode replica ready."""
        write_list(self.front_file, [self.url] if decode_ready and self.alive() else [])
