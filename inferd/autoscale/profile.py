"""A replica's performance profile: what the simulator and the planner know of one replica.

Measured by `inferd profile` against a running replica, or written by hand. Fields:
- `prefill_tokens_per_s`: prompt tokens a replica prefills per second (TTFT of a lone request = prompt /
  this + one decode step);
- `decode_batch` / `decode_step_s`: the time of one decode step (the inter-token latency) at each batch
  size, interpolated linearly between the points and extrapolated from the last two (one point: the same
  at every batch size);
- `max_num_seqs`: the most requests running at once (the engine's --max-num-seqs);
- `max_num_batched_tokens`: the tokens one step may compute (the engine's --max-num-batched-tokens;
  None: no budget, every prompt is prefilled in the step it joins);
- `cold_start_s`: process start to ready (loading the model);
- `request_overhead_s`: latency every request pays outside the engine's steps (HTTP, tokenizing,
  detokenizing): added to its TTFT and end time, not to the replica's busy time.

The profiles shipped in `inferd/autoscale/profiles/` are examples, labelled with where their numbers
come from; measure your own hardware with `inferd profile` before trusting a plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from inferd.errors import ConfigError


@dataclass
class Profile:
    name: str
    prefill_tokens_per_s: float
    decode_batch: list[int]
    decode_step_s: list[float]
    max_num_seqs: int
    cold_start_s: float = 30.0
    request_overhead_s: float = 0.0
    max_num_batched_tokens: int | None = None
    description: str = ""
    source: str = ""  # measured (how, where) or example (from what)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"profile {self.name}: max_num_batched_tokens must be at least 1")
        if self.prefill_tokens_per_s <= 0 or self.max_num_seqs < 1 or self.cold_start_s < 0:
            raise ConfigError(f"profile {self.name}: rates and sizes must be positive")
        if len(self.decode_batch) != len(self.decode_step_s) or not self.decode_batch:
            raise ConfigError(f"profile {self.name}: decode_batch and decode_step_s need the same, non-zero length")
        if any(b2 <= b1 for b1, b2 in zip(self.decode_batch, self.decode_batch[1:], strict=False)):
            raise ConfigError(f"profile {self.name}: decode_batch must increase")
        if any(s <= 0 for s in self.decode_step_s):
            raise ConfigError(f"profile {self.name}: decode steps take positive time")

    def step_s(self, batch: int) -> float:
        """Seconds of one decode step with `batch` running requests."""
        xs, ys = self.decode_batch, self.decode_step_s
        if batch <= xs[0] or len(xs) == 1:
            return ys[0]  # one point: the same step at every batch size
        if batch >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (batch - xs[-1])
        return float(np.interp(batch, xs, ys))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def load_profile(name_or_path: str) -> Profile:
    """A profile file, or the name of an example shipped with inferd (see `example_profiles`)."""
    path = Path(name_or_path)
    if path.exists():
        text = path.read_text()
    else:
        stem = name_or_path.removesuffix(".json")
        if stem not in example_profiles():
            raise ConfigError(f"no profile file {name_or_path!r} and no example of that name: {example_profiles()}")
        text = (resources.files("inferd.autoscale") / "profiles" / f"{stem}.json").read_text()
    try:
        data = json.loads(text)
        return Profile(**data)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"profile {name_or_path}: {e}") from None


def example_profiles() -> list[str]:
    folder = resources.files("inferd.autoscale") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))
