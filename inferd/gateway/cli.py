"""`inferd gateway --config gateway.yaml`: serve the gateway until SIGTERM/SIGINT; SIGHUP reloads the config.

A reload that fails validation is logged and changes nothing; one that passes is swapped in for new
requests while requests in flight, streams included, finish on the state they started with.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="route OpenAI requests across replicas and models, with budgets")
    p.add_argument("--config", required=True, help="the gateway's YAML config (see docs/gateway.md)")
    p.add_argument("--host", default=None, help="overrides listen.host")
    p.add_argument("--port", type=int, default=None, help="overrides listen.port")
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    p.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from inferd.gateway.app import create_app
    from inferd.gateway.config import load_config
    from inferd.gateway.service import Gateway

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

    app = create_app(gateway, on_startup=lambda: asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload))
    level = logging.getLevelName(logging.getLogger().level).lower()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=level, access_log=False))
    logger.info("gateway on http://%s:%d: models %s", host, port, gateway.state.router.names())
    server.run()
    return 0
