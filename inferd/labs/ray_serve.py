"""Ray Serve: the fleet's Ray Serve application (`inferd/runtime/ray.py`) run on a local Ray instance and scaled
by load from one engine replica to two and back. The lab records the autoscaling policy's decisions with
their times and the signals they rest on (the policy runs inside Serve's controller; the runtime's `recording`
hook has inferd's `PoolAutoscalingPolicy` write each decision to a file), Serve's replica count as it
followed them (the runtime's `ReplicaWatch`), and how the request router spread requests over the two
replicas, read from each replica's own request counter: by load for distinct prompts, by prefix for prompts
that share one.

Ray is started for the lab alone and stopped when the lab ends, on failure too, by the runtime's `local_ray`
(`address="local"`: never a cluster already running on the machine), which then checks that every process
Ray started is gone.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from inferd.errors import InferdError
from inferd.labs.base import Explanation, Lab, Measurement, decide
from inferd.labs.context import LabContext
from inferd.procs import complete

DEFINITION = (
    "Python-native serving on a Ray cluster: deployments of replicas composed in code, with request routing and "
    "autoscaling built in; where LLM serving meets general Python pipelines."
)
APP, POOL, MODEL = "inferd", "lab", "m"  # the app as `inferd deploy ray` names it
ENGINE = f"engine-{POOL}"  # the pool's deployment
MAX_SEQS = 4  # per replica: more concurrent requests than this wait, and waiting is what the policy scales on
TARGET_WAITING = 1  # per replica
CLIENTS = 10  # MAX_SEQS run on one replica, MAX_SEQS more wait there (max_ongoing_requests = 2 x), 2 at the ingress


def lab_fleet(ctx: LabContext):
    """One model, one pool of 1 to 2 replicas, scaled on waiting requests with short windows (seconds, not a
    production policy's minutes, so the lab sees both directions)."""
    from inferd.fleet.spec import FleetSpec

    engine: dict[str, Any] = {"max_model_len": 512, "kv_cache_memory": "32MiB", "max_num_seqs": MAX_SEQS}
    engine["num_threads"] = 1  # two replicas share this machine's cores
    if ctx.quick:
        engine["attention_backend"] = "torch"
    policy = {
        "min_replicas": 1,
        "max_replicas": 2,
        "targets": {"waiting": TARGET_WAITING},
        "interval_s": 0.5,
        "window_s": 2.0,
        "scale_up_stabilization_s": 0.0,
        # longer than the routing phase, so both replicas serve it; the default model's requests take longer
        "scale_down_stabilization_s": ctx.size(6.0, 20.0),
        "cooldown_s": ctx.size(6.0, 20.0),
    }
    pool = {"name": POOL, "replicas": 1, "resources": {"cpu": 1, "memory": "1Gi"}, "autoscaling": policy}
    return FleetSpec.model_validate(
        {"models": [{"name": MODEL, "model": ctx.model, "engine": engine, "pools": [pool]}]}
    )


def load_until(url: str, clients: int, prompt_len: int, out_len: int, until: threading.Event) -> list[int]:
    """`clients` threads sending long completions back to back until `until` is set; their status codes."""
    codes: list[int] = []

    def client(i: int) -> None:
        n = 0
        while not until.is_set():
            prompt = [16 + (i * 37 + n * 11 + k) % 400 for k in range(prompt_len)]
            codes.append(complete(url, prompt, out_len).status_code)
            n += 1

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client, i) for i in range(clients)]:
            f.result()
    return codes


def routed(url: str, prompts: list[list[int]], concurrency: int) -> tuple[dict[str, float], list[int], Counter]:
    """Send `prompts`; each replica's request counter before and after, the codes, the replicas that answered."""
    from inferd.runtime.ray import replica_stats

    before = replica_stats(ENGINE)
    with ThreadPoolExecutor(concurrency) as pool:
        responses = list(pool.map(lambda p: complete(url, p, 2), prompts))
    after = replica_stats(ENGINE)
    deltas = {rid: after[rid]["requests"] - before.get(rid, {}).get("requests", 0.0) for rid in after}
    seen = Counter(r.headers.get("x-inferd-replica", "?") for r in responses)
    return deltas, [r.status_code for r in responses], seen


