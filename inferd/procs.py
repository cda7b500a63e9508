"""inferd's own commands as child processes on loopback: `inferd serve` replicas, an `inferd gateway`, or any
command; each on a free port, waited for with a deadline, stopped with SIGTERM (then SIGKILL), its output in a
log file that an error quotes.

The tests, the benchmarks and the labs all start real servers; this is the one launcher they share. A child
imports the same inferd as its parent: the checkout this module lives in goes first on its PYTHONPATH.
`start_proxy` puts `inferd disagg proxy` in front of prefill and decode servers, `gateway_config` one pool
behind a gateway, and `complete` sends one completion. `ProcGroup` starts servers of one model (replicas,
prefill and decode instances, proxies, gateways) and stops them together, or those of a `scoped` block at its
end; `Scrape` reads servers' /metrics before and after a block. `die_with_parent` is for a supervisor whose
children must not outlive it (`inferd up`); `run_bounded` runs a command that starts servers of its own (a
benchmark script) with a deadline; `rss` and `rss_samples` read what a process tree holds in memory.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]  # the folder holding the `inferd` package (a checkout or site-packages)


_HANDED_OUT: set[int] = set()
_PORTS_LOCK = threading.Lock()


def exit_on_sigterm() -> None:
    """End this process on SIGTERM with SystemExit (exit status 143, as a shell reports a SIGTERM) rather
    than at once, so its `finally` blocks run: the servers it started are stopped, its shared memory closed."""
    signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, and never one this process handed out before: a server started on an
    earlier one may not have bound it yet (it loads a model first), and the OS may offer it again, which once
    put a lab's disaggregation proxy on its own prefill instance's port."""
    with _PORTS_LOCK:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError(f"no free port on {host} that this process has not handed out already")


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send the child `sig` when its parent ends, however it ends: SIGKILL,
    a crash or the OOM killer included, none of which runs the parent's own clean-up (Linux's
    PR_SET_PDEATHSIG; None elsewhere, where children outlive a killed parent).

    The kernel sends it when the *thread* that forked the child ends, not the process: spawn from a thread
    that lives as long as the children should (the main thread, or the supervisor's loop). libc's prctl is
    looked up here, in the parent, so the child between fork and exec makes that one call and a getppid:
    if the parent was already gone by then, nobody would send the signal, so the child exits at once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    args = (ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(int(sig)), *(ctypes.c_ulong(0) for _ in range(3)))
    parent = os.getpid()

    def preexec() -> None:
        prctl(*args)
        if os.getppid() != parent:
            os._exit(128 + int(sig))

    return preexec


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port: int
    log: Path
    config_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def spawn(name: str, argv: list[str], port: int, log_dir: Path) -> Proc:
    log = log_dir / f"{name}-{port}.log"
    with log.open("wb") as f:
        popen = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, start_new_session=True
        )
    return Proc(name, popen, port, log)


def wait_http(proc: Proc, path: str, timeout: float = 60.0) -> None:
    """Until `path` answers 200; kills the process and raises with its log if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            if httpx.get(proc.url + path, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f} s:\n{proc.log_tail()}")


def start_serve(model: str | Path, log_dir: Path, served_name: str, *extra: str) -> Proc:
    """`inferd serve` on one thread with a short drain (the caller waits for /health with `wait_http`)."""
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--served-model-name", served_name, "--num-threads", "1", "--drain-timeout", "1"]
    return spawn("replica", [*argv, *extra], port, log_dir)


def start_gateway(config: dict, log_dir: Path, port: int | None = None, timeout: float = 60.0) -> Proc:
    """`inferd gateway` with `config` (written as YAML beside the logs, at `proc.config_path`), ready on return."""
    port = port or free_port()
    path = log_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "gateway", "--config", str(path)]
    proc = spawn("gateway", argv, port, log_dir)
    proc.config_path = path
    wait_http(proc, "/metrics", timeout=timeout)
    return proc


def start_proxy(log_dir: Path, prefill: list[str], decode: list[str], *extra: str) -> Proc:
    """`inferd disagg proxy` in front of these prefill and decode servers (the caller waits for /health)."""
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "disagg", "proxy", "--port", str(port)]
    return spawn("proxy", [*argv, "--prefill", *prefill, "--decode", *decode, *extra], port, log_dir)


def gateway_config(urls: list[str], model: str = "m", **extra) -> dict:
    """An `inferd gateway` config: one pool of these servers behind the model name `model`, with fast probes;
    `extra` adds top-level sections (tenants, routing)."""
    return {
        "scrape": {"interval_s": 0.2, "stale_after_s": 2.0},
        "health": {"interval_s": 0.5, "timeout_s": 1.0},
        "request_timeout_s": 120,
        "pools": [{"name": "p", "replicas": list(urls), "model": model}],
        "models": [{"name": model, "backends": [{"pool": "p"}]}],
        **extra,
    }


def complete(url: str, prompt: str | list[int], max_tokens: int, *, timeout: float = 120, headers=None, **body):
    """A greedy completion from the model "m" of exactly `max_tokens` (eos ignored), not streamed; `body` adds
    to the request or overrides it (`model=` another name)."""
    base = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=base | body, headers=headers, timeout=timeout)


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {sample name: value}, labels summed."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


class Scrape:
    """Servers' /metrics read as the block starts and again as it ends (unless it raised): `rises(key)`, how much
    `key` rose on each server (a sample a server lacks counts as 0), and `rise(key)`, their sum."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls, self.before, self.after = list(urls), [], []

    def __enter__(self) -> Scrape:
        self.before = [metrics(u) for u in self.urls]
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.after = [metrics(u) for u in self.urls]

    def rises(self, key: str) -> list[float]:
        return [a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(self.after, self.before, strict=True)]

    def rise(self, key: str) -> float:
        return sum(self.rises(key))


