"""`inferd up`: a fleet spec run on this machine (gateway, replica processes, autoscaler), see `up.py`."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="run a fleet spec here: gateway, replica processes and the autoscaler")
    p.add_argument("--config", required=True, help="fleet spec (YAML), see docs/autoscaling.md")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    p.add_argument("--port", type=int, default=None, help="the gateway's port (default: the spec's, else 9000)")
    p.add_argument(
        "--prometheus",
        default=None,
        help="read signals from this Prometheus URL (it must scrape the replicas with a `pool` label: the "
        "file_sd lists are written under STATE_DIR/prometheus/targets), or `start` to run one here; "
        "default: scrape the replicas directly",
    )
    p.add_argument("--prometheus-port", type=int, default=9090, help="with --prometheus start")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the autoscaler's gauges here")
    p.add_argument("--state-dir", default=None, help="replica lists, logs, summary.json (default: a temp dir)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds a stopping replica may finish in")
    p.add_argument("--status-every", type=float, default=5.0, help="seconds between status lines")
    p.set_defaults(func=run_up_command)


def run_up_command(args: argparse.Namespace) -> int:
    from inferd.fleet.spec import load_fleet
    from inferd.runtime.up import UpOptions, run_up

    spec = load_fleet(args.config)
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="inferd-up-"))
    opts = UpOptions(
        state_dir=state,
        host=args.host,
        port=args.port,
        prometheus=args.prometheus,
        prometheus_port=args.prometheus_port,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout,
        status_every_s=args.status_every,
    )
    run_up(spec, opts, say=lambda line: print(line, flush=True))
    return 0
