"""Ray Serve: the fleet's Serve application (`inferd/runtime/ray.py`) on a Ray of its own (`local_ray`), scaled
from one replica to two and back by inferd's policy, whose decisions it records, and routing by load and prefix."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from inferd.errors import InferdError
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.procs import child_env, complete, free_port

DEFINITION = (
    "Python-native serving on a Ray cluster: deployments of replicas composed in code, with request routing and "
    "autoscaling built in; where LLM serving meets general Python pipelines."
)
APP, ENGINE = "inferd", "engine-lab"  # the app and the pool's deployment as `inferd deploy ray` names them
MAX_SEQS, TARGET_WAITING = 4, 1  # per replica: more requests than MAX_SEQS wait, and the policy scales on waiting
CLIENTS = 10  # MAX_SEQS run on one replica, MAX_SEQS more wait there (max_ongoing_requests = 2 x), 2 at the ingress


def lab_fleet(ctx: LabContext):
    """One pool of 1 to 2 replicas scaled on waiting requests, with windows of seconds (not a production
    policy's minutes) and a scale-down delay longer than the routing phase, so both replicas serve it."""
    from inferd.fleet.spec import FleetSpec

    engine = {"max_model_len": 512, "kv_cache_memory": "32MiB", "max_num_seqs": MAX_SEQS, "num_threads": 1}
    engine |= {"attention_backend": "torch"} if ctx.quick else {}
    policy = dict(min_replicas=1, max_replicas=2, targets={"waiting": TARGET_WAITING}, interval_s=0.5, window_s=2.0)
    policy |= dict(scale_up_stabilization_s=0.0, scale_down_stabilization_s=ctx.size(6.0, 20.0))
    pool = {"name": "lab", "replicas": 1, "resources": {"cpu": 1, "memory": "1Gi"}, "autoscaling": policy}
    policy["cooldown_s"] = policy["scale_down_stabilization_s"]
    model = {"name": "m", "model": ctx.model, "engine": engine, "pools": [pool]}
    return FleetSpec.model_validate({"models": [model]})


def load_until(url: str, prompt_len: int, out_len: int, until: threading.Event) -> list[int]:
    """CLIENTS threads sending long completions back to back until `until` is set; their status codes."""
    codes: list[int] = []

    def client(i: int) -> None:
        n = 0
        while not until.is_set():
            prompt = [16 + (i * 37 + n * 11 + k) % 400 for k in range(prompt_len)]
            codes.append(complete(url, prompt, out_len).status_code)
            n += 1

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    return codes


def routed(url: str, prompts: list[list[int]], concurrency: int) -> tuple[list[float], int, int]:
    """Send `prompts`: the replicas' request counts over them (their own counters, most first), the failures,
    and the requests on which a counter and the replica named in the answer's header disagree."""
    from inferd.runtime.ray import replica_stats

    before = replica_stats(ENGINE)
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda p: complete(url, p, 2), prompts))
    counted = {r: s["requests"] - before.get(r, {}).get("requests", 0.0) for r, s in replica_stats(ENGINE).items()}
    named = Counter(a.headers.get("x-inferd-replica", "?") for a in answers)
    mismatch = sum(abs(counted.get(r, 0.0) - named.get(r, 0)) for r in set(counted) | set(named))
    return sorted(counted.values(), reverse=True) + [0.0], sum(a.status_code != 200 for a in answers), int(mismatch)


def measure(ctx: LabContext) -> Measurement:
    try:
        from ray import serve

        from inferd.runtime.ray import ReplicaWatch, build, local_ray, read_decisions, recording, wait_app_running
    except ImportError:
        raise InferdError("the Ray Serve lab needs Ray: pip install 'inferd[ray]'") from None
    # Serve 2.60 still reads metrics_interval_s, and warns at every parse of the config that it is deprecated
    warnings.filterwarnings("ignore", message="The `metrics_interval_s` field", category=DeprecationWarning)
    log = ctx.workdir / f"ray-decisions-{os.getpid()}-{time.time_ns()}.jsonl"
    app = build(lab_fleet(ctx), autoscaling=recording(log))
    prompt_len, out_len = ctx.size((16, 48), (32, 32))  # closed loop: the queue stays; the drain at the end is short
    distinct = [[16 + (i * 53 + k * 7) % 400 for k in range(32)] for i in range(16)]
    shared = [[16 + (k * 13) % 400 for k in range(64)] + [16 + (i * 29 + k) % 400 for k in range(8)] for i in range(8)]
    env = {"PYTHONPATH": child_env()["PYTHONPATH"], "TOKENIZERS_PARALLELISM": "false"}
    started, stop, codes = time.monotonic(), threading.Event(), []
    with local_ray(free_port(), env_vars=env) as ray_run:
        n = {"ray_start_s": time.monotonic() - started}
        with ReplicaWatch(ENGINE, time.time(), APP) as watch:
            serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/")], wait_for_applications_running=False)
            wait_app_running(ctx.size(120, 300))
            loader = threading.Thread(target=lambda: codes.extend(load_until(ray_run.url, prompt_len, out_len, stop)))
            n["load_start_s"] = time.time() - watch.t0
            loader.start()
            try:  # one replica loaded past its batch until Serve runs two
                n["scaled_up_s"] = watch.wait_for(2, ctx.size(90, 300))
            finally:
                stop.set()
                loader.join(timeout=180)
            n["load_end_s"] = time.time() - watch.t0
            spread, spread_errors, spread_mismatch = routed(ray_run.url, distinct, 4)  # load decides
            affine, affine_errors, affine_mismatch = routed(ray_run.url, shared, 1)  # the prefix decides
            n["idle_start_s"] = time.time() - watch.t0
            n["scaled_down_s"] = watch.wait_for(1, ctx.size(60, 120))
        decisions = read_decisions(log, watch.t0)
    up = next((d for d in decisions if d["desired"] > d["current"]), {"t": -1.0, "waiting": 0.0, "desired": 0})
    down = next((d for d in decisions if d["t"] >= n["load_end_s"] and d["desired"] < d["current"]), {"t": -1.0})
    n |= dict(up_decision_s=up["t"], up_waiting=up["waiting"], up_desired=up["desired"], down_decision_s=down["t"])
    n |= dict(up_replica_start_s=n["scaled_up_s"] - max(up["t"], n["load_start_s"]), max_seqs=MAX_SEQS)
    n |= dict(spread_requests=len(distinct), spread_max=spread[0], spread_min=spread[1], affine_max=affine[0])
    n |= dict(spread_replicas=sum(c > 0 for c in spread), affine_requests=len(shared), load_clients=CLIENTS)
    n |= dict(affine_max_pct=100 * affine[0] / len(shared), header_mismatch=spread_mismatch + affine_mismatch)
    n |= dict(errors=sum(c != 200 for c in codes) + spread_errors + affine_errors, target_waiting=TARGET_WAITING)
    n |= dict(
        requests=len(codes) + len(distinct) + len(shared), ray_processes=len(ray_run.pids), ray_left=len(ray_run.left)
    )
    n["routing_replicas_min"] = min(watch.count_between(n["load_end_s"], n["idle_start_s"]))
    return Measurement(
        numbers=n, series={"decisions": decisions, "replicas": watch.changes}, settings={"clients": CLIENTS}
    )


