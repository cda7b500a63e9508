"""`inferd simulate` (a policy tried on a workload), `inferd plan` (replicas and cost for SLOs at a rate),
`inferd profile` (measure a replica) and `inferd autoscaler` (the policy's desired replicas as a gauge, for
KEDA or Ray Serve). `inferd up`, which runs the policy on a local fleet, is `inferd.runtime.cli`'s."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    register_sim(subparsers)
    register_profile(subparsers)
    register_gauge(subparsers)


def parse_duration(text: str) -> float:
    t = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("s", 1.0)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * scale
    return float(t)


def parse_slos(items: list[str]):
    """`ttft_p95:500ms`, `itl_p95:50ms` (also `ttft:`, `tpot:`, `itl:`): per request and as the run's p95."""
    from inferd.autoscale.sim import SLO

    slo = SLO()
    for item in items:
        name, _, value = item.partition(":")
        try:
            seconds = parse_duration(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"SLO {item!r}: use e.g. ttft_p95:500ms") from None
        if name in ("ttft", "ttft_p95"):
            slo.ttft_s = slo.ttft_p95_s = seconds
        elif name in ("itl", "itl_p95", "tpot", "tpot_p95"):
            slo.tpot_s = slo.itl_p95_s = seconds
        else:
            raise argparse.ArgumentTypeError(f"SLO {item!r}: known are ttft_p95 and itl_p95 (or tpot)")
    return slo


def _workload_args(p) -> None:
    p.add_argument("--prompt-len", default="fixed:512", help="fixed:N, uniform:A:B, exponential:M, lognormal:M:S")
    p.add_argument("--output-len", default="fixed:128", help="as --prompt-len")
    p.add_argument("--slo", action="append", default=[], help="e.g. ttft_p95:500ms, itl_p95:50ms (repeatable)")
    p.add_argument("--price-per-hour", type=float, default=None, help="price of one replica-hour (an input)")
    p.add_argument("--seed", type=int, default=0)


def register_sim(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate a fleet and its autoscaling policy on a workload")
    p.add_argument("--profile", required=True, help="profile JSON (inferd profile) or an example's name")
    p.add_argument(
        "--trace",
        required=True,
        help="a trace file (CSV/JSONL: timestamp, prompt_tokens, output_tokens) or a generator: "
        "poisson:rate=5,duration=600 | gamma:rate=5,burstiness=0.3,duration=600 | "
        "diurnal:mean=4,peak_to_trough=4,duration=86400,bursts=6,burst_x=3,burst_s=600 | constant:rate=2,duration=60",
    )
    p.add_argument("--policy", default=None, help="fleet spec whose pool's autoscaling policy to use")
    p.add_argument("--pool", default=None, help="which pool of --policy (default: the first autoscaled)")
    p.add_argument("--replicas", type=int, default=None, help="a fixed fleet of this many (no --policy)")
    _workload_args(p)
    p.add_argument(
        "--shared-prefixes",
        default=None,
        metavar="N:TOKENS",
        help="each prompt starts with one of N shared prefixes of TOKENS tokens (Zipf-popular), added to --prompt-len",
    )
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="each replica's prefix cache (LRU), in tokens")
    p.add_argument("--routing", choices=("least_load", "prefix"), default="least_load", help="the gateway's choice")
    p.add_argument(
        "--victim",
        default="newest",
        help="which replica a scale-down drains: newest, random, cache_hits (fewest recent hits) or unique_recent "
        "(the least cache worth: tokens of recently asked prefixes only it holds, as the gateway ranks them)",
    )
    p.add_argument("--scale-down-at", type=float, default=None, help="drain one replica at this second")
    p.add_argument("--output-json", default=None, help="write the report and timeline here")
    p.add_argument("--plot", default=None, help="write a PNG of load, replicas and TTFT over time here")
    p.set_defaults(func=run_simulate)

    q = subparsers.add_parser("plan", help="replicas and cost per million tokens for SLOs at a request rate")
    q.add_argument("--profile", required=True, help="profile JSON (inferd profile) or an example's name")
    q.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    _workload_args(q)
    q.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    q.add_argument("--disaggregated", action="store_true", help="also size separate prefill and decode pools")
    q.add_argument("--requests", type=int, default=2000, help="requests per simulated run (more: steadier)")
    q.add_argument("--output-json", default=None)
    q.set_defaults(func=run_plan)


def _policy(args):
    from inferd.errors import ConfigError
    from inferd.fleet.spec import load_fleet

    if args.policy is None:
        return None, args.replicas or 1
    spec = load_fleet(args.policy)
    pools = [p for _, p in spec.pools() if args.pool in (None, p.name) and (p.autoscaling or args.pool)]
    if not pools:
        raise ConfigError(f"{args.policy}: no autoscaled pool" + (f" named {args.pool}" if args.pool else ""))
    return pools[0].autoscaling, args.replicas if args.replicas is not None else pools[0].replicas


