"""What every lab shares in one run: the model (loaded once per set of engine settings), this machine's
measured matmul peak and memory bandwidth, the model's shape in bytes and FLOPs (both from the measuring
library, `inferd.measure`, as the benchmarks take them), and earlier labs' measurements (the cost lab
reuses the goodput lab's when both run).

`--quick` swaps the default model for a tiny random-weight Llama built on the fly (`inferd.labs.tiny`), so
every lab finishes in seconds; its numbers show the mechanics, not a real model's speed, and each lab's
text says which model it measured.
"""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inferd.bench.results import machine_info
from inferd.config import DEFAULT_MODEL, engine_default
from inferd.errors import ConfigError
from inferd.measure.hardware import matmul_peak, memory_bandwidth
from inferd.measure.model import ModelFacts
from inferd.measure.model import model_facts as facts_of

if TYPE_CHECKING:
    from inferd.engine.engine import LLM
    from inferd.labs.base import Measurement


@dataclass(frozen=True)
class Hardware:
    """This machine's ceilings, measured (`inferd.measure.hardware`), not looked up: a roofline needs both."""

    device: str
    dtype: str
    matmul_flops: float  # FLOP/s of a large square matmul in the model's dtype
    matmul_n: int
    memory_bandwidth: float  # bytes/s read from memory
    probe_bytes: int  # of the tensor the bandwidth was read from

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the two roofs meet: below it a kernel is bandwidth-bound, above compute-bound."""
        return self.matmul_flops / self.memory_bandwidth


def measure_hardware(device: torch.device, dtype: torch.dtype, quick: bool) -> Hardware:
    n, nbytes, runs = (512, 64 * 2**20, 3) if quick else (2048, 2**30, 5)
    flops = matmul_peak(n, dtype, device, runs)["peak"]
    bandwidth = memory_bandwidth(nbytes, device, runs)
    return Hardware(device.type, str(dtype).removeprefix("torch."), float(flops), n, bandwidth, nbytes)


def model_facts(llm: LLM, name: str) -> ModelFacts:
    engine = llm.engine
    return facts_of(engine.model, engine.dtype, engine.kv_dtype, name)


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


def _only_scheduler_differs(old: dict, new: dict) -> bool:
    changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    return changed <= _scheduler_fields()


def _set_scheduler(llm: LLM, settings: dict) -> None:
    """Scheduling limits are read every step, so an idle engine takes new ones without reloading the model."""
    from inferd.config import SchedulerConfig

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("cannot change scheduler settings while requests run")
    config = SchedulerConfig(**{k: v for k, v in settings.items() if k in _scheduler_fields()})
    config.validate()
    engine.scheduler.config = config


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
    _replicas: dict[tuple, list] = field(default_factory=dict)
    date: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))

    def __post_init__(self) -> None:
        if self.workdir is None:
            import tempfile

            self.workdir = Path(tempfile.mkdtemp(prefix="inferd-lab-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.model is None:
            if self.quick:
                from inferd.labs.tiny import tiny_model

                self.model = str(tiny_model())
            else:
                self.model = DEFAULT_MODEL

    @property
    def model_label(self) -> str:
        if self.model == DEFAULT_MODEL:
            return "Gemma 3 270M (gemma3-270m)"
        from inferd.labs.tiny import is_tiny

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
            self._facts = model_facts(self.llm(), self.model_label)
        return self._facts

    def hardware(self) -> Hardware:
        if self._hardware is None:
            llm = self.llm()
            self._hardware = measure_hardware(llm.engine.device, llm.engine.dtype, self.quick)
        return self._hardware

    def replicas(self, count: int, *extra: str) -> list:
        """`count` inferd replicas of this run's model (processes), started once per set of flags."""
        from inferd.labs.procs import start_replica
        from inferd.procs import wait_http

        key = (count, extra)
        if key not in self._replicas:
            flags = self.replica_flags()
            procs = [start_replica(self.model, self.workdir, *flags, *extra) for _ in range(count)]  # later flags win
            self._replicas[key] = procs
            self.on_close(lambda: [p.stop() for p in procs])
            for p in procs:
                wait_http(p, "/health", timeout=600)
        return self._replicas[key]

    def replica_flags(self) -> list[str]:
        """`inferd serve` flags every lab replica of this run starts with (a lab's own flags come after and win)."""
        flags = ["--device", self.device, "--max-model-len", str(self.max_model_len), "--kv-cache-memory", "256MiB"]
        return flags + (["--attention-backend", "torch"] if self.quick else [])

    def any_replicas(self) -> list:
        """Replicas this run already started (any flags), or one new one."""
        return next(iter(self._replicas.values()), None) or self.replicas(1)

    def on_close(self, fn: Callable[[], None]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()
        self._replicas.clear()
        self._llm = None
        gc.collect()
