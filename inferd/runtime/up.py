"""`inferd up`: a fleet spec run on this machine, the gateway, replica processes and the autoscaler loop.

The gateway finds each pool's replicas in a list file (`replicas_file`) that this loop rewrites: a
replica is listed once its `/health` answers (the model is loaded), and unlisted before it is stopped,
so the gateway never sends a request to a replica that is starting or leaving. A request that arrives
while a pool lists no replica waits in the gateway's queue until one is ready (scale from zero, or the
first start). A replica leaving is unlisted, given the gateway's scrape interval to notice, then sent
SIGTERM and drains what it still runs (`inferd serve --drain-timeout`).

Every `interval_s` of a pool's policy, the loop reads the pool's signals (from the replicas' `/metrics`,
or from Prometheus), asks the pool's `PoolAutoscaler` and starts or stops replicas to match. A replica
that is loading is counted but is not capacity, and is never the one stopped. Cold starts (process start
to ready) are measured; every scaling event and cold start goes to the status lines and `summary.json`.

A disaggregated model (a prefill pool and a decode pool) also gets an `inferd disagg proxy` in front of
its pools, which the gateway sends its requests to; the two pools scale separately, each with its own
policy, and the proxy and the decode replicas follow them through list files (`inferd/runtime/disagg.py`).

Ctrl-C or SIGTERM: the gateway stops first (finishing the requests it holds), then the disaggregation
proxies, then the replicas drain, then Prometheus if this started it. Killed any other way (SIGKILL, a
crash, the OOM killer), `inferd up` runs none of that, so every child is started with a parent-death
signal (`inferd.procs.die_with_parent`): the kernel sends each SIGTERM the moment `inferd up` is gone,
and each stops as on an ordinary stop, the replicas draining for at most their `--drain-timeout`. Children
are started only from the thread that runs the loop, which ends after the shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml
from prometheus_client import Gauge, start_http_server

from inferd.autoscale.policy import Decision, FleetAutoscaler
from inferd.autoscale.prom import PrometheusProcess, start_prometheus, write_targets
from inferd.autoscale.signals import DirectSource, Measured, PrometheusError, PrometheusSource, buckets_around
from inferd.fleet.spec import AutoscalingPolicy, FleetSpec, ModelSpec, PoolSpec
from inferd.procs import die_with_parent, free_port
from inferd.runtime.disagg import (
    LEASE_WAIT_S,
    SECRET_ENV,
    DisaggFront,
    kv_secret,
    leases_active,
    scraped_samples,
    scraped_value,
    write_list,
)

logger = logging.getLogger(__name__)

# the server's defaults (inferd/server/metrics.py), refined around the targets a policy sets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]


@dataclass
class UpOptions:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int | None = None  # the gateway's; None: the spec's gateway.listen.port
    prometheus: str | None = None  # None: scrape replicas directly; "start": run one; else its URL
    prometheus_port: int = 9090
    metrics_port: int | None = None  # where the autoscaler's gauges are served (None: nowhere)
    drain_timeout_s: float = 30.0
    status_every_s: float = 5.0
    python: str = sys.executable
    log_level: str = "WARNING"


@dataclass(eq=False)
class ReplicaProc:
    pool: str
    port: int
    popen: subprocess.Popen
    started: float
    log: Path
    kv_port: int | None = None  # a prefill replica's KV channel
    state: str = "loading"  # loading -> ready -> draining
    ready_at: float | None = None
    term_at: float | None = None  # draining: when SIGTERM is due
    kill_at: float | None = None  # draining, SIGTERM sent: when SIGKILL is due

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cold_start_s(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.started


@dataclass
class PoolRun:
    model: ModelSpec
    spec: PoolSpec
    replicas_file: Path
    replicas: list[ReplicaProc] = field(default_factory=list)
    next_decision: float = 0.0
    last: Measured | None = None
    last_decision: Decision | None = None
    replica_seconds: float = 0.0

    def count(self, state: str) -> int:
        return sum(r.state == state for r in self.replicas)

    def serving(self) -> list[ReplicaProc]:
        return [r for r in self.replicas if r.state == "ready"]

    @property
    def policy(self) -> AutoscalingPolicy | None:
        return self.spec.autoscaling


def replica_argv(
    spec: FleetSpec,
    run: PoolRun,
    port: int,
    opts: UpOptions,
    kv_port: int | None = None,
    front: DisaggFront | None = None,
) -> list[str]:
    """`inferd serve` for one replica; a prefill replica's KV channel on `kv_port`, a decode replica
    admitting the channels in `front`'s peers file (the KV secret comes in the environment)."""
    argv = [opts.python, "-m", "inferd.cli", "--log-level", opts.log_level, "serve"]
    argv += spec.serve_argv(run.model, run.spec) + ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--drain-timeout", f"{opts.drain_timeout_s:g}"]
    if run.spec.role == "prefill" and kv_port is not None:
        argv += ["--kv-host", "127.0.0.1", "--kv-port", str(kv_port)]
    if run.spec.role == "decode" and front is not None:
        argv += ["--kv-peers-file", str(front.peers_file)]
    t = run.policy.targets if run.policy else None
    if t is not None and (t.ttft_p95_s or t.predicted_ttft_s):
        fine = buckets_around([x for x in (t.ttft_p95_s, t.predicted_ttft_s) if x], TTFT_BUCKETS)
        argv += ["--ttft-buckets", ",".join(f"{b:g}" for b in fine)]
    if t is not None and t.itl_p95_s:
        argv += ["--itl-buckets", ",".join(f"{b:g}" for b in buckets_around([t.itl_p95_s], ITL_BUCKETS))]
    return argv


