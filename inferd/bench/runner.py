"""A benchmark run: warm-ups, then one level or a sweep of levels, each a timed burst of streaming requests.

The runner owns the event loop and the order of dataset draws (warm-ups first, then each level), so a seed
reproduces the requests, and every level sends prompts no earlier level sent.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inferd.bench.client import ClientConfig, RequestOutput, StreamingClient, normalize_base_url
from inferd.bench.cost import best_level, cost_fields
from inferd.bench.datasets import BenchRequest, Dataset
from inferd.bench.metrics import DEFAULT_PERCENTILES, RequestTiming, compute_run_metrics, error_kind
from inferd.bench.tokenizers import Tokenizer
from inferd.errors import InferdError
from inferd.measure.arrivals import inter_arrival_times

logger = logging.getLogger(__name__)


class SweepKind(enum.Enum):
    RATE = "rate"
    CONCURRENCY = "concurrency"

    @property
    def level_key(self) -> str:
        """The field of a run's JSON that holds the swept value."""
        return "request_rate" if self is SweepKind.RATE else "max_concurrency"


@dataclass(frozen=True)
class Sweep:
    kind: SweepKind
    values: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> Sweep:
        """'concurrency:1,4,16' or 'rate:0.5,1,inf'."""
        kind, sep, values = spec.partition(":")
        try:
            sweep_kind = SweepKind(kind.strip().lower())
            nums = tuple(float(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise InferdError(f"--sweep {spec!r}: expected rate:R1,R2,... or concurrency:C1,C2,...") from None
        if not sep or not nums or any(v <= 0 for v in nums):
            raise InferdError(f"--sweep {spec!r}: give at least one positive value, e.g. concurrency:1,4,16")
        if sweep_kind is SweepKind.CONCURRENCY and any(not v.is_integer() for v in nums):
            raise InferdError(f"--sweep {spec!r}: concurrencies must be whole numbers")
        return cls(sweep_kind, nums)


@dataclass(frozen=True)
class Level:
    request_rate: float
    max_concurrency: int | None


@dataclass(frozen=True)
class BenchConfig:
    client: ClientConfig
    num_prompts: int
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    sweep: Sweep | None = None
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    slo_attainment: float = 0.9
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    price_per_hour: float | None = None
    replicas: int = 1
    show_progress: bool = True

    def levels(self) -> list[Level]:
        if self.sweep is None:
            return [Level(self.request_rate, self.max_concurrency)]
        if self.sweep.kind is SweepKind.RATE:
            return [Level(v, self.max_concurrency) for v in self.sweep.values]
        return [Level(self.request_rate, int(v)) for v in self.sweep.values]


@dataclass
class LevelResult:
    level: Level
    outputs: list[RequestOutput]
    timings: list[RequestTiming]  # the outputs with their token counts settled
    start: float
    end: float
    summary: dict  # metrics (vLLM field names) + cost + token count sources


@dataclass
class ServerInfo:
    models: list[dict]


def preflight(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> ServerInfo:
    """GET /v1/models: fail fast and clearly when the server cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = normalize_base_url(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise InferdError(f"cannot reach the server at {url} ({type(e).__name__}: {e}); is it running?") from None
    if resp.status_code in (401, 403):
        raise InferdError(f"{url} refused the request (HTTP {resp.status_code}); pass --api-key")
    if resp.status_code != 200:
        logger.warning("%s answered HTTP %d; going on without the model list", url, resp.status_code)
        return ServerInfo(models=[])
    try:
        return ServerInfo(models=list(resp.json().get("data", [])))
    except (ValueError, AttributeError):
        return ServerInfo(models=[])


def _progress(show: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TextColumn("{task.fields[tps]:.1f} out tok/s"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not show,
    )


async def run_requests(
    client: StreamingClient,
    requests: Sequence[BenchRequest],
    level: Level,
    burstiness: float,
    seed: int,
    progress: Progress,
    description: str,
) -> tuple[list[RequestOutput], float, float]:
    """Send on the arrival schedule, at most max_concurrency in flight; returns (outputs, start, end)."""
    gaps = inter_arrival_times(len(requests), level.request_rate, burstiness, np.random.default_rng(seed))
    sem = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
    task_id = progress.add_task(description, total=len(requests), failed=0, tps=0.0)
    counters = {"failed": 0, "tokens": 0}
    start = time.perf_counter()

    def on_done(out: RequestOutput) -> None:
        counters["failed"] += not out.success
        counters["tokens"] += out.usage_completion_tokens or len(out.chunk_times)
        tps = counters["tokens"] / max(time.perf_counter() - start, 1e-9)
        progress.update(task_id, advance=1, failed=counters["failed"], tps=tps)

    async def one(i: int, req: BenchRequest) -> RequestOutput:
        if sem is None:
            return await client.send(i, req, on_done)
        async with sem:  # the send time is taken inside: waiting for a slot is the client's, not the server's
            return await client.send(i, req, on_done)

    tasks = []
    due = start
    for i, req in enumerate(requests):
        due += gaps[i]
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    outputs = await asyncio.gather(*tasks)
    end = time.perf_counter()
    progress.remove_task(task_id)
    return list(outputs), start, end


def to_timings(outputs: Sequence[RequestOutput], tok: Tokenizer | None) -> tuple[list[RequestTiming], dict]:
    """Token counts from the server's usage where it gave one, else the tokenizer; says which was used."""
    timings, sources = [], {"input": Counter(), "output": Counter()}
    for o in outputs:
        if o.usage_prompt_tokens is not None:
            n_in, src_in = o.usage_prompt_tokens, "usage"
        else:
            n_in, src_in = o.prompt_len, "tokenizer"
        if o.usage_completion_tokens is not None:
            n_out, src_out = o.usage_completion_tokens, "usage"
        elif tok is not None and o.text:
            n_out, src_out = len(tok.encode(o.text)), "tokenizer"
        else:
            n_out, src_out = len(o.chunk_times), "chunks"
        if o.success:
            sources["input"][src_in] += 1
            sources["output"][src_out] += 1
        timings.append(RequestTiming(o.send_time, o.end_time, o.chunk_times, o.success, o.error, n_in, n_out))
    return timings, {k: _source_label(v) for k, v in sources.items()}


def _source_label(counts: Counter) -> str:
    if not counts:
        return "none"
    if len(counts) == 1:
        return next(iter(counts))
    return "mixed (" + ", ".join(f"{k} {v}" for k, v in counts.most_common()) + ")"


def schema_validity(requests: Sequence[BenchRequest], outputs: Sequence[RequestOutput]) -> dict:
    """Of the completed requests that name a schema, the share whose output is JSON the schema accepts: all of
    them, those that sent it as a constraint, and those that did not (None where there are none)."""
    from inferd.bench.schemas import is_valid

    groups: dict[str, list[bool]] = {"all": [], "constrained": [], "free": []}
    for req, out in zip(requests, outputs, strict=True):
        if req.schema is None or not out.success:
            continue
        valid = is_valid(req.schema, out.text)[0]
        groups["all"].append(valid)
        groups["constrained" if req.extra_body else "free"].append(valid)
    if not groups["all"]:
        return {}
    rate = {k: (sum(v) / len(v) if v else None) for k, v in groups.items()}
    return {
        "schema_checked": len(groups["all"]),
        "schema_constrained": len(groups["constrained"]),
        "schema_valid_rate": rate["all"],
        "schema_valid_rate_constrained": rate["constrained"],
        "schema_valid_rate_free": rate["free"],
    }


def summarize_level(
    cfg: BenchConfig, level: Level, outputs, start, end, tok, requests: Sequence[BenchRequest] = ()
) -> tuple[dict, list[RequestTiming]]:
    timings, sources = to_timings(outputs, tok)
    metrics = compute_run_metrics(timings, start, end, cfg.slos, cfg.percentiles).as_dict()
    if requests:
        metrics.update(schema_validity(requests, outputs))
    metrics["token_count_source"] = sources
    metrics["num_prompts"] = len(outputs)
    metrics["request_rate"] = level.request_rate if math.isfinite(level.request_rate) else "inf"
    metrics["burstiness"] = cfg.burstiness
    metrics["max_concurrency"] = level.max_concurrency
    metrics.update(cost_fields(metrics, cfg.price_per_hour, cfg.replicas))
    return metrics, timings


def _warmup_failure(outputs: Sequence[RequestOutput], server: ServerInfo, model: str) -> str:
    kinds = Counter(error_kind(o.error) for o in outputs)
    first = outputs[0].error
    msg = f"all {len(outputs)} warm-up requests failed ({dict(kinds)}); first error: {first}"
    served = [m.get("id") for m in server.models if isinstance(m, dict)]
    if "HTTP 404" in kinds and served and model not in served:
        msg += f"; the server serves {served}, not {model!r}: fix --model"
    return msg


async def _run_async(cfg: BenchConfig, dataset: Dataset, tok: Tokenizer | None, server: ServerInfo):
    levels = cfg.levels()
    warmups = dataset.take(cfg.num_warmups) if cfg.num_warmups else []
    batches = [dataset.take(cfg.num_prompts) for _ in levels]  # all drawn before any timing starts
    results: list[LevelResult] = []
    async with StreamingClient(cfg.client) as client:
        with _progress(cfg.show_progress) as progress:
            if warmups:
                warm = Level(math.inf, cfg.max_concurrency or (levels[0].max_concurrency))
                outs, _, _ = await run_requests(client, warmups, warm, 1.0, cfg.seed, progress, "warm-up")
                if not any(o.success for o in outs):
                    raise InferdError(_warmup_failure(outs, server, cfg.client.model))
            for i, (level, batch) in enumerate(zip(levels, batches, strict=True)):
                desc = f"rate {level.request_rate:g}, concurrency {level.max_concurrency or 'unlimited'}"
                seed = cfg.seed + i
                before = await spec_decode_counters(cfg.client)
                outs, start, end = await run_requests(client, batch, level, cfg.burstiness, seed, progress, desc)
                summary, timings = summarize_level(cfg, level, outs, start, end, tok, batch)
                summary |= spec_decode_fields(before, await spec_decode_counters(cfg.client))
                results.append(LevelResult(level, outs, timings, start, end, summary))
    return results


# the cumulative speculative-decoding counters vLLM and inferd expose (`vllm:` or `inferd:` before them)
_SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


async def spec_decode_counters(client: ClientConfig) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its /metrics, summed over models; None when it has none
    (or no /metrics): a level's fields come from the difference across it."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            resp = await http.get(normalize_base_url(client.base_url) + "/metrics", headers=headers)
        if resp.status_code != 200:
            return None
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(resp.text):
            name = family.name.split(":", 1)[-1]
            if name in _SPEC_COUNTERS:
                found[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        return found if len(found) == len(_SPEC_COUNTERS) else None
    except (httpx.HTTPError, ValueError):
        return None


def spec_decode_fields(before: dict | None, after: dict | None) -> dict:
    """A level's drafts and acceptance (vLLM's names): the acceptance rate (accepted / proposed draft tokens)
    and the mean acceptance length (tokens per step that verified drafts: 1 + accepted / drafts)."""
    if before is None or after is None:
        return {}
    drafts, proposed, accepted = (after[k] - before[k] for k in _SPEC_COUNTERS)
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_num_draft_tokens": int(proposed),
        "spec_decode_num_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": accepted / proposed if proposed else None,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def run_benchmark(cfg: BenchConfig, dataset: Dataset, tok: Tokenizer | None, server: ServerInfo) -> list[LevelResult]:
    return asyncio.run(_run_async(cfg, dataset, tok, server))


def sweep_best(cfg: BenchConfig, results: Sequence[LevelResult]) -> dict | None:
    if cfg.sweep is None or not cfg.slos:
        return None
    return best_level([r.summary for r in results], cfg.sweep.kind.level_key, cfg.slo_attainment)
