"""What the labs of one run share: the model (loaded once per set of engine settings; with `--quick` a tiny
random-weight Llama), this machine's peaks and the model's bytes and FLOPs (`inferd.measure`), earlier labs'
measurements, and the servers they start on loopback (`ctx.procs`, an `inferd.procs.ProcGroup`), stopped at its end."""

from __future__ import annotations

import gc
import os
import platform
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inferd.bench.peers import home_path
from inferd.bench.results import machine_info
from inferd.config import DEFAULT_MODEL, make_engine_config
from inferd.labs import find_lab
from inferd.measure.hardware import Hardware, measure_hardware
from inferd.measure.model import ModelFacts, model_facts
from inferd.models.tiny import is_tiny, tiny_model
from inferd.procs import ProcGroup

if TYPE_CHECKING:
    from inferd.engine.engine import LLM
    from inferd.labs.base import Lab, Measurement


def describe_machine(device: str) -> dict:
    info = machine_info() | {"device": device, "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
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
    _llm: LLM | None = None
    date: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
    procs: ProcGroup = field(init=False)

    def __post_init__(self) -> None:
        self.workdir = self.workdir or Path(tempfile.mkdtemp(prefix="inferd-lab-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = self.model or (str(tiny_model()) if self.quick else DEFAULT_MODEL)
        # the servers labs start (`inferd.procs`): this run's model as "m", one thread unless a lab says otherwise
        flags = ["--device", self.device, "--max-model-len", str(self.max_model_len), "--kv-cache-memory", "256MiB"]
        self.procs = ProcGroup(self.model, self.workdir, flags + ["--attention-backend", "torch"] * self.quick)

    @property
    def model_label(self) -> str:
        if self.model == DEFAULT_MODEL:
            return "Gemma 3 270M (gemma3-270m)"
        return "a tiny random-weight Llama (--quick)" if is_tiny(self.model) else Path(self.model).name

    def size(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    @property
    def max_model_len(self) -> int:
        return self.size(1024, 2048)

    def llm(self, **settings) -> LLM:
        """The model with these engine settings; the last one is kept, so labs in a row share it, and an idle
        one takes new scheduling and speculative settings (read every step) without reloading (`LLM.reconfigure`)."""
        from inferd.engine.engine import LLM

        full = dict(max_model_len=self.max_model_len, kv_cache_memory=self.size(64, 512) * 2**20, device=self.device)
        full["max_num_batched_tokens"] = self.max_model_len  # a whole prompt in one step, unless a lab chunks it
        if self.quick:  # one thread: on a shared machine a second one mostly waits for its core
            full |= {"num_threads": 1, "attention_backend": "torch"}  # no native-kernel build (the TensorRT lab asks)
        full |= settings
        config = make_engine_config(self.model, **full)
        if self._llm is not None and self._llm.reconfigure(config):
            return self._llm
        self._llm = None
        gc.collect()
        self._llm = LLM(config)
        return self._llm

    @property
    def torch_device(self) -> torch.device:
        from inferd.engine.engine import resolve_device

        return resolve_device(self.device)

    @cached_property
    def facts(self) -> ModelFacts:
        e = self.llm().engine
        return model_facts(e.model, e.dtype, e.kv_dtype, self.model_label)

    @cached_property
    def hardware(self) -> Hardware:
        e, (n, nbytes, runs) = self.llm().engine, self.size((512, 64 * 2**20, 3), (2048, 2**30, 5))
        return measure_hardware(e.device, e.dtype, n, nbytes, runs)

    def measured(self, lab: Lab | str) -> Measurement:
        """This run's measurement of a lab (by itself or its name), measured now if it has not run yet."""
        if isinstance(lab, str):
            lab = find_lab(lab)
        if lab.name not in self.measurements:
            self.measurements[lab.name] = lab.measure(self)
        return self.measurements[lab.name]

    def close(self) -> None:
        self.procs.close()
        self._llm = None
        gc.collect()


def shown_path(path: Path) -> str:
    """A path as a lab's text shows it: relative to the working directory when inside it, else with the home
    folder as ~, so a page written from the text names no user."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else home_path(path)
