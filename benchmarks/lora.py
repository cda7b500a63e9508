"""Multi-LoRA serving: output tok/s at one concurrency with 0, 1, 4 and 16 distinct adapters in the mix, against
the base model alone, with vLLM CPU serving the same adapters side by side; what loading an adapter costs; and
(`--kernels`) the batched LoRA product inferd uses against one product per adapter.

Adapters: `--adapters` (default 16) PEFT LoRA adapters of the default model (Gemma 3 270M), rank `--rank`
(default 8) on q/k/v/o and gate/up/down, made once with peft (A and B random, so each changes the model's
greedy output) and kept under ~/.cache/inferd/lora-bench.

Servers (`--servers`), all started at once, each run sent to each in turn (this VM's speed drifts):
  inferd         `inferd serve`, defaults, no adapters: the base model alone
  inferd-lora    the same with every adapter (`--lora-modules`, `--max-loras` = adapters, `--max-lora-rank`)
  vllm-lora      vLLM CPU, bf16, with the same adapters and limits (vLLM's flags of the same names)
Mixes (`--mixes`, default 0,1,4,16): the number of distinct adapters the requests of a run ask for, in turn
(`inferd bench serve --lora-modules`); 0 sends every request to the base model (on `inferd` too). The workload:
`--dataset random`, `--input-len`/`--output-len` tokens (default 128/128), greedy, streaming, `--ignore-eos`,
3 x concurrency requests per run, `--runs` runs (default 3), medians. Ratios in the same run: each mix over the
base model alone (`inferd`), and inferd-lora over vllm-lora per mix.

    python benchmarks/lora.py                            # inferd, inferd-lora, vllm-lora where installed
    python benchmarks/lora.py --servers inferd,inferd-lora --runs 1
    python benchmarks/lora.py --kernels                  # the ways to add a step's adapter products
    python benchmarks/lora.py --gateway                  # gateway LoRA affinity against round robin

`--gateway`: two `inferd serve` replicas of the default model (one thread each, `--gateway-slots` adapter slots
each, default 2) behind `inferd gateway`, `--gateway-adapters` adapters (default 8, more than the 4 slots in
all) asked for at random, `--gateway-requests` requests (default 96) at `--gateway-concurrency` (default 8),
each 64 prompt and 32 output tokens, through three pickers in turn: round robin, scored without LoRA affinity
(`lora_affinity: 0`) and scored with it (the default). Per picker: TTFT mean and p99 at the client, output
tok/s, and the adapter loads the replicas counted (`inferd:lora_loads`).

Results: one run appended to benchmarks/results/lora-<CPU kind>.json (`--out NAME`, `--fresh`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # run as a script: make `benchmarks.*` importable
from benchmarks.common import bench_serve, record_run  # noqa: E402
from benchmarks.vs_peers import (  # noqa: E402
    LOG_DIR,
    Server,
    chosen_servers,
    default_model,
    inferd_server,
    median_of_runs,
    running,
    server_entry,
    vllm_server,
)
from inferd.bench.peers import peer_python  # noqa: E402
from inferd.procs import free_port  # noqa: E402

RAW_DIR = ROOT / "results" / "lora" / "raw"  # each bench run's JSON (not committed)
SERVERS = ("inferd", "inferd-lora", "vllm-lora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEYS = ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms")


def adapter_dir() -> Path:
    from inferd.models.loader import cache_dir

    return cache_dir() / "lora-bench"


def make_adapters(hf_folder: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """`count` random PEFT adapters of the model (made with peft once, then reused): (name, folder)."""
    out = [(f"lora{i}", adapter_dir() / f"{hf_folder.name}-r{rank}-{i}") for i in range(count)]
    todo = [(name, path) for name, path in out if not (path / "adapter_model.safetensors").exists()]
    if todo:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
        for name, path in todo:
            torch.manual_seed(int(name.removeprefix("lora")))
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False)
            model = get_peft_model(base, config)
            model.save_pretrained(path)
            base = model.unload()  # the base model again, without this adapter's layers
            print(f"made {name}: {path}", flush=True)
    return out


def server_table(model, adapters: list[tuple[str, Path]], rank: int) -> tuple[dict[str, Server], dict[str, int]]:
    ports = {name: free_port() for name in SERVERS}
    modules = [f"{name}={path}" for name, path in adapters]
    limits = ["--max-loras", str(len(adapters)), "--max-lora-rank", str(rank)]
    vllm = vllm_server(peer_python("vllm"), model, str(ports["vllm-lora"]), "bfloat16")
    vllm = dataclasses.replace(
        vllm, name="vllm-lora", command=[*vllm.command, "--enable-lora", "--lora-modules", *modules, *limits]
    )
    table = {
        "inferd": inferd_server("inferd", [], str(ports["inferd"])),
        "inferd-lora": inferd_server("inferd-lora", ["--lora-modules", *modules, *limits], str(ports["inferd-lora"])),
        "vllm-lora": vllm,
    }
    return table, ports


def bench_run(server: Server, port: int, hf_folder: Path, names: list[str], level: int, seed: int, args) -> dict:
    mix = ["--lora-modules", *names] if names else []
    cmd = [
        sys.executable, "-m", "inferd.cli", "bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}", "--model", server.model_name, *mix,
        "--dataset", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
        "--num-prompts", str(3 * level), "--max-concurrency", str(level), "--num-warmups", "1",
        "--seed", str(seed), "--tokenizer-source", "local", "--tokenizer", str(hf_folder),
        "--label", server.name, "--save-result", "--no-progress", "--result-dir", str(RAW_DIR),
        "--result-filename", f"{server.name}.m{len(names)}.c{level}.s{seed}.json",
    ]  # fmt: skip
    return bench_serve(cmd, KEYS)


def load_cost(port: int) -> dict:
    """inferd's own count of adapter loads into slots and their time, from /metrics."""
    from benchmarks.procs import replica_metrics

    values = replica_metrics(f"http://127.0.0.1:{port}")
    loads, seconds = values.get("inferd:lora_loads_total", 0.0), values.get("inferd:lora_load_seconds_total", 0.0)
    return {"loads": loads, "seconds": seconds, "mean_ms": 1000 * seconds / loads if loads else None}


