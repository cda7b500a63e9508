"""Ray Serve: the fleet's Serve application (`inferd/runtime/ray.py`) on a Ray of its own (`local_ray`), scaled
from one replica to two and back by inferd's policy, whose decisions it records, and routing by prefix."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from inferd.errors import InferdError
from inferd.fleet.spec import FleetSpec
from inferd.labs.base import Explanation, Lab, Measurement, lines
from inferd.labs.context import LabContext
from inferd.procs import child_env, complete, free_port

APP, ENGINE = "inferd", "engine-lab"  # the app and the pool's deployment as `inferd deploy ray` names them
MAX_SEQS, TARGET_WAITING = 4, 1  # per replica: more requests than MAX_SEQS wait, and the policy scales on waiting
CLIENTS = 10  # MAX_SEQS run on one replica, MAX_SEQS more wait there (max_ongoing_requests = 2 x), 2 at the ingress


def load(url: str, i: int, prompt_len: int, out_len: int, stop: threading.Event) -> list[int]:
    """Client `i` sending long completions back to back until `stop` is set: their status codes."""
    codes: list[int] = []
    while not stop.is_set():
        prompt = [16 + (i * 37 + len(codes) * 11 + k) % 400 for k in range(prompt_len)]
        codes.append(complete(url, prompt, out_len).status_code)
    return codes


def measure(ctx: LabContext) -> Measurement:
    try:
        from ray import serve

        from inferd.runtime import ray as rt
    except ImportError:
        raise InferdError("the Ray Serve lab needs Ray: pip install 'inferd[ray]'") from None
    # Serve 2.60 still reads metrics_interval_s, and warns at every parse of the config that it is deprecated
    warnings.filterwarnings("ignore", message="The `metrics_interval_s` field", category=DeprecationWarning)
    log = ctx.workdir / f"ray-decisions-{os.getpid()}-{time.time_ns()}.jsonl"
    # one pool of 1 to 2 replicas scaled on waiting requests, with windows of seconds (not a production policy's
    # minutes) and a scale-down delay longer than the routing phase, so both replicas serve it
    engine = {"max_model_len": 512, "kv_cache_memory": "32MiB", "max_num_seqs": MAX_SEQS, "num_threads": 1}
    engine |= {"attention_backend": "torch"} if ctx.quick else {}
    policy = dict(min_replicas=1, max_replicas=2, targets={"waiting": TARGET_WAITING}, interval_s=0.5, window_s=2.0)
    down = ctx.size(6.0, 20.0)
    policy |= dict(scale_up_stabilization_s=0.0, scale_down_stabilization_s=down, cooldown_s=down)
    pool = {"name": "lab", "replicas": 1, "resources": {"cpu": 1, "memory": "1Gi"}, "autoscaling": policy}
    fleet = FleetSpec.model_validate({"models": [{"name": "m", "model": ctx.model, "engine": engine, "pools": [pool]}]})
    app = rt.build(fleet, autoscaling=rt.recording(log))
    lens = ctx.size((16, 48), (32, 32))  # closed loop: the queue stays; the drain at the end is short
    shared = [[16 + (k * 13) % 400 for k in range(64)] + [16 + (i * 29 + k) % 400 for k in range(8)] for i in range(8)]
    env = {"PYTHONPATH": child_env()["PYTHONPATH"], "TOKENIZERS_PARALLELISM": "false"}
    started, stop = time.monotonic(), threading.Event()
    with rt.local_ray(free_port(), env_vars=env) as ray_run:
        n = {"ray_start_s": time.monotonic() - started}
        with rt.ReplicaWatch(ENGINE, time.time(), APP) as watch:
            serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/")], wait_for_applications_running=False)
            rt.wait_app_running(ctx.size(120, 300))
            n["load_start_s"] = time.time() - watch.t0
            with ThreadPoolExecutor(CLIENTS) as clients:
                loads = [clients.submit(load, ray_run.url, i, *lens, stop) for i in range(CLIENTS)]
                try:  # one replica loaded past its batch until Serve runs two
                    n["scaled_up_s"] = watch.wait_for(2, ctx.size(90, 300))
                finally:
                    stop.set()
            n["load_end_s"] = time.time() - watch.t0
            before = rt.replica_stats(ENGINE)  # then prompts sharing a prefix, one at a time: the prefix decides
            answers = [complete(ray_run.url, p, 2) for p in shared]
            after = rt.replica_stats(ENGINE)
            n["scaled_down_s"] = watch.wait_for(1, ctx.size(60, 120))
        decisions = rt.read_decisions(log, watch.t0)
    codes = [c for f in loads for c in f.result()] + [a.status_code for a in answers]
    counted = {r: s["requests"] - before.get(r, {}).get("requests", 0.0) for r, s in after.items()}
    named = Counter(a.headers.get("x-inferd-replica", "?") for a in answers)
    up = next((d for d in decisions if d["desired"] > d["current"]), {"t": -1.0, "waiting": 0.0, "desired": 0})
    down = next((d for d in decisions if d["t"] >= n["load_end_s"] and d["desired"] < d["current"]), {"t": -1.0})
    n |= dict(up_decision_s=up["t"], up_waiting=up["waiting"], up_desired=up["desired"], down_decision_s=down["t"])
    n |= dict(up_replica_start_s=n["scaled_up_s"] - max(up["t"], n["load_start_s"]), max_seqs=MAX_SEQS)
    n |= dict(affine_requests=len(shared), affine_max=max(counted.values(), default=0.0), load_clients=CLIENTS)
    n["affine_max_pct"] = 100 * n["affine_max"] / len(shared)
    n["header_mismatch"] = sum(abs(counted.get(r, 0.0) - named.get(r, 0)) for r in set(counted) | set(named))
    n |= dict(errors=sum(c != 200 for c in codes), requests=len(codes), target_waiting=TARGET_WAITING)
    n |= dict(ray_processes=len(ray_run.pids), ray_left=len(ray_run.left))
    return Measurement(n, {"decisions": decisions, "replicas": watch.changes}, {"clients": CLIENTS})


def explain(m: Measurement) -> Explanation:
    claims = [
        m.must(
            "up_desired >= 2",
            yes="Under load ({load_clients} clients, {max_seqs} running at a time) the policy saw {up_waiting} "
            "requests waiting (target {target_waiting} per replica) and asked for {up_desired} replicas at "
            "{up_decision_s} s; the second ran at {scaled_up_s} s, {up_replica_start_s} s later: a replica's start.",
            no="Under load the policy never asked for a second replica (it saw {up_waiting} waiting).",
        ),
        m.must(
            "down_decision_s >= load_end_s",
            yes="The load stopped at {load_end_s} s; the policy asked for one replica fewer at {down_decision_s} s "
            "and Serve removed it at {scaled_down_s} s, after the scale-down delay.",
            no="After the load stopped the policy made no scale-down decision.",
        ),
        m.must(
            "errors <= 0",
            yes="All {requests} requests were answered 200 while the pool scaled ({errors} errors).",
            no="{errors} of {requests} requests failed while the pool scaled.",
        ),
        m.must(
            "header_mismatch <= 0",
            yes="Each routed request was counted by the replica named in its answer ({header_mismatch} disagreements).",
            no="The replicas' counters and the answers' replica ids disagreed on {header_mismatch} requests.",
        ),
        m.decide(
            "affine_max_pct >= 75.0",
            yes="{affine_requests} prompts sharing a 64-token prefix went {affine_max_pct}% to one replica "
            "({affine_max}): the router follows the prefix to the KV cache holding it.",
            no="{affine_requests} prompts sharing a prefix were split, at most {affine_max_pct}% on one replica.",
        ),
        m.must(
            "ray_left <= 0",
            yes="Ray ran for the lab alone ({ray_processes} processes, up in {ray_start_s} s): {ray_left} outlived it.",
            no="{ray_left} of the {ray_processes} processes Ray started were still running after shutdown.",
        ),
    ]
    intro = "`inferd deploy ray` makes the fleet spec a Serve application: an engine deployment per pool, an OpenAI "
    intro += "ingress, a router scoring replicas by queue, KV cache and prefix, and inferd's own autoscaling policy; "
    intro += "here 1 to 2 replicas on a local Ray, times in seconds since the app was deployed."
    why = "Why it matters: on Ray the serving platform is Python code (a cache-aware router and a queue-based policy "
    why += "are a class each), at the price of a second control plane beside Kubernetes."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    n, dec, reps = m.numbers, m.series["decisions"], m.series["replicas"]
    t, end = [d["t"] for d in dec], max(n["scaled_down_s"], reps[-1][0]) + 1
    ys = {"waiting, summed over replicas": [d["waiting"] for d in dec]}
    ax = lines(fig, t, ys, ".", xlabel="seconds since deploy", ylabel="replicas / requests", title="Autoscaling")
    ax.step(t, [d["desired"] for d in dec], where="post", label="policy: desired (before bounds)")
    ax.step([r[0] for r in reps] + [end], [r[1] for r in reps] + [reps[-1][1]], where="post", label="running")
    ax.axvspan(n["load_start_s"], n["load_end_s"], color="grey", alpha=0.15, label="load")
    ax.legend()


LAB = Lab("ray-serve", "Ray Serve", measure, explain, plot)