# -- the lab ------------------------------------------------------------------------------------------------
@dataclass
class ScaleUp:
    """Load on one replica until Serve ran two; times in seconds since deploy."""

    load_start_s: float
    scaled_up_s: float
    load_end_s: float
    load_requests: int
    load_errors: int


@dataclass
class Routing:
    """How the router spread distinct prompts, and where prompts sharing a prefix went (replicas' own counters)."""

    spread_requests: int
    spread_max: float
    spread_min: float
    spread_replicas: int
    affine_requests: int
    affine_max: float
    affine_replicas: int
    affine_max_pct: float
    routing_errors: int
    header_mismatch: int


@dataclass
class Decisions:
    """The policy's first scale-up decision, and its first scale-down once the load stopped (-1: none)."""

    decisions: int
    up_decision_s: float
    up_waiting: float
    up_desired: int
    down_decision_s: float


def scale_up(ctx: LabContext, url: str, watch) -> ScaleUp:
    """Load one replica past its batch until Serve runs two."""
    prompt_len, out_len = ctx.size((16, 48), (32, 32))  # closed loop: the queue stays; the drain at the end is short
    codes: list[int] = []
    stop = threading.Event()
    loader = threading.Thread(target=lambda: codes.extend(load_until(url, CLIENTS, prompt_len, out_len, stop)))
    load_start = time.time() - watch.t0
    loader.start()
    try:
        scaled_up = watch.wait_for(2, ctx.size(90, 300))
    finally:
        stop.set()
        loader.join(timeout=180)
    errors = sum(c != 200 for c in codes)
    return ScaleUp(load_start, scaled_up, time.time() - watch.t0, len(codes), errors)


def routing(url: str) -> tuple[Routing, dict[str, dict[str, float]]]:
    """Over the two replicas: distinct prompts (load decides), then prompts sharing a prefix (the cache decides)."""
    distinct = [[16 + (i * 53 + k * 7) % 400 for k in range(32)] for i in range(16)]
    spread, spread_codes, spread_seen = routed(url, distinct, 4)
    head = [16 + (k * 13) % 400 for k in range(64)]
    shared = [head + [16 + (i * 29 + k) % 400 for k in range(8)] for i in range(8)]
    affine, affine_codes, affine_seen = routed(url, shared, 1)
    spread_counts = sorted(spread.values(), reverse=True) + [0.0]
    affine_max = max(affine.values(), default=0.0)
    r = Routing(
        spread_requests=len(distinct),
        spread_max=spread_counts[0],
        spread_min=spread_counts[1],
        spread_replicas=sum(1 for v in spread.values() if v > 0),
        affine_requests=len(shared),
        affine_max=affine_max,
        affine_replicas=sum(1 for v in affine.values() if v > 0),
        affine_max_pct=100 * affine_max / len(shared),
        routing_errors=sum(c != 200 for c in spread_codes + affine_codes),
        header_mismatch=_mismatch(spread, spread_seen) + _mismatch(affine, affine_seen),
    )
    return r, {"spread": spread, "affine": affine}


def decided(decisions: list[dict], load_end: float) -> Decisions:
    up = next((d for d in decisions if d["desired"] > d["current"]), None)
    down = next((d for d in decisions if d["t"] >= load_end and d["desired"] < d["current"]), None)
    return Decisions(
        decisions=len(decisions),
        up_decision_s=up["t"] if up else -1.0,
        up_waiting=up["waiting"] if up else 0.0,
        up_desired=up["desired"] if up else 0,
        down_decision_s=down["t"] if down else -1.0,
    )