def ratios(entries: dict) -> dict:
    """Per mix, in the same run: output tok/s over the base model alone on `inferd`, and inferd-lora over
    vllm-lora."""
    base = entries.get("inferd", {}).get("mixes", {}).get("0", {}).get("median", {}).get("output_throughput")
    out: dict = {}
    for name, entry in entries.items():
        for mix, fig in entry["mixes"].items():
            tok = fig["median"].get("output_throughput")
            if base and tok:
                out.setdefault(f"{name}_over_base", {})[mix] = tok / base
            peer = entries.get("vllm-lora", {}).get("mixes", {}).get(mix, {}).get("median", {})
            if name == "inferd-lora" and tok and peer.get("output_throughput"):
                out.setdefault("inferd_lora_over_vllm_lora", {})[mix] = tok / peer["output_throughput"]
    return out


class _NoBase:
    """A base layer that costs nothing (its output: zeros), so only the LoRA products are timed."""

    def __init__(self, k: int, parts: list[int]):
        self.in_features, self.out_features, self.out_sizes = k, sum(parts), parts

    def __call__(self, x):
        import torch

        return torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)


def _per_adapter(layer, x, slots, rank: int, kernel=None):
    """One shrink and one expand per adapter, on its rows only."""
    y = layer.base(x)
    for slot in slots.unique().tolist():
        rows, r = (slots == slot).nonzero().flatten(), slice(slot * rank, (slot + 1) * rank)
        for a, b, offset, size in zip(layer.lora_a, layer.lora_b, layer.offsets, layer.out_sizes, strict=True):
            y[:, offset : offset + size].index_add_(0, rows, (x.index_select(0, rows) @ a[r].T) @ b[r])
    return y


