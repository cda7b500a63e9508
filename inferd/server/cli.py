"""`inferd serve`: load the engine, then serve it over HTTP until SIGTERM/SIGINT, draining on the way out.

Every flag is checked before the model loads, which takes seconds to minutes: a flag missing for the role,
given for another role, out of range or unreadable, or a port already taken, exits at once (status 2) with
what to change, and only the light modules are imported until then.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

import uvicorn

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    from inferd.config import add_engine_args
    from inferd.disagg.cli import add_serve_args
    from inferd.structured.tool_plan import TOOL_PARSERS

    p = subparsers.add_parser("serve", help="serve a model over the OpenAI API (default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API, /health and /metrics")
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) clients use for the model (default: --model)"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("INFERD_API_KEY"), help="require `Authorization: Bearer KEY` on the API"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=0,
        help="most sequences (prompts x n) waiting for the batch: 503 beyond, 400 for a request larger than it "
        "(0: no limit)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM; streams still running then get an error event",
    )
    p.add_argument(
        "--max-request-body",
        default="2MiB",
        help="largest request body, e.g. 8MiB; larger ones get 413 before they are read (0: no limit)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt in characters, refused (400) before tokenizing "
        "(default: max-model-len times the tokenizer's longest token, which no longer prompt can fit)",
    )
    for kind in ("ttft", "itl"):
        p.add_argument(
            f"--{kind}-buckets",
            type=_buckets,
            default=None,
            help=f"{kind.upper()} histogram bounds in seconds, e.g. 0.4,0.45,0.5,0.55 (default: vLLM's); "
            "fine around an SLO, quantiles estimated from the histogram are close (docs/autoscaling.md)",
        )
    p.add_argument(
        "--metrics-names",
        choices=["inferd", "vllm"],
        default="inferd",
        help="vllm: /metrics also exposes every metric under vLLM's vllm: names (llm-d's picker, KEDA, dashboards)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default="auto",
        help="how tool_choice auto reads calls from the text (docs/structured.md); auto: the model family's "
        "format where its chat template renders tools, else the pythonic format inferd teaches in a system prompt",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="an OpenTelemetry collector's OTLP/HTTP endpoint (e.g. http://localhost:4318): a span per request, "
        "vLLM's llm_request with queue, prefill and decode children, parented on the request's traceparent",
    )
    p.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="serve no /dashboard and record no step events (docs/dashboard.md)",
    )
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=run_serve)


def _buckets(text: str) -> list[float]:
    from inferd.server.metrics import parse_buckets

    try:
        return parse_buckets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _DrainingServer(uvicorn.Server):
    """uvicorn stops listening and waits for open responses on SIGTERM; we also stop taking new requests
    on connections still open and turn /health to 503 at once, so load balancers move away, and end the
    streams still running at the drain deadline with an error event (see ServerState.begin_drain)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def check_serve_flags(args: argparse.Namespace) -> None:
    """The server's own flags, before anything loads; raises ConfigError naming the flag."""
    from inferd.errors import ConfigError

    for flag, value in (
        ("--max-waiting-requests", args.max_waiting_requests),
        ("--drain-timeout", args.drain_timeout),
        ("--max-prompt-chars", args.max_prompt_chars),
        ("--max-request-body", _memory("--max-request-body", args.max_request_body)),
    ):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} {value:g}: must be 0 or more")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0 to 65535")
    if args.port:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET  # as uvicorn binds it
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((args.host, args.port))
            except OSError as e:
                raise ConfigError(
                    f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror})"
                ) from None


def _memory(flag: str, text: str) -> int:
    from inferd.config import parse_memory
    from inferd.errors import ConfigError

    try:
        return parse_memory(text)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None


def run_serve(args: argparse.Namespace) -> int:
    from inferd.config import engine_config_from_args, parse_memory
    from inferd.disagg.cli import disagg_settings

    config = engine_config_from_args(args)
    config.validate()
    disagg = disagg_settings(args)  # --role prefill|decode: the KV handoff (docs/disaggregation.md)
    check_serve_flags(args)

    from inferd.engine.engine import Engine
    from inferd.engine.kv_connector import attach_disagg
    from inferd.procs import exit_on_sigterm
    from inferd.server.app import create_app
    from inferd.server.state import ServerSettings

    engine = Engine(config)  # load first: the port opens (and /health answers 200) only once the model is ready
    connector = attach_disagg(disagg, engine)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model],
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        model_root=args.model,  # shown by its name, never as a local path
        max_request_body=parse_memory(args.max_request_body),
        max_prompt_chars=args.max_prompt_chars,
        drain_timeout=args.drain_timeout,
        ttft_buckets=args.ttft_buckets,
        itl_buckets=args.itl_buckets,
        metrics_names=args.metrics_names,
        dashboard=args.dashboard,
        tool_call_parser=args.tool_call_parser,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    app = create_app(engine, settings)
    if connector is not None:  # the handoff's metrics on /metrics
        app.state.inferd.metrics.registry.register(connector.collector(app.state.inferd.model_name))
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=logging.getLevelName(logging.getLogger().level).lower(),
        timeout_graceful_shutdown=args.drain_timeout,
        access_log=False,
    )
    server = _DrainingServer(uv_config, on_exit=app.state.inferd.begin_drain)
    logger.info("serving %s as %s on http://%s:%d", args.model, settings.served_model_names, args.host, args.port)
    # uvicorn drains, puts the default SIGTERM handler back and raises the signal again, which would end
    # the process before the `finally` below: end it with SystemExit instead (exit status 143, as a shell
    # reports a SIGTERM), so the KV connector's shared memory and channel are closed.
    exit_on_sigterm()
    try:
        server.run()
    finally:
        if connector is not None:
            connector.close()
        logger.info("stopped")
    return 0