def leases_released(prefill_url: str, timeout: float = 10.0) -> float:
    """Blocks a `--role prefill` server still lends after the decode side acknowledged (0 once every lease is
    released); waits up to `timeout` for the acknowledgements in flight."""
    deadline = time.monotonic() + timeout
    while (left := metrics(prefill_url).get("inferd:kv_leases_active", 0.0)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@dataclass
class ProcGroup:
    """Real servers of one model on loopback, each stopped by `close` (or by the end of the `scoped` block it
    was started in): `inferd serve` replicas served as `name` with `flags` first (later flags win), prefill and
    decode instances sharing a KV secret of the group's own, the disaggregation proxy and gateways. `replicas`
    keeps what it started for the next caller that asks for the same count and flags."""

    model: str | Path
    log_dir: Path
    flags: Sequence[str] = ()
    name: str = "m"
    start_timeout: float = 600.0  # a real model on a busy machine can take minutes to load
    kv_secret: str = field(default_factory=lambda: secrets.token_hex(16))  # loopback only, this group's
    _stops: list[Callable[[], None]] = field(default_factory=list)
    _replicas: dict[tuple, list[Proc]] = field(default_factory=dict)

    def started(self, proc: Proc) -> Proc:
        self._stops.append(proc.stop)
        return proc

    def serve(self, *extra: str) -> Proc:
        """An `inferd serve` (wait for it with `wait`)."""
        return self.started(start_serve(self.model, self.log_dir, self.name, *self.flags, *extra))

    def prefill(self, *extra: str) -> tuple[Proc, str]:
        """A `--role prefill` instance and its KV channel's host:port (a `decode` instance's peer)."""
        port = free_port()
        flags = ("--role", "prefill", "--kv-secret", self.kv_secret, "--kv-port", str(port))
        return self.serve(*flags, *extra), f"127.0.0.1:{port}"

    def decode(self, peers: list[str], *extra: str) -> Proc:
        return self.serve("--role", "decode", "--kv-secret", self.kv_secret, *extra, "--kv-peers", *peers)

    def proxy(self, prefill: list[Proc], decode: list[Proc]) -> Proc:
        """`inferd disagg proxy` in front of these instances."""
        return self.started(start_proxy(self.log_dir, [p.url for p in prefill], [d.url for d in decode]))

    def gateway(self, servers: list[Proc], **config) -> Proc:
        """`inferd gateway` with one pool of these servers behind `name` (`config`: more sections), ready."""
        config = gateway_config([s.url for s in servers], self.name, **config)
        return self.started(start_gateway(config, self.log_dir))

    def wait(self, *procs: Proc) -> None:
        for p in procs:
            wait_http(p, "/health", timeout=self.start_timeout)

    def replicas(self, count: int, *extra: str) -> list[Proc]:
        """`count` replicas with these flags, healthy: started once, and kept while they run."""
        procs = self._replicas.get((count, extra))
        if not procs or not all(p.alive() for p in procs):  # none yet, or stopped (a `scoped` block's end)
            procs = self._replicas[(count, extra)] = [self.serve(*extra) for _ in range(count)]
            self.wait(*procs)
        return procs

    def any_replicas(self) -> list[Proc]:
        """Replicas this group already started (any flags), or one new one."""
        return next(iter(self._replicas.values()), None) or self.replicas(1)

    @contextmanager
    def scoped(self) -> Iterator[None]:
        """Servers started inside the block are stopped when it ends, on failure too."""
        mark = len(self._stops)
        try:
            yield
        finally:
            while len(self._stops) > mark:
                self._stops.pop()()

    def close(self) -> None:
        while self._stops:
            self._stops.pop()()
        self._replicas.clear()

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _interrupt(proc: subprocess.Popen, grace_s: float) -> None:
    """Ctrl-C to the process group, so the command's own clean-up stops what it started; then a kill."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # ended meanwhile
        proc.wait()


def _sigint_by_default() -> None:
    """In a child before it runs its command: SIGINT taken by its default action and not blocked. A child inherits
    an ignored or blocked signal through exec (a library in this process may have set either), and a Python
    command that starts with SIGINT ignored never raises KeyboardInterrupt, so its clean-up would not run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def run_bounded(argv: list[str], log: Path, timeout_s: float, grace_s: float, cwd: Path = ROOT) -> int:
    """Run `argv` in its own process group, its output in `log`; its exit status. Past `timeout_s` (or when
    this process is interrupted) the group gets SIGINT, then SIGKILL `grace_s` later, and the timeout raises
    `subprocess.TimeoutExpired`: the command is never left running."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_sigint_by_default,  # two calls before exec: no lock a fork could have left held
        )
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:
        _interrupt(proc, grace_s)
        raise


def rss(pid: int) -> float:
    """Resident bytes of process `pid` and its children."""
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return float(total)


def _high_water(pid: int) -> float:
    """The kernel's high-water mark of the process's RSS (Linux; 0 elsewhere)."""
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    return 0.0


@contextmanager
def rss_samples(pid: int, every_s: float = 0.05) -> Iterator[list[float]]:
    """`rss(pid)` sampled every `every_s` while the block runs, into the list it yields; at the end the list
    also holds the kernel's high-water mark of `pid` itself, so its max is the peak a sample may miss."""
    seen = [rss(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            with suppress(Exception):  # the process ending under the sampler
                seen.append(rss(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join(timeout=5)
        seen.append(_high_water(pid))
