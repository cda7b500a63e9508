"""One instance's side of the KV handoff: its role, the shared secret, its channel or its allow-list.

`inferd serve --role prefill|decode` builds these from its flags (inferd.disagg.cli), whose defaults are the
fields' own, and checks them before it loads the model: a misconfiguration exits at once with what to change
instead of after a load of seconds or minutes. The connector (inferd.engine.kv_connector) checks them again
with the same `validate`. Nothing here imports torch or the engine.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, fields

from inferd.errors import ConfigError

ROLES = ("both", "prefill", "decode")
TRANSPORTS = ("auto", "shm", "tcp")
SECRET_ENV = "INFERD_KV_SECRET"


@dataclass
class DisaggSettings:
    role: str  # prefill | decode
    secret: bytes
    peers: Container[str] = frozenset()  # decode: prefill channels (host:port) it may pull from (disagg.params.Peers)
    lease_ttl: float = 30.0
    read_timeout: float = 30.0
    kv_host: str = "127.0.0.1"  # prefill: where its channel listens
    kv_port: int = 0
    advertise_host: str | None = None  # prefill: the host decode instances reach it at (default kv_host)
    transport: str = "auto"  # auto (shared memory on the same host, else TCP) | tcp | shm
    timeout: float = 10.0

    def validate(self) -> None:
        """Raise ConfigError, naming the flag to change, for settings that cannot work."""
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"--role {self.role!r}: a KV handoff is for --role prefill or decode")
        if not self.secret:
            raise ConfigError(f"--role {self.role} needs --kv-secret (or ${SECRET_ENV}), the same on every instance")
        if self.role == "decode" and not self.peers:
            raise ConfigError(
                "--role decode needs --kv-peers (or --kv-peers-file): "
                "the prefill instances' KV channels it may pull from"
            )
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--kv-transport {self.transport!r}: one of {', '.join(TRANSPORTS)}")
        if not 0 <= self.kv_port <= 65535:
            raise ConfigError(f"--kv-port {self.kv_port}: a TCP port is 0 (any free one) to 65535")
        for name, value in (
            ("--kv-lease-ttl", self.lease_ttl),
            ("read_timeout", self.read_timeout),
            ("timeout", self.timeout),
        ):
            if not value > 0:
                raise ConfigError(f"{name} {value:g}: must be more than 0 seconds")


def default(name: str):
    """A field's default, for the flag that sets it."""
    return next(f.default for f in fields(DisaggSettings) if f.name == name)