def measure(ctx: LabContext) -> Measurement:
    try:
        from ray import serve

        from inferd.runtime.ray import ReplicaWatch, build, local_ray, read_decisions, recording, wait_app_running
    except ImportError:
        raise InferdError("the Ray Serve lab needs Ray: pip install 'inferd[ray]'") from None
    from inferd.procs import child_env, free_port

    # Serve 2.60 still reads metrics_interval_s, and warns (at every parse of the config) that an environment
    # variable will replace it
    warnings.filterwarnings("ignore", message="The `metrics_interval_s` field", category=DeprecationWarning)
    spec = lab_fleet(ctx)
    log = ctx.workdir / f"ray-decisions-{os.getpid()}-{time.time_ns()}.jsonl"
    env = {"PYTHONPATH": child_env()["PYTHONPATH"], "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    n: dict[str, float] = {"max_seqs": MAX_SEQS, "target_waiting": TARGET_WAITING, "load_clients": CLIENTS}
    with local_ray(free_port(), env_vars=env) as ray_run:
        url = ray_run.url
        n["ray_start_s"] = time.monotonic() - started
        app = build(spec, autoscaling=recording(log))
        with ReplicaWatch(ENGINE, time.time(), APP) as watch:
            serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/")], wait_for_applications_running=False)
            n["first_replica_s"] = wait_app_running(ctx.size(120, 300)) - watch.t0
            up = scale_up(ctx, url, watch)
            n["routing_start_s"] = time.time() - watch.t0
            routes, per_replica = routing(url)
            n["idle_start_s"] = time.time() - watch.t0
            n["scaled_down_s"] = watch.wait_for(1, ctx.size(60, 120))
        decisions = read_decisions(log, watch.t0)
    policy = decided(decisions, up.load_end_s)
    n |= asdict(up) | asdict(routes) | asdict(policy)
    n["routing_replicas_min"] = min(watch.count_between(n["routing_start_s"], n["idle_start_s"]))
    n["up_replica_start_s"] = up.scaled_up_s - max(policy.up_decision_s, up.load_start_s)
    n["errors"] = up.load_errors + routes.routing_errors
    n["requests"] = up.load_requests + routes.spread_requests + routes.affine_requests
    n["ray_processes"], n["ray_left"] = len(ray_run.pids), len(ray_run.left)
    n["lab_s"] = time.monotonic() - started
    settings = {"model": ctx.model_label, "fleet": spec.model_dump(mode="json"), "clients": CLIENTS}
    series = {"decisions": decisions, "replicas": watch.changes, **per_replica}
    return Measurement(numbers=n, series=series, settings=settings)


def _mismatch(counted: dict[str, float], seen: Counter) -> int:
    """Requests on which a replica's own counter and the replica named in the answers' headers disagree."""
    return int(sum(abs(counted.get(rid, 0.0) - seen.get(rid, 0)) for rid in set(counted) | set(seen)))


def explain(m: Measurement) -> Explanation:
    n = m.numbers
    claims = [
        m.decide(
            "up_desired >= 2",
            must=True,
            yes="Under load ({load_clients} clients sending long completions to one replica that runs {max_seqs} at "
            "a time) the policy saw {up_waiting} requests waiting against a target of {target_waiting} per replica "
            "and asked for {up_desired} replicas at {up_decision_s} s (ceil(waiting / target); Serve caps it at "
            "the pool's maximum, 2); the second replica was running at {scaled_up_s} s, {up_replica_start_s} s "
            "later: what starting a replica and loading the model costs before scaling relieves a queue.",
            no="Under load the policy never asked for a second replica (it saw {up_waiting} waiting).",
        ),
        m.decide(
            "down_decision_s >= load_end_s",
            must=True,
            yes="When the load stopped (at {load_end_s} s; the routing requests below came a few at a time) the "
            "signals fell and the policy asked for one replica fewer at {down_decision_s} s; Serve removed it at "
            "{scaled_down_s} s, after the scale-down delay (the policy's stabilisation window and cooldown), and "
            "kept the pool's minimum of one.",
            no="After the load stopped the policy made no scale-down decision.",
        ),
        m.decide(
            "errors <= 0",
            must=True,
            yes="All {requests} requests were answered 200 while a replica was added and removed ({errors} errors).",
            no="{errors} of {requests} requests failed while the pool scaled.",
        ),
        m.decide(
            "header_mismatch <= 0",
            must=True,
            yes="Routing, read from the replicas' own request counters: each of the {spread_requests} + "
            "{affine_requests} requests below was counted by the replica whose id came back in its answer "
            "(disagreements: {header_mismatch}).",
            no="The replicas' counters and the answers' replica ids disagreed on {header_mismatch} requests.",
        ),
        spread_claim(n),
        m.decide(
            "affine_max_pct >= 75.0",
            yes="{affine_requests} prompts sharing a 64-token prefix went {affine_max_pct}% to one replica "
            "({affine_max} of {affine_requests}): the router sends a prefix to the replica whose KV cache holds "
            "it, as inferd's gateway does.",
            no="{affine_requests} prompts sharing a prefix were split, at most {affine_max_pct}% on one replica: "
            "load outweighed prefix affinity here.",
        ),
        m.decide(
            "ray_left <= 0",
            must=True,
            yes="Ray was started for the lab alone ({ray_processes} processes by the end, up in {ray_start_s} s) and "
            "shut down when it ended: {ray_left} of them left running.",
            no="{ray_left} of the {ray_processes} processes Ray started were still running after shutdown.",
        ),
    ]
    intro = [
        "`inferd deploy ray` turns the fleet spec into a Serve application: an engine deployment per pool whose "
        "replicas run inferd's engine and OpenAI server in-process, an OpenAI ingress, a request router that "
        "scores replicas with the gateway's scorers (queue, KV cache, prefix), and a custom autoscaling policy "
        "that is inferd's own (replicas = ceil(fleet total / per-replica target), the largest over targets). This "
        "lab ran it on a local Ray instance with a pool of 1 to 2 replicas scaled on waiting requests, with "
        "windows of seconds instead of a production policy's minutes; times are seconds since the app was "
        "deployed.",
    ]
    why = [
        "Why it matters: on Ray the serving platform is Python code: a router that knows KV caches and prefixes "
        "and a policy that scales on queues instead of CPU are a class each, and Ray places and restarts the "
        "replicas. The price is a second control plane (Ray's) beside Kubernetes, and a scale-up that helps only "
        "after a replica has loaded its model."
    ]
    return Explanation(intro, claims, why)


def spread_claim(n: dict[str, float]):
    """Distinct prompts over the pool; where it went to one replica, why: no queue to avoid, or a pool that had
    already shrunk (the scale-down delay ran out during the routing phase on a busy machine)."""
    if n["routing_replicas_min"] < 2:
        why = "the pool was down to {routing_replicas_min} running replica during the routing phase"
    else:
        why = "at this load the router saw no queue worth avoiding"
    return decide(
        n,
        "spread_replicas >= 2",
        yes="{spread_requests} distinct prompts, 4 at a time, went to {spread_replicas} replicas ({spread_max} and "
        "{spread_min}): with no prefix to follow, the router's queue and KV scorers spread the load.",
        no="{spread_requests} distinct prompts, 4 at a time, all went to {spread_replicas} replica ({spread_max}): "
        + why
        + ".",
        textbook=False,
    )


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2, width_ratios=[2, 1])
    n, dec, reps = m.numbers, m.series["decisions"], m.series["replicas"]
    if dec:
        t = [d["t"] for d in dec]
        a.plot(t, [d["waiting"] for d in dec], ".", label="waiting, summed over replicas", color="C2", alpha=0.5)
        a.step(t, [d["desired"] for d in dec], where="post", label="policy: desired (before bounds)", color="C1")
        a.step(t, [d["target"] for d in dec], where="post", label="Serve: target", color="C3", ls="--")
    if reps:
        end = max(n["scaled_down_s"], reps[-1][0]) + 1
        a.step([r[0] for r in reps] + [end], [r[1] for r in reps] + [reps[-1][1]], where="post", label="running")
    a.axvspan(n["load_start_s"], n["load_end_s"], color="grey", alpha=0.15, label="load")
    a.set(xlabel="seconds since deploy", ylabel="replicas / requests", title="Autoscaling decisions")
    a.legend(fontsize=8)
    ids = sorted(set(m.series["spread"]) | set(m.series["affine"]))
    x = range(len(ids))
    b.bar([i - 0.2 for i in x], [m.series["spread"].get(r, 0) for r in ids], width=0.4, label="distinct prompts")
    b.bar([i + 0.2 for i in x], [m.series["affine"].get(r, 0) for r in ids], width=0.4, label="shared prefix")
    b.set(xticks=list(x), xticklabels=[f"replica {r[:6]}" for r in ids], ylabel="requests (replica's own counter)")
    b.set_title("Routing over two replicas")
    b.legend(fontsize=8)


LAB = Lab("ray-serve", "Ray Serve", DEFINITION, measure, explain, plot)