def gateway_queue(url: str, client: httpx.Client) -> float:
    """Requests waiting at the gateway (its `inferd_gateway_queue_size`); 0 if it does not answer."""
    return scraped_value(client, url, "inferd_gateway_queue_size")


def cache_worths(url: str, client: httpx.Client) -> dict[str, float]:
    """What each replica's cache is worth to the traffic at the gateway (`inferd_gateway_replica_cache_worth_tokens`:
    tokens of prefixes asked for lately that only it holds) by replica URL; empty if the gateway does not answer."""
    samples = scraped_samples(client, url, "inferd_gateway_replica_cache_worth_tokens", timeout=2.0)
    return {s.labels["replica"]: s.value for s in samples}


def drain_order(replicas: list[ReplicaProc], worths: dict[str, float]) -> list[ReplicaProc]:
    """Which replicas a scale-down stops first: the least cache worth (`worths`, tokens by URL; one the gateway
    has no figure for counts 0), the newest first among equals."""
    return sorted(replicas, key=lambda r: (worths.get(r.url, 0.0), -r.started))


class LocalFleet:
    def __init__(self, spec: FleetSpec, opts: UpOptions, say: Callable[[str], None] = print):
        self.spec, self.opts, self.say = spec, opts, say
        self.dir = opts.state_dir
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.pools = {p.name: PoolRun(m, p, self.dir / f"{p.name}.replicas") for m, p in spec.pools()}
        self.fronts: dict[str, DisaggFront] = {}  # pool name -> its model's proxy (disaggregated models)
        for m in spec.models:
            if m.disaggregated:
                roles = {p.role: p.name for p in m.pools}
                front = DisaggFront(m.name, roles["prefill"], roles["decode"], self.dir)
                self.fronts[front.prefill_pool] = self.fronts[front.decode_pool] = front
        self.env = {**os.environ, SECRET_ENV: kv_secret()} if self.fronts else None
        self.autoscaler = FleetAutoscaler({n: r.policy for n, r in self.pools.items() if r.policy is not None})
        reg = self.autoscaler.registry
        self.replica_gauge = Gauge("inferd_fleet_replicas", "Replicas by state.", ["pool", "state"], registry=reg)
        self.client = httpx.Client(timeout=2.0)
        self.gateway: subprocess.Popen | None = None
        self.prom: PrometheusProcess | None = None
        self.source: DirectSource | PrometheusSource | None = None
        self.events: list[dict] = []
        self.t0 = time.monotonic()
        self._last_status = 0.0
        self._last_tick = self.t0
        self.gateway_url = ""
        self._http = None
        self.unlist_grace_s = 1.5

    # -- start ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self.t0 = self._last_tick = time.monotonic()
        for run in self.pools.values():
            self._publish(run)
        if self.opts.metrics_port is not None:
            self._http = start_http_server(self.opts.metrics_port, addr="127.0.0.1", registry=self.autoscaler.registry)
        self._start_prometheus()
        for front in self.proxies():
            self._start_proxy(front)
        self._start_gateway()
        for run in self.pools.values():
            for _ in range(run.spec.replicas):
                self._start_replica(run)

    def proxies(self) -> list[DisaggFront]:
        return list(dict.fromkeys(self.fronts.values()))

    def _start_proxy(self, front: DisaggFront) -> None:
        front.start(free_port(), self._spawn, self.opts.python, self.opts.log_level)
        self._publish(self.pools[front.decode_pool])
        self.say(f"disaggregation proxy of {front.model} on {front.url} (prefill and decode pools follow their lists)")

    def _window(self) -> float:
        return min((r.policy.window_s for r in self.pools.values() if r.policy), default=30.0)

    def _start_prometheus(self) -> None:
        p = self.opts.prometheus
        if p is None:
            self.source = DirectSource(self._window())
            return
        if p == "start":
            extra = [f"127.0.0.1:{self.opts.metrics_port}"] if self.opts.metrics_port is not None else []
            interval = max(0.5, min((r.policy.interval_s for r in self.pools.values() if r.policy), default=5) / 2)
            self.prom = start_prometheus(self.dir / "prometheus", self.opts.prometheus_port, interval, extra)
            p = self.prom.url
            self.say(f"prometheus on {p} (scraping every {interval:g}s)")
        self.source = PrometheusSource(p, self._window())

    def gateway_endpoints(self) -> dict[str, dict[str, str]]:
        """Each front pool's list file; a disaggregated model's front is its proxy (`<decode pool>.front`)."""
        endpoints = {n: {"replicas_file": str(r.replicas_file)} for n, r in self.pools.items()}
        for front in self.proxies():
            endpoints[front.decode_pool] = {"replicas_file": str(front.front_file)}
        return endpoints

    def _start_gateway(self) -> None:
        cfg = self.spec.gateway_config(self.gateway_endpoints())
        port = self.opts.port if self.opts.port is not None else cfg.listen.port
        cfg.listen.host, cfg.listen.port = self.opts.host, port
        self.unlist_grace_s = 2 * cfg.scrape.interval_s + 0.5  # the gateway re-reads lists each scrape round
        path = self.dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        argv = [self.opts.python, "-m", "inferd.cli", "--log-level", self.opts.log_level, "gateway"]
        argv += ["--config", str(path)]
        self.gateway = self._spawn(argv, self.dir / "logs" / "gateway.log")
        host = "127.0.0.1" if self.opts.host in ("0.0.0.0", "::") else self.opts.host
        self.gateway_url = f"http://{host}:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                tail = (self.dir / "logs" / "gateway.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the gateway exited:\n{tail}")
            try:
                self.client.get(self.gateway_url + "/metrics")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        self.say(f"gateway on {self.gateway_url} (models: {', '.join(m.name for m in self.spec.models)})")

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen:
        """A child in its own session (a Ctrl-C at the terminal reaches `inferd up` alone, which stops the
        fleet in order) that ends when `inferd up` ends, whatever ends it."""
        f = log.open("ab")
        try:
            return subprocess.Popen(
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
                preexec_fn=die_with_parent(),
            )
        finally:
            f.close()

    def _start_replica(self, run: PoolRun) -> None:
        port = free_port()
        log = self.dir / "logs" / f"{run.spec.name}-{port}.log"
        front = self.fronts.get(run.spec.name)
        kv_port = free_port() if run.spec.role == "prefill" else None
        if kv_port is not None:  # admitted by the decode replicas before it can hand out a lease
            front.publish_peers([r.kv_port for r in run.replicas] + [kv_port])
        popen = self._spawn(replica_argv(self.spec, run, port, self.opts, kv_port, front), log)
        run.replicas.append(ReplicaProc(run.spec.name, port, popen, time.monotonic(), log, kv_port))

    # -- the loop ------------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        for run in self.pools.values():
            live = sum(r.state != "draining" for r in run.replicas)
            run.replica_seconds += live * (now - self._last_tick)
            self._poll_replicas(run, now)
        self._last_tick = now
        queued = gateway_queue(self.gateway_url, self.client)
        for front in self.proxies():
            self._poll_proxy(front)
        for run in self.pools.values():
            if now >= run.next_decision:
                run.next_decision = now + (run.policy.interval_s if run.policy else 1.0)
                self._decide(run, now, self._gateway_share(run, queued))
            for state in ("loading", "ready", "draining"):
                self.replica_gauge.labels(run.spec.name, state).set(run.count(state))
        if now - self._last_status >= self.opts.status_every_s:
            self._last_status = now
            self.say(self.status_line(queued))

    def _gateway_share(self, run: PoolRun, queued: float) -> float:
        """The gateway's queue is one for the front pools (`both`, `decode`): a lone one owns it; else those
        serving nothing share it. A prefill pool has no queue at the gateway (without it the decode replicas
        prefill): with no replica ready, it counts one request waiting while its model has requests, so a
        prefill pool scaled to zero comes back with the traffic."""
        if run.spec.role == "prefill":
            if run.serving():
                return 0.0
            decode = self.pools[self.fronts[run.spec.name].decode_pool]
            m = decode.last if decode.policy is not None and decode.last else self.measure(decode, time.monotonic())
            busy = m.waiting + m.running + m.request_rate + self._gateway_share(decode, queued) > 0
            return 1.0 if busy else 0.0
        fronts = [r for r in self.pools.values() if r.spec.role != "prefill"]
        if len(fronts) == 1:
            return queued
        empty = [r for r in fronts if not r.serving()]
        return queued / len(empty) if run in empty else 0.0

    def _poll_replicas(self, run: PoolRun, now: float) -> None:
        changed = False
        for r in list(run.replicas):
            if r.popen.poll() is not None:
                if r.state != "draining":
                    self._event(run, "replica_exited", f"{r.url} exited with {r.popen.returncode}; see {r.log}")
                run.replicas.remove(r)
                changed |= r.state == "ready" or r.kv_port is not None  # a prefill replica leaves the peers
            elif r.state == "loading" and self._healthy(r):
                r.state, r.ready_at = "ready", now
                self._event(run, "replica_ready", f"{r.url} ready, cold start {r.cold_start_s:.1f}s", r.cold_start_s)
                changed = True
            elif r.state == "draining" and r.kill_at is None and now >= r.term_at and self._leases_done(r, now):
                r.popen.send_signal(signal.SIGTERM)
                r.kill_at = now + self.opts.drain_timeout_s + 10
            elif r.state == "draining" and r.kill_at is not None and now >= r.kill_at:
                r.popen.kill()
        if changed:
            self._publish(run)

    def _leases_done(self, r: ReplicaProc, now: float) -> bool:
        """A prefill replica stops once no decode replica has a lease of it still to pull (or LEASE_WAIT_S)."""
        if r.kv_port is None or now >= r.term_at + LEASE_WAIT_S:
            return True
        return leases_active(self.client, r.url) == 0

    def _poll_proxy(self, front: DisaggFront) -> None:
        """A proxy that exited is started again (on a new port); meanwhile the gateway lists none."""
        if front.alive():
            return
        self._event(
            self.pools[front.decode_pool],
            "proxy_exited",
            f"the proxy of {front.model} exited ({front.popen.returncode}), starting it again; see {front.log}",
        )
        self._publish(self.pools[front.decode_pool])
        self._start_proxy(front)

    def _healthy(self, r: ReplicaProc) -> bool:
        try:
            return self.client.get(r.url + "/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def _publish(self, run: PoolRun) -> None:
        """Rewrite the pool's list for the gateway or the proxy (and for Prometheus): ready replicas only;
        for a disaggregated model also the KV peers (prefill) and the gateway's view of the proxy (decode)."""
        urls = [r.url for r in run.serving()]
        write_list(run.replicas_file, urls)
        front = self.fronts.get(run.spec.name)
        if front is not None and run.spec.role == "prefill":
            front.publish_peers([r.kv_port for r in run.replicas if r.kv_port is not None])
        elif front is not None:
            front.publish_front(bool(urls))
        if self.opts.prometheus is not None:
            targets = self.dir / "prometheus" / "targets"
            targets.mkdir(parents=True, exist_ok=True)
            write_targets(targets, run.spec.name, urls)

    def measure(self, run: PoolRun, now: float) -> Measured:
        try:
            return self.source.read(run.spec.name, [r.url for r in run.serving()], now)
        except PrometheusError as e:
            logger.warning("pool %s: no signals this round: %s", run.spec.name, e)
            return Measured()

    def _decide(self, run: PoolRun, now: float, queued: float) -> None:
        live = [r for r in run.replicas if r.state != "draining"]
        if run.policy is None:
            desired, current = run.spec.replicas, len(live)
        else:
            run.last = self.measure(run, now)
            s = run.last.signals(now - self.t0, run.count("ready"), run.count("loading"), queued)
            d = self.autoscaler.pools[run.spec.name].decide(s)
            run.last_decision = d
            desired, current = d.desired, d.current
            if desired != current:
                self._event(run, "scale", f"{current} -> {desired}: {d.reason} {d.per_signal}")
        for _ in range(desired - current):
            self._start_replica(run)
        if desired < current:
            self._drain(run, current - desired)

    def _drain(self, run: PoolRun, n: int) -> None:
        """Stop `n` ready replicas: unlisted now, SIGTERM once the gateway has seen the list. Cache-aware: the
        ones whose caches are worth least to the traffic go first (the gateway's `cache_worth`: tokens of the
        prefixes asked for lately that only that replica holds), so what traffic still uses stays cached and
        nothing is computed again that need not be; the newest among equals."""
        now = time.monotonic()
        worths = cache_worths(self.gateway_url, self.client)
        order = drain_order(run.serving(), worths)
        for r in order[:n]:
            r.state, r.term_at = "draining", now + self.unlist_grace_s
            worth = f", its cache holding {worths[r.url]:.0f} tokens no other replica does" if r.url in worths else ""
            self._event(run, "drain", f"stopping {r.url}{worth} (the least of the pool's {len(order)})")
        self._publish(run)

    def _event(self, run: PoolRun, kind: str, text: str, value: float | None = None) -> None:
        t = time.monotonic() - self.t0
        self.events.append({"t": round(t, 3), "pool": run.spec.name, "kind": kind, "text": text, "value": value})
        self.say(f"[{t:7.1f}s] {run.spec.name}: {text}")

    def status_line(self, queued: float) -> str:
        parts = [f"[{time.monotonic() - self.t0:7.1f}s] gateway queue {queued:g}"]
        for run in self.pools.values():
            m = run.last or Measured()
            ttft = f"{m.ttft_p95_s * 1000:.0f}ms" if m.ttft_p95_s is not None else "-"
            desired = run.last_decision.desired if run.last_decision else run.spec.replicas
            role = f" ({run.spec.role})" if run.spec.role != "both" else ""
            parts.append(
                f"{run.spec.name}{role}: {run.count('ready')} ready {run.count('loading')} loading"
                f" {run.count('draining')} draining (want {desired}), waiting {m.waiting:g} running {m.running:g}"
                f", TTFT p95 {ttft}"
            )
        return " | ".join(parts)

    # -- stop ----------------------------------------------------------------------------------------
    def run_until(self, stop: threading.Event) -> dict:
        try:
            self.start()
            while not stop.is_set():
                self.tick()
                stop.wait(0.25)
        finally:
            summary = self.shutdown()
        return summary

    def shutdown(self) -> dict:
        self.say("stopping: the gateway finishes its requests, then the replicas drain")
        wait = self.opts.drain_timeout_s + 10
        if self.gateway is not None:
            _terminate([self.gateway], wait)
        _terminate([f.popen for f in self.proxies() if f.popen is not None], wait)
        _terminate([r.popen for run in self.pools.values() for r in run.replicas], wait)
        if self.prom is not None:
            self.prom.stop()
        if self._http is not None:
            self._http[0].shutdown()
        for s in (self.source, self.client):
            if s is not None:
                s.close()
        summary = self.summary()
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.say(
            "cold starts: "
            + (", ".join(f"{c:.1f}s" for c in summary["cold_starts_s"]) or "none")
            + f"; replica-hours {sum(summary['replica_hours'].values()):.4f}; summary in {self.dir / 'summary.json'}"
        )
        return summary

    def summary(self) -> dict:
        colds = [e["value"] for e in self.events if e["kind"] == "replica_ready"]
        return {
            "duration_s": round(time.monotonic() - self.t0, 3),
            "cold_starts_s": [round(c, 3) for c in colds],
            "cold_start_mean_s": round(sum(colds) / len(colds), 3) if colds else None,
            "replica_hours": {n: round(r.replica_seconds / 3600, 6) for n, r in self.pools.items()},
            "pools": {n: {"model": r.model.name, "role": r.spec.role} for n, r in self.pools.items()},
            "proxies": {f.model: f.url for f in self.proxies()},
            "events": self.events,
            "options": {k: str(v) for k, v in asdict(self.opts).items()},
        }


def _terminate(procs: list[subprocess.Popen], wait_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def run_up(spec: FleetSpec, opts: UpOptions, say: Callable[[str], None] = print) -> dict:
    """Run until SIGINT or SIGTERM, then drain and stop everything; the run's summary."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet = LocalFleet(spec, opts, say)
    return fleet.run_until(stop)