def _masked(layer, x, slots, rank: int, kernel=None):
    """A shrink and an expand per part over every slot up to the highest in use, each row keeping its own."""
    import torch

    y = layer.base(x)
    width = (int(slots.max()) + 1) * rank
    mask = (slots[:, None] == (torch.arange(width) // rank)[None, :]).to(x.dtype)
    for a, b, offset, size in zip(layer.lora_a, layer.lora_b, layer.offsets, layer.out_sizes, strict=True):
        y[:, offset : offset + size].addmm_(torch.mm(x, a[:width].T).mul_(mask), b[:width])
    return y


def _native(layer, x, slots, rank: int, kernel=None):
    y = layer.base(x)
    kernel(y, x, layer.lora_a, layer.lora_b, layer.offsets, slots, rank)
    return y


def _each(layers, xs, fn):
    """`fn(layer, x)` over every layer, as one function of no arguments (for `alternated`)."""
    import torch

    return lambda: torch.cat([fn(layer, x) for layer, x in zip(layers, xs, strict=True)], dim=1)


def kernels(rank: int, repeats: int) -> dict:
    """Ways to add a step's LoRA products, on Gemma 3 270M's layer shapes (q/k/v, o, gate/up, down) in
    bfloat16, over 1, 4 and 16 adapters: a decode step (16 rows, adapters in turn) and a prefill step (256 rows in
    one contiguous run per adapter). `native_kernel`: `lora_add` for every row (inferd's path on CPU);
    `run_matmuls`: inferd's path without the kernel (dense matmuls on runs of LONG_RUN rows or more, masked
    matmuls over every slot in use for the rest); `masked_matmuls`: the masked pair for every row;
    `per_adapter`: a shrink and an expand per adapter on its rows. ms for the four layers of one decoder
    layer, their base layers excluded."""
    import functools

    import torch

    from benchmarks.common import alternated
    from inferd.models.cpu_kernels import lora_kernel
    from inferd.models.lora import LONG_RUN, LoRABatch, LoRALinear

    dtype, cpu = torch.bfloat16, torch.device("cpu")
    shapes = [(640, [1024, 256, 256]), (1024, [640]), (640, [2048, 2048]), (2048, [640])]
    out: dict = {"rank": rank, "dtype": "bfloat16", "long_run": LONG_RUN, "ms_per_decoder_layer": {}}
    for step, rows in (("decode", 16), ("prefill", 256)):
        for count in (1, 4, 16):
            batch = LoRABatch(rank, native=False)
            layers = [LoRALinear(_NoBase(k, parts), batch, count, dtype, cpu) for k, parts in shapes]
            kernel = lora_kernel()
            for layer in layers:
                for t in (*layer.lora_a, *layer.lora_b):
                    t.normal_(std=0.03)
            xs = [torch.randn(rows, k, dtype=dtype) for k, _ in shapes]
            slots = torch.arange(rows) % count if step == "decode" else torch.arange(rows) * count // rows
            batch.activate(slots.tolist(), cpu)  # as without the kernel: runs, and the masked pair for the rest
            fns = {"run_matmuls": _each(layers, xs, lambda layer, x: layer(x))}
            for name, fn in (("native_kernel", _native), ("masked_matmuls", _masked), ("per_adapter", _per_adapter)):
                if name != "native_kernel" or kernel is not None:
                    fns[name] = _each(layers, xs, functools.partial(fn, slots=slots, rank=rank, kernel=kernel))
            want = fns["per_adapter"]()
            for fn in fns.values():
                torch.testing.assert_close(fn(), want, rtol=0.05, atol=0.05)  # the same sums, however added
            times = alternated(fns, repeats)
            out["ms_per_decoder_layer"][f"{step},rows={rows},adapters={count}"] = times
            print(f"{step}, {rows} rows, {count} adapters: {times}", flush=True)
    return out


def gateway_affinity(args) -> dict:
    """Round robin, scored without and with LoRA affinity, when adapters outnumber the replicas' slots."""
    import random

    from benchmarks.procs import replica_metrics, start_gateway, wait_http
    from inferd.bench.client import send_all
    from inferd.bench.datasets import WORDS, BenchRequest
    from inferd.bench.metrics import ttft
    from inferd.measure.stats import percentile
    from inferd.procs import start_serve

    model = default_model(convert=False)
    adapters = make_adapters(model.hf_folder, args.gateway_adapters, args.rank)
    modules = [f"{name}={path}" for name, path in adapters]
    flags = ["--lora-modules", *modules, "--max-loras", str(args.gateway_slots), "--max-lora-rank", str(args.rank),
             "--max-model-len", "512", "--kv-cache-memory", "256MiB"]  # fmt: skip
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    reps = [start_serve("gemma3-270m", LOG_DIR, "m", *flags) for _ in range(2)]
    pickers = {
        "round_robin": {"picker": "round_robin"},
        "scored_without_lora_affinity": {"scorers": {"lora_affinity": 0}},
        "scored_with_lora_affinity": {},
    }
    out: dict = {"replicas": 2, "slots_per_replica": args.gateway_slots, "adapters": args.gateway_adapters,
                 "requests": args.gateway_requests, "concurrency": args.gateway_concurrency, "prompt_words": 64,
                 "output_tokens": 32, "runs": args.runs, "pickers": {}}  # fmt: skip
    try:
        for r in reps:
            wait_http(r, "/health", timeout=600)
        pool = {"name": "p", "replicas": [r.url for r in reps], "model": "m"}
        names = [name for name, _ in adapters]
        figures: dict[str, list[dict]] = {name: [] for name in pickers}
        for run in range(args.runs):
            for name, routing in pickers.items():  # alternated: each run of each picker with its own prompts
                rng = random.Random(run * 100 + list(pickers).index(name))
                prompts = [" ".join(rng.choice(WORDS) for _ in range(64)) for _ in range(args.gateway_requests)]
                requests = [BenchRequest(p, 64, 32, model=rng.choice(names)) for p in prompts]
                cfg = {"pools": [pool], "models": [{"name": "m", "adapters": names, "backends": [{"pool": "p"}]}],
                       "routing": routing, "scrape": {"interval_s": 0.2}}  # fmt: skip
                gw = start_gateway(cfg, LOG_DIR)
                try:
                    before = [replica_metrics(r.url) for r in reps]
                    started = time.perf_counter()
                    outs = send_all(gw.url, requests, concurrency=args.gateway_concurrency)
                    seconds = time.perf_counter() - started
                    if failed := next((o for o in outs if not o.success), None):
                        raise RuntimeError(f"a request through the gateway failed: {failed.error}")
                    ttfts = [ttft(o) for o in outs]
                    after = [replica_metrics(r.url) for r in reps]
                finally:
                    gw.stop()
                loads = sum(a.get("inferd:lora_loads_total", 0) - b.get("inferd:lora_loads_total", 0)
                            for a, b in zip(after, before, strict=True))  # fmt: skip
                fig = {"ttft_mean_s": statistics.mean(ttfts), "ttft_p99_s": percentile(ttfts, 99),
                       "output_tok_s": 32 * len(ttfts) / seconds, "adapter_loads": loads}  # fmt: skip
                figures[name].append(fig)
                print(f"[{name}] run {run}: {fig}", flush=True)
        for name, runs in figures.items():
            out["pickers"][name] = {"runs": runs, "median": {k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    finally:
        for r in reps:
            r.stop()
    rr, aff = out["pickers"]["round_robin"]["median"], out["pickers"]["scored_with_lora_affinity"]["median"]
    out["ttft_mean_round_robin_over_affinity"] = rr["ttft_mean_s"] / aff["ttft_mean_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None, help=f"comma-separated of {', '.join(SERVERS)} (default: installed)")
    p.add_argument("--mixes", default="0,1,4,16", help="distinct adapters per run, comma-separated")
    p.add_argument("--adapters", type=int, default=16, help="adapters made and served")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kernels", action="store_true", help="only the kernel comparison (no servers)")
    p.add_argument("--gateway", action="store_true", help="only the gateway's LoRA affinity against round robin")
    p.add_argument("--gateway-adapters", type=int, default=8)
    p.add_argument("--gateway-slots", type=int, default=2, help="adapter slots per replica (--max-loras)")
    p.add_argument("--gateway-requests", type=int, default=96)
    p.add_argument("--gateway-concurrency", type=int, default=8)
    p.add_argument("--out", default=None, help="results file name (default: lora-<CPU kind>)")
    p.add_argument("--fresh", action="store_true", help="the results file holds this run alone")
    args = p.parse_args()
    started = time.time()
    if args.kernels or args.gateway:
        part = {"kernels": kernels(args.rank, repeats=200)} if args.kernels else {"gateway": gateway_affinity(args)}
        result = {"benchmark": "lora", **part}
        path = record_run("lora", result, sys.argv, args.out, args.fresh, started)
        print(f"wrote {path}")
        return 0
    mixes = [int(m) for m in args.mixes.split(",")]
    if max(mixes) > args.adapters:
        raise SystemExit(f"a mix of {max(mixes)} adapters needs --adapters {max(mixes)} or more")
    model = default_model(convert=False)
    adapters = make_adapters(model.hf_folder, args.adapters, args.rank)
    table, ports = server_table(model, adapters, args.rank)
    chosen = chosen_servers(args.servers, table, SERVERS)
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    entries = {n: server_entry(table[n], mixes={}) for n in chosen}
    names = [name for name, _ in adapters]
    with running([(table[n], ports[n], entries[n]) for n in chosen]):
        runs: dict[tuple[str, int], list[dict]] = {}
        for run in range(args.runs):
            for mix in mixes:
                seed = mix * 1000 + run  # the same prompts for every server
                for name in chosen:
                    if name == "inferd" and mix:
                        continue  # no adapters there
                    got = bench_run(table[name], ports[name], model.hf_folder, names[:mix], args.concurrency,
                                    seed, args)  # fmt: skip
                    runs.setdefault((name, mix), []).append(got)
                    print(f"[{name}] {mix} adapters, run {run}: {got}", flush=True)
        for (name, mix), got in runs.items():
            entries[name]["mixes"][str(mix)] = {"runs": got, "median": median_of_runs(got, KEYS)}
        if "inferd-lora" in chosen:
            entries["inferd-lora"]["adapter_loads"] = load_cost(ports["inferd-lora"])
    result = {
        "benchmark": "lora",
        "workload": {"endpoint": "/v1/completions", "dataset": "random", "input_len": args.input_len,
                     "output_len": args.output_len, "ignore_eos": True, "temperature": 0,
                     "concurrency": args.concurrency, "num_prompts": 3 * args.concurrency, "runs": args.runs,
                     "mixes": mixes, "adapters": args.adapters, "rank": args.rank, "targets": list(TARGETS)},
        "servers": entries,
        "ratios": ratios(entries),
    }  # fmt: skip
    path = record_run("lora", result, sys.argv, args.out, args.fresh, started)
    print(json.dumps(result["ratios"], indent=1))
    print(f"wrote {path} (server logs in {LOG_DIR})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
