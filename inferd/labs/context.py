"""What every lab shares in one run: the model (loaded once per set of engine settings), this machine's
measured matmul peak and memory bandwidth, the model's shape in bytes and FLOPs (both from the measuring
library, `inferd.measure`, as the benchmarks take them), earlier labs' measurements (the cost lab
reuses the goodput lab's when both run), and the real servers labs start on loopback through `inferd.procs`
(`inferd serve`, its disaggregated roles, the proxy, the gateway), every one stopped when the run ends.

`--quick` swaps the default model for a tiny random-weight Llama built on the fly (`inferd.models.tiny`), so
every lab finishes in seconds; its numbers show the mechanics, not a real model's speed, and each lab's
text says which model it measured.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inferd.bench.client import send_all
from inferd.bench.datasets import BenchRequest
from inferd.bench.metrics import ttft
from inferd.bench.peers import home_path
from inferd.bench.results import machine_info
from inferd.config import DEFAULT_MODEL, engine_default
from inferd.errors import ConfigError
from inferd.measure.hardware import Hardware, measure_hardware
from inferd.measure.model import ModelFacts, model_facts
from inferd.procs import (
    Proc,
    free_port,
    gateway_config,
    metrics,
    start_gateway,
    start_proxy,
    start_serve,
    wait_http,
)

if TYPE_CHECKING:
    from inferd.engine.engine import LLM
    from inferd.labs.base import Measurement

KV_SECRET = "inferd-lab-kv-secret"  # loopback only, for this run's disaggregated instances
START_TIMEOUT = 600.0  # a real model on a busy machine can take minutes to load


def _is_default(name: str, value: Any) -> bool:
    """A setting equal to the engine's default (`engine_default`) is dropped, so `llm(attention_backend="auto")`
    is the same model as `llm()`."""
    try:
        return engine_default(name) == value
    except ConfigError:
        return False


def _scheduler_fields() -> set[str]:
    from dataclasses import fields

    from inferd.config import SchedulerConfig

    return {f.name for f in fields(SchedulerConfig)}


def _speculative_fields() -> set[str]:
    from dataclasses import fields

    from inferd.config import SpeculativeConfig

    return {f.name for f in fields(SpeculativeConfig)}


def _only_scheduler_differs(old: dict, new: dict) -> bool:
    changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    return changed <= _scheduler_fields() | _speculative_fields()


def _set_scheduler(llm: LLM, settings: dict) -> None:
    """Scheduling limits and speculative settings are read every step, so an idle engine takes new ones without
    reloading the model."""
    from inferd.config import SchedulerConfig, SpeculativeConfig

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("cannot change scheduler settings while requests run")
    config = SchedulerConfig(**{k: v for k, v in settings.items() if k in _scheduler_fields()})
    config.validate()
    engine.scheduler.config = config
    engine.set_speculative(SpeculativeConfig(**{k: v for k, v in settings.items() if k in _speculative_fields()}))


def describe_machine(device: str) -> dict:
    info = machine_info()
    info["device"] = device
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]  # read as a lab ends: its last minute
    return info


def machine_line(machine: dict) -> str:
    """'AMD EPYC, 2 cores, 23.5 GiB (cpu)': how the text and the docs name the machine."""
    cpu = machine.get("gpu") or machine.get("cpu_model") or machine.get("processor") or platform.machine()
    mem = f", {machine['memory_gib']} GiB" if "memory_gib" in machine else ""
    return f"{cpu}, {machine.get('cpu_count')} cores{mem} ({machine.get('device', 'cpu')})"


@dataclass
class LabContext:
    """One run of one or more labs: the settings they share and what they can reuse from each other."""

    quick: bool = False
    model: str | None = None  # None: the default model, or the tiny one with quick
    out: Path = Path("lab-results")
    device: str = "auto"
    price_per_hour: float | None = None
    fleet: Path | None = None  # the fleet spec the KServe lab renders (None: examples/fleet.yaml)
    workdir: Path | None = None  # where tiny models and process logs go (a temp folder if None)
    measurements: dict[str, Measurement] = field(default_factory=dict)
    _llm: tuple[tuple, LLM] | None = None
    _hardware: Hardware | None = None
    _facts: ModelFacts | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list)
    _replicas: dict[tuple, list[Proc]] = field(default_factory=dict)
    date: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))

    def __post_init__(self) -> None:
        if self.workdir is None:
            import tempfile

            self.workdir = Path(tempfile.mkdtemp(prefix="inferd-lab-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.model is None:
            if self.quick:
                from inferd.models.tiny import tiny_model

                self.model = str(tiny_model())
            else:
                self.model = DEFAULT_MODEL

    @property
    def model_label(self) -> str:
        if self.model == DEFAULT_MODEL:
            return "Gemma 3 270M (gemma3-270m)"
        from inferd.models.tiny import is_tiny

        if is_tiny(self.model):
            return "a tiny random-weight Llama (--quick)"
        return Path(self.model).name

    def size(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    @property
    def max_model_len(self) -> int:
        return self.size(1024, 2048)

    def llm(self, **settings) -> LLM:
        """The model with these engine settings; the last one is kept, so labs in a row share it."""
        from inferd.engine.engine import LLM

        base = {
            "max_model_len": self.max_model_len,
            "kv_cache_memory": self.size(64, 512) * 2**20,
            "max_num_batched_tokens": self.max_model_len,  # a whole prompt in one step, unless a lab chunks it
            "device": self.device,
        }
        if self.quick:  # one thread: on a shared machine a second one mostly waits for its core
            base["num_threads"] = 1
            base["attention_backend"] = "torch"  # no native-kernel build in a quick run (the TensorRT lab asks)
        full = {k: v for k, v in {**base, **settings}.items() if not _is_default(k, v)}
        key = tuple(sorted(full.items()))
        if self._llm is not None and self._llm[0] == key:
            return self._llm[1]
        if self._llm is not None and _only_scheduler_differs(dict(self._llm[0]), full):
            llm = self._llm[1]
            _set_scheduler(llm, full)
            self._llm = (key, llm)
            return llm
        self._llm = None
        gc.collect()
        llm = LLM(self.model, **full)
        self._llm = (key, llm)
        return llm

    @property
    def torch_device(self) -> torch.device:
        from inferd.engine.engine import resolve_device

        return resolve_device(self.device)

    def facts(self) -> ModelFacts:
        if self._facts is None:
            engine = self.llm().engine
            self._facts = model_facts(engine.model, engine.dtype, engine.kv_dtype, self.model_label)
        return self._facts

    def hardware(self) -> Hardware:
        if self._hardware is None:
            engine = self.llm().engine
            n, nbytes, runs = self.size((512, 64 * 2**20, 3), (2048, 2**30, 5))
            self._hardware = measure_hardware(engine.device, engine.dtype, n, nbytes, runs)
        return self._hardware

    # -- processes: real servers on loopback (`inferd.procs`), each stopped when the run ends ------------------
    def started(self, proc: Proc) -> Proc:
        self.on_close(proc.stop)
        return proc

    def serve(self, *extra: str) -> Proc:
        """An `inferd serve` of this run's model as "m", one thread unless `extra` says otherwise (later flags
        win); wait for it with `wait`."""
        return self.started(start_serve(self.model, self.workdir, "m", *self.replica_flags(), *extra))

    def prefill(self, *extra: str) -> tuple[Proc, str]:
        """A `--role prefill` instance and its KV channel's host:port (a `decode` instance's peer)."""
        port = free_port()
        flags = ("--role", "prefill", "--kv-secret", KV_SECRET, "--kv-port", str(port))
        return self.serve(*flags, *extra), f"127.0.0.1:{port}"

    def decode(self, peers: list[str], *extra: str) -> Proc:
        return self.serve("--role", "decode", "--kv-secret", KV_SECRET, *extra, "--kv-peers", *peers)

    def proxy(self, prefill: list[Proc], decode: list[Proc]) -> Proc:
        """`inferd disagg proxy` in front of these instances."""
        return self.started(start_proxy(self.workdir, [p.url for p in prefill], [d.url for d in decode]))

    def gateway(self, servers: list[Proc], **config) -> Proc:
        """`inferd gateway` with one pool of these servers behind "m" (`config`: more sections), ready."""
        return self.started(start_gateway(gateway_config([s.url for s in servers], **config), self.workdir))

    @staticmethod
    def wait(*procs: Proc) -> None:
        for p in procs:
            wait_http(p, "/health", timeout=START_TIMEOUT)

    def replicas(self, count: int, *extra: str) -> list[Proc]:
        """`count` inferd replicas of this run's model, started once per set of flags and kept for later labs."""
        key = (count, extra)
        procs = self._replicas.get(key)
        if not procs or not all(p.alive() for p in procs):  # none yet, or stopped (a `scoped` block's end)
            procs = self._replicas[key] = [self.serve(*extra) for _ in range(count)]
            self.wait(*procs)
        return procs

    def replica_flags(self) -> list[str]:
        """`inferd serve` flags every lab replica of this run starts with (a lab's own flags come after and win)."""
        flags = ["--device", self.device, "--max-model-len", str(self.max_model_len), "--kv-cache-memory", "256MiB"]
        return flags + (["--attention-backend", "torch"] if self.quick else [])

    def any_replicas(self) -> list:
        """Replicas this run already started (any flags), or one new one."""
        return next(iter(self._replicas.values()), None) or self.replicas(1)

    @contextmanager
    def scoped(self) -> Iterator[None]:
        """Servers started inside the block are stopped when it ends, on failure too, not at the run's end."""
        mark = len(self._closers)
        try:
            yield
        finally:
            while len(self._closers) > mark:
                self._closers.pop()()

    def on_close(self, fn: Callable[[], None]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()
        self._replicas.clear()
        self._llm = None
        gc.collect()


def shown_path(path: Path) -> str:
    """A path as a lab's text shows it: relative to the working directory when inside it (a checkout's
    benchmarks/results/...), else with the home folder as ~, so a page written from the text names no user."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else home_path(path)


# -- what the process labs read off their servers ------------------------------------------------------------
def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ttfts(url: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    """Streamed completions of 2 tokens, `concurrency` at a time: their TTFTs in seconds, in prompt order."""
    outs = send_all(url, [BenchRequest(p, len(p), 2) for p in prompts], concurrency=concurrency)
    if failed := next((o for o in outs if not o.success), None):
        raise RuntimeError(f"{url}: {failed.error}")
    return [ttft(o) for o in outs]


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def summed_delta(after: list[dict[str, float]], before: list[dict[str, float]], key: str) -> float:
    """`key`'s rise summed over servers (their /metrics after and before, in the same order)."""
    return sum(delta(a, b, key) for a, b in zip(after, before, strict=True))


def leases_released(prefill: Proc, timeout: float = 10.0) -> float:
    """Blocks the prefill instance still lends after the decode side acknowledged (0 once every lease is
    released); waits up to `timeout` for the acknowledgements in flight."""
    deadline = time.monotonic() + timeout
    while (left := metrics(prefill.url).get("inferd:kv_leases_active", 0.0)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
