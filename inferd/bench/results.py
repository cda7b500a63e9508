"""The result JSON: vLLM's field names where they exist (so its tooling reads ours), plus our own.

A single run is one flat object, as `vllm bench serve --save-result` writes. A sweep is an object with the
shared settings, a `runs` list of such flat objects and the `best` level. Detailed mode adds vLLM's
per-request lists (input_lens, output_lens, ttfts, itls, generated_texts, errors) and a JSONL file with one
line per request.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
from datetime import datetime
from pathlib import Path

from inferd.bench.client import RequestOutput
from inferd.bench.metrics import RequestTiming, e2el, itls, tpot, ttft
from inferd.bench.runner import BenchConfig, LevelResult, ServerInfo, sweep_best
from inferd.cpu import cpu_identity

RESULT_VERSION = 1


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    if model := cpu_identity()["model"]:  # the CPU model and memory say more than "x86_64" across machines
        info["cpu_model"] = model
    try:
        mem = Path("/proc/meminfo").read_text()
        if m := re.search(r"^MemTotal:\s*(\d+) kB", mem, re.M):
            info["memory_gib"] = round(int(m.group(1)) / 2**20, 1)
    except OSError:
        pass
    return info


def header(cfg: BenchConfig, settings: dict, server: ServerInfo, tokenizer_id: str | None) -> dict:
    c = cfg.client
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": c.endpoint.backend,
        "endpoint_type": c.endpoint.backend,
        "label": settings.get("label"),
        "model_id": c.model,
        "tokenizer_id": tokenizer_id,
        "base_url": c.base_url,
        "endpoint": c.endpoint.path,
        "inferd_bench_version": RESULT_VERSION,
        "settings": settings,
        "server_models": server.models,
        "machine": machine_info(),
    }


def detailed_lists(outputs: list[RequestOutput], timings: list[RequestTiming], start: float) -> dict:
    """vLLM's per-request lists, in send order; failed requests get zeros, as vLLM writes them."""
    return {
        "input_lens": [t.input_tokens for t in timings],
        "output_lens": [t.output_tokens if t.success else 0 for t in timings],
        "ttfts": [(ttft(t) or 0.0) if t.success else 0.0 for t in timings],
        "itls": [itls(t) if t.success else [] for t in timings],
        "tpots": [tpot(t) if t.success else None for t in timings],
        "e2els": [e2el(t) if t.success else None for t in timings],
        "start_times": [t.send_time - start for t in timings],
        "generated_texts": [o.text for o in outputs],
        "errors": [o.error or "" for o in outputs],
    }


def run_dict(base: dict, res: LevelResult, detailed: bool) -> dict:
    d = base | res.summary
    if detailed:
        d |= detailed_lists(res.outputs, res.timings, res.start)
    return d


def build_result(cfg, settings, server, tokenizer_id, results: list[LevelResult], detailed: bool) -> dict:
    head = header(cfg, settings, server, tokenizer_id)
    if cfg.sweep is None:
        return run_dict(head, results[0], detailed)
    runs = [run_dict({"date": head["date"], "label": head["label"]}, r, detailed) for r in results]
    return head | {
        "sweep": {
            "kind": cfg.sweep.kind.value,
            "level_key": cfg.sweep.kind.level_key,
            "values": list(cfg.sweep.values),
        },
        "slo_ms": cfg.slos or None,
        "runs": runs,
        "best": sweep_best(cfg, results),
    }


def _json_safe(obj):
    """JSON has no inf or nan: write them as strings, as vLLM writes request_rate "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def default_stem(model: str, label: str | None) -> str:
    safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model)
    return f"bench-{label + '-' if label else ''}{safe_model}-{datetime.now():%Y%m%d-%H%M%S}"


def save_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(result), indent=2))
    return path


def save_request_lines(results: list[LevelResult], path: Path) -> Path:
    """One JSON line per request, every level, with the level it ran at."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in results:
            for o, t in zip(r.outputs, r.timings, strict=True):
                line = {
                    "request_rate": r.level.request_rate,
                    "max_concurrency": r.level.max_concurrency,
                    "index": o.index,
                    "success": o.success,
                    "error": o.error,
                    "start_time": o.send_time - r.start,
                    "ttft": ttft(t) if o.success else None,
                    "tpot": tpot(t) if o.success else None,
                    "e2el": e2el(t),
                    "itl": itls(t),
                    "input_tokens": t.input_tokens,
                    "output_tokens": t.output_tokens,
                    "expected_output_tokens": o.expected_output_len,
                    "finish_reason": o.finish_reason,
                    "generated_text": o.text,
                }
                f.write(json.dumps(_json_safe(line)) + "\n")
    return path
