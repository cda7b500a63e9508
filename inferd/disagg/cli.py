"""CLI of disaggregated serving: the `inferd serve --role ...` flags and `inferd disagg proxy`.

Nothing heavy is imported at parser-building time; the engine and the proxy app load inside the commands.
"""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger(__name__)

SECRET_ENV = "INFERD_KV_SECRET"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags `inferd serve` takes for a prefill or decode role (docs/disaggregation.md)."""
    g = p.add_argument_group("disaggregated prefill/decode")
    g.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="both: prefill and decode here (default); prefill: compute prompts and lend their KV blocks; "
        "decode: pull prompt KV from prefill instances and generate",
    )
    g.add_argument(
        "--kv-secret",
        default=os.environ.get(SECRET_ENV),
        help=f"shared secret of the KV transfer channel and of signed leases (default: ${SECRET_ENV})",
    )
    g.add_argument("--kv-host", default="127.0.0.1", help="prefill: address the KV transfer channel listens on")
    g.add_argument("--kv-port", type=int, default=0, help="prefill: port of the KV transfer channel (0: any free)")
    g.add_argument(
        "--kv-advertise-host",
        default=None,
        help="prefill: host decode instances reach the channel at (default --kv-host)",
    )
    g.add_argument(
        "--kv-peers",
        nargs="+",
        default=[],
        help="decode: the prefill instances' KV channels (host:port) it may pull from; a lease naming another is "
        "not used (the request is prefilled here). "
        "A DNS name admits every address it resolves to (a Kubernetes headless Service)",
    )
    g.add_argument(
        "--kv-peers-file",
        default=None,
        help="decode: a file of more allowed KV channels (one host:port a line), read again whenever it changes; "
        "for prefill instances that come and go (inferd up rewrites it as it scales the prefill pool)",
    )
    g.add_argument("--kv-lease-ttl", type=float, default=30.0, help="prefill: seconds a lease pins its blocks")
    g.add_argument(
        "--kv-transport",
        choices=["auto", "shm", "tcp"],
        default="auto",
        help="auto: shared memory when the prefill instance is on this host, else TCP",
    )


def make_connector(args: argparse.Namespace, engine):
    """The engine's KV connector for --role prefill or decode (None for both), already attached."""
    if args.role == "both":
        return None
    from inferd.disagg.params import Peers
    from inferd.engine.kv_connector import DisaggConnector, DisaggSettings
    from inferd.errors import ConfigError

    if not args.kv_secret:
        raise ConfigError(f"--role {args.role} needs --kv-secret (or ${SECRET_ENV}), the same on every instance")
    peers_file = getattr(args, "kv_peers_file", None)
    if args.role == "decode" and not args.kv_peers and not peers_file:
        raise ConfigError(
            "--role decode needs --kv-peers (or --kv-peers-file): the prefill instances' KV channels it may pull from"
        )
    settings = DisaggSettings(
        role=args.role,
        secret=args.kv_secret.encode(),
        peers=Peers(args.kv_peers, file=peers_file),
        lease_ttl=args.kv_lease_ttl,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        advertise_host=args.kv_advertise_host,
        transport=args.kv_transport,
    )
    connector = DisaggConnector(settings, engine.kv.block_size)
    engine.attach_kv_connector(connector)
    return connector


def register_metrics(app, connector) -> None:
    """The handoff's metrics on the server's /metrics."""
    if connector is None:
        return
    from inferd.disagg.metrics import DisaggCollector
    from inferd.engine.kv_connector import TRANSFER_BUCKETS

    state = app.state.inferd
    served = connector._server  # noqa: SLF001
    state.metrics.registry.register(
        DisaggCollector(
            state.model_name, lambda: connector.stats, TRANSFER_BUCKETS, lambda: served.stats if served else None
        )
    )


# -- inferd disagg proxy -----------------------------------------------------------------------------
def register(subparsers) -> None:
    p = subparsers.add_parser("disagg", help="disaggregated prefill/decode serving")
    sub = p.add_subparsers(dest="disagg_command", required=True)
    proxy = sub.add_parser("proxy", help="an OpenAI front that prefills on one pool and decodes on another")
    for side in ("prefill", "decode"):
        g = proxy.add_mutually_exclusive_group(required=True)
        g.add_argument(f"--{side}", nargs="+", help=f"{side} instances' base URLs")
        g.add_argument(
            f"--{side}-file",
            default=None,
            help=f"a file of {side} instances' base URLs (one a line), read again whenever it changes "
            "(inferd up rewrites it as it scales the pool); it may be empty",
        )
    proxy.add_argument(
        "--decode-wait",
        type=float,
        default=30.0,
        help="seconds a request waits for a decode instance to be listed when none is, before a 503",
    )
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--api-key", default=os.environ.get("INFERD_API_KEY"), help="sent to the instances as a bearer")
    proxy.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds before a prefill counts as failed")
    proxy.add_argument(
        "--decider",
        choices=["always", "cost"],
        default="always",
        help="always: every request prefills remotely; cost: prefill on the decode instance when that is predicted "
        "faster (uncached prompt tokens / prefill rate vs transfer time + prefill queue wait)",
    )
    proxy.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from inferd.disagg.proxy import ProxySettings, create_app

    settings = ProxySettings(
        prefill=list(args.prefill or []),
        decode=list(args.decode or []),
        prefill_file=args.prefill_file,
        decode_file=args.decode_file,
        decode_wait=args.decode_wait,
        api_key=args.api_key,
        prefill_timeout=args.prefill_timeout,
        decider=args.decider,
    )
    app = create_app(settings)
    level = logging.getLevelName(logging.getLogger().level).lower()
    prefill, decode = args.prefill or args.prefill_file, args.decode or args.decode_file
    logger.info("disagg proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, prefill, decode)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=level, access_log=False)).run()
    return 0