def explain(m: Measurement) -> Explanation:
    single = "the pool was down to {routing_replicas_min} replica by then"
    claims = [
        m.decide(
            "up_desired >= 2",
            must=True,
            yes="Under load ({load_clients} clients, {max_seqs} running at a time) the policy saw {up_waiting} "
            "requests waiting (target {target_waiting} per replica) and asked for {up_desired} replicas at "
            "{up_decision_s} s; the second ran at {scaled_up_s} s, {up_replica_start_s} s later: a replica's start.",
            no="Under load the policy never asked for a second replica (it saw {up_waiting} waiting).",
        ),
        m.decide(
            "down_decision_s >= load_end_s",
            must=True,
            yes="The load stopped at {load_end_s} s; the policy asked for one replica fewer at {down_decision_s} s "
            "and Serve removed it at {scaled_down_s} s, after the scale-down delay.",
            no="After the load stopped the policy made no scale-down decision.",
        ),
        m.decide(
            "errors <= 0",
            must=True,
            yes="All {requests} requests were answered 200 while the pool scaled ({errors} errors).",
            no="{errors} of {requests} requests failed while the pool scaled.",
        ),
        m.decide(
            "header_mismatch <= 0",
            must=True,
            yes="Each routed request was counted by the replica named in its answer ({header_mismatch} disagreements).",
            no="The replicas' counters and the answers' replica ids disagreed on {header_mismatch} requests.",
        ),
        m.decide(
            "spread_replicas >= 2",
            textbook=False,
            yes="{spread_requests} distinct prompts, 4 at a time, went to {spread_replicas} replicas ({spread_max} and "
            "{spread_min}): with no prefix to follow, the queue and KV scorers spread them.",
            no="{spread_requests} distinct prompts, 4 at a time, all went to {spread_replicas} replica: "
            + (single if m.numbers["routing_replicas_min"] < 2 else "the router saw no queue worth avoiding")
            + ".",
        ),
        m.decide(
            "affine_max_pct >= 75.0",
            yes="{affine_requests} prompts sharing a 64-token prefix went {affine_max_pct}% to one replica "
            "({affine_max}): the router follows the prefix to the KV cache holding it.",
            no="{affine_requests} prompts sharing a prefix were split, at most {affine_max_pct}% on one replica.",
        ),
        m.decide(
            "ray_left <= 0",
            must=True,
            yes="Ray ran for the lab alone ({ray_processes} processes, up in {ray_start_s} s) and was shut down: "
            "{ray_left} left running.",
            no="{ray_left} of the {ray_processes} processes Ray started were still running after shutdown.",
        ),
    ]
    intro = "`inferd deploy ray` turns the fleet spec into a Serve application: an engine deployment per pool, an "
    intro += "OpenAI ingress, a request router scoring replicas with the gateway's scorers (queue, KV cache, prefix) "
    intro += "and inferd's own autoscaling policy. Here a pool of 1 to 2 replicas scaled on waiting requests, on a "
    intro += "local Ray; times are seconds since the app was deployed."
    why = "Why it matters: on Ray the serving platform is Python code (a cache-aware router and a queue-based policy "
    why += "are a class each), at the price of a second control plane beside Kubernetes."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    ax, n, dec, reps = fig.subplots(), m.numbers, m.series["decisions"], m.series["replicas"]
    t = [d["t"] for d in dec]
    ax.plot(t, [d["waiting"] for d in dec], ".", label="waiting, summed over replicas", color="C2", alpha=0.5)
    ax.step(t, [d["desired"] for d in dec], where="post", label="policy: desired (before bounds)", color="C1")
    end = max(n["scaled_down_s"], reps[-1][0]) + 1
    ax.step([r[0] for r in reps] + [end], [r[1] for r in reps] + [reps[-1][1]], where="post", label="running")
    ax.axvspan(n["load_start_s"], n["load_end_s"], color="grey", alpha=0.15, label="load")
    ax.set(xlabel="seconds since deploy", ylabel="replicas / requests", title="Autoscaling decisions")
    ax.legend(fontsize=8)


LAB = Lab("ray-serve", "Ray Serve", DEFINITION, measure, explain, plot)