def run_simulate(args: argparse.Namespace) -> int:
    import json

    from inferd.autoscale.profile import load_profile
    from inferd.autoscale.sim import Simulator
    from inferd.autoscale.workload import make_workload, with_shared_prefixes
    from inferd.errors import ConfigError

    profile = load_profile(args.profile)
    slo = parse_slos(args.slo)
    workload = make_workload(args.trace, args.prompt_len, args.output_len, args.seed)
    if args.shared_prefixes:
        try:
            count, tokens = (int(x) for x in args.shared_prefixes.split(":"))
        except ValueError:
            raise ConfigError(f"--shared-prefixes {args.shared_prefixes!r}: use N:TOKENS, e.g. 12:1024") from None
        workload = with_shared_prefixes(workload, count, tokens, seed=args.seed)
    policy, replicas = _policy(args)
    result = Simulator(
        profile,
        workload,
        policy,
        replicas,
        slo,
        args.price_per_hour,
        kv_cache_tokens=args.kv_cache_tokens,
        routing=args.routing,
        victim=args.victim,
        scale_down_at=args.scale_down_at,
        seed=args.seed,
    ).run()
    print(json.dumps(result.report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"report": result.report, "timeline": result.timeline}))
    if args.plot:
        from inferd.autoscale.plots import plot_runs

        plot_runs({"autoscaled" if policy else f"{replicas} fixed": result.timeline}, Path(args.plot), slo.ttft_s)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    import json

    from inferd.autoscale.plan import PlanInputs, format_plan, plan
    from inferd.autoscale.profile import load_profile
    from inferd.errors import ConfigError

    slo = parse_slos(args.slo)
    if args.price_per_hour is None:
        raise ConfigError("--price-per-hour is required: what one replica-hour costs you")
    if slo.ttft_p95_s is None and slo.itl_p95_s is None:
        raise ConfigError("give at least one --slo, e.g. --slo ttft_p95:500ms --slo itl_p95:50ms")
    inputs = PlanInputs(
        args.rate, slo, args.price_per_hour, args.prompt_len, args.output_len, args.burstiness, args.requests, args.seed
    )
    result = plan(load_profile(args.profile), inputs, disaggregated=args.disaggregated)
    print(format_plan(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


def register_profile(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure a running replica (prefill rate, decode step by batch)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the replica (not a gateway)")
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-lens", default="64,256,512", help="prompt lengths of the prefill runs")
    p.add_argument("--batches", default="1,2,4,8", help="concurrencies of the decode runs")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--requests-per-point", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=None, help="the replica's --max-num-seqs")
    p.add_argument("--cold-start-s", type=float, default=30.0, help="measured start-to-ready (inferd up reports it)")
    p.add_argument("--name", default="measured")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    import logging

    from inferd.autoscale.measure import ProfileRun, measure_profile

    logging.getLogger("httpx").setLevel(logging.WARNING)

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    run = ProfileRun(
        args.base_url,
        args.model,
        ints(args.prompt_lens),
        ints(args.batches),
        args.output_len,
        args.requests_per_point,
        args.max_num_seqs,
        args.cold_start_s,
        args.name,
    )
    profile = measure_profile(run)
    Path(args.out).write_text(profile.to_json())
    print(profile.to_json())
    return 0


def register_gauge(subparsers) -> None:
    p = subparsers.add_parser(
        "autoscaler", help="serve the policy's desired replicas per pool (for KEDA or Ray Serve) from Prometheus"
    )
    p.add_argument("--config", required=True, help="fleet spec with the pools' autoscaling policies")
    p.add_argument("--prometheus", required=True, help="Prometheus URL; replicas' series carry a `pool` label")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100, help="where /metrics serves inferd_autoscaler_desired_replicas")
    p.set_defaults(func=run_gauge)


def run_gauge(args: argparse.Namespace) -> int:
    import signal
    import threading

    from prometheus_client import start_http_server

    from inferd.autoscale.gauge import AutoscalerService
    from inferd.autoscale.signals import PrometheusSource
    from inferd.fleet.spec import load_fleet

    spec = load_fleet(args.config)
    window = min((p.autoscaling.window_s for _, p in spec.pools() if p.autoscaling), default=30.0)
    service = AutoscalerService(spec, PrometheusSource(args.prometheus, window))
    server, _ = start_http_server(args.port, addr=args.host, registry=service.fleet.registry)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"desired replicas of {sorted(service.policies)} on http://{args.host}:{args.port}/metrics", flush=True)
    try:
        service.run(stop)
    finally:
        server.shutdown()
    return 0
