"""`inferd gateway --config gateway.yaml`: serve the gateway until SIGTERM/SIGINT; SIGHUP reloads the config.

A SIGHUP is caught from the start of the command, before the port opens; one that comes before the server
runs is replayed as a reload once it does. A reload that fails validation is logged and changes nothing;
one that passes is swapped in for new requests while requests in flight, streams included, finish on the
state they started with.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="route OpenAI requests across replicas and models, with budgets")
    p.add_argument("--config", required=True, help="the gateway's YAML config (see docs/gateway.md)")
    p.add_argument("--host", default=None, help="overrides listen.host")
    p.add_argument("--port", type=int, default=None, help="overrides listen.port")
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    p.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    # SIGHUP's default action ends the process: hold it from the first moment, long before the port opens
    # (the web stack's imports and the config take a while), and replay it once the event loop runs
    held: list[float] = []
    signal.signal(signal.SIGHUP, lambda *_: held.append(time.monotonic()))
    import uvicorn

    from inferd.gateway.app import create_app
    from inferd.gateway.config import load_config
    from inferd.gateway.service import Gateway

    read_at = time.monotonic()
    config = load_config(args.config)
    if args.check:
        print(f"{args.config}: ok ({len(config.pools)} pools, {len(config.models)} models)")
        return 0
    host = args.host or config.listen.host
    port = args.port if args.port is not None else config.listen.port
    gateway = Gateway(config)

    def reload() -> None:
        try:
            gateway.reload(load_config(args.config))
            logger.info("reloaded %s", args.config)
        except Exception as e:  # a bad file keeps the running config
            logger.error("reload of %s failed, keeping the running config: %s", args.config, e)

    def on_startup() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
        if any(t >= read_at for t in held):  # the file may have changed after it was read
            reload()

    app = create_app(gateway, on_startup=on_startup)
    level = logging.getLevelName(logging.getLogger().level).lower()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=level, access_log=False))
    logger.info("gateway on http://%s:%d: models %s", host, port, gateway.state.router.names())
    server.run()
    return 0
