"""CLI of disaggregated serving: the `inferd serve --role ...` flags and `inferd disagg proxy`.

Nothing heavy is imported at parser-building time; the engine and the proxy app load inside the commands.
`inferd serve` turns the flags into checked settings (`disagg_settings`) before it loads the model, and
attaches the engine's connector (`inferd.engine.kv_connector.attach_disagg`) after: nothing here imports the
engine.
"""

from __future__ import annotations

import argparse
import logging
import os

from inferd.disagg.params import Peers
from inferd.disagg.settings import ROLES, SECRET_ENV, TRANSPORTS, DisaggSettings, default
from inferd.errors import ConfigError

logger = logging.getLogger(__name__)

# flags that mean something for some roles only (dest: flag, roles): given with another role, they are a
# mistake to report (--kv-secret is not one: it may come from the environment of every instance)
_ROLE_FLAGS = {
    "kv_host": ("--kv-host", ("prefill",)),
    "kv_port": ("--kv-port", ("prefill",)),
    "kv_advertise_host": ("--kv-advertise-host", ("prefill",)),
    "kv_lease_ttl": ("--kv-lease-ttl", ("prefill",)),
    "kv_peers": ("--kv-peers", ("decode",)),
    "kv_peers_file": ("--kv-peers-file", ("decode",)),
    "kv_transport": ("--kv-transport", ("prefill", "decode")),
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags `inferd serve` takes for a prefill or decode role (docs/disaggregation.md)."""
    g = p.add_argument_group("disaggregated prefill/decode")
    g.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="both: prefill and decode here (default); prefill: compute prompts and lend their KV blocks; "
        "decode: pull prompt KV from prefill instances and generate",
    )
    g.add_argument(
        "--kv-secret",
        default=os.environ.get(SECRET_ENV),
        help=f"shared secret of the KV transfer channel and of signed leases (default: ${SECRET_ENV})",
    )
    g.add_argument("--kv-host", default=default("kv_host"), help="prefill: address the KV transfer channel listens on")
    g.add_argument(
        "--kv-port", type=int, default=default("kv_port"), help="prefill: port of the KV transfer channel (0: any free)"
    )
    g.add_argument(
        "--kv-advertise-host",
        default=default("advertise_host"),
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
    g.add_argument(
        "--kv-lease-ttl", type=float, default=default("lease_ttl"), help="prefill: seconds a lease pins its blocks"
    )
    g.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default=default("transport"),
        help="auto: shared memory when the prefill instance is on this host, else TCP",
    )


def disagg_settings(args: argparse.Namespace) -> DisaggSettings | None:
    """The KV handoff's settings from `inferd serve`'s flags (None for --role both), checked without loading
    anything: raises ConfigError for a flag missing for the role, or given for a role it means nothing to."""
    defaults = _serve_parser()
    for dest, (flag, roles) in _ROLE_FLAGS.items():
        unset = defaults.get_default(dest)
        if args.role not in roles and getattr(args, dest, unset) != unset:
            raise ConfigError(f"{flag} is for --role {' or '.join(roles)}; this instance is --role {args.role}")
    if args.role == "both":
        return None
    settings = DisaggSettings(
        role=args.role,
        secret=(args.kv_secret or "").encode(),
        peers=Peers(args.kv_peers, file=args.kv_peers_file) if args.role == "decode" else frozenset(),
        lease_ttl=args.kv_lease_ttl,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        advertise_host=args.kv_advertise_host,
        transport=args.kv_transport,
    )
    settings.validate()
    return settings


def _serve_parser() -> argparse.ArgumentParser:
    """The --role and --kv-* flags alone, for their defaults."""
    p = argparse.ArgumentParser(add_help=False)
    add_serve_args(p)
    return p


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
