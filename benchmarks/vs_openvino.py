"""Offline throughput against OpenVINO GenAI, the fastest CPU engine found that runs here.

The same mixed requests (prompts ~60-400 tokens, 64-192 tokens out, greedy, ignore_eos) through OpenVINO GenAI's
`ContinuousBatchingPipeline` (16 sequences, a 512-token batch budget, weights int8 from `optimum-cli export
openvino --weight-format int8`) and through inferd's `LLM.generate` with the same limits (`max_num_seqs` 16,
`max_num_batched_tokens` 512) in each of `--modes` (default: `default`, no flags: int8 weights on a CPU; `gguf`:
the GGUF's own blocks). Each round runs every engine once on the same requests, in turn; output tokens/s per
round and the median over rounds, with each side's weight format named. OpenVINO runs in its own virtual
environment (it needs transformers < 5), one process a round, timed around `generate` only.

    python benchmarks/vs_openvino.py --setup          # once: its venv under ~/.cache/inferd-peers/openvino, export
    python benchmarks/vs_openvino.py [--rounds 3] [--modes default,gguf] [--requests 48]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import OUT_HELP, PREFIX_CACHE_RESET, machine, record_run  # noqa: E402
from inferd.bench.peers import home_path, importable, peer_python, peers_dir  # noqa: E402

VENV = peers_dir() / "openvino"
EXPORT = peers_dir() / "openvino-gemma3-270m-int8"
MODES = {"default": {}, "gguf": {"quantization": "gguf"}, "int8": {"quantization": "int8"}}
LIMITS = {"max_num_seqs": 16, "max_num_batched_tokens": 512}

# what OpenVINO's process runs: the pipeline over the requests on its stdin, the time of `generate` on stdout
OPENVINO_RUN = """
import json, sys, time
import numpy as np
import openvino as o
import openvino_genai as ov
spec = json.load(sys.stdin)
prompts = [o.Tensor(np.array([ids], dtype=np.int64)) for ids in spec["prompts"]]
sched = ov.SchedulerConfig()
sched.max_num_seqs, sched.max_num_batched_tokens = spec["max_num_seqs"], spec["max_num_batched_tokens"]
sched.cache_size, sched.enable_prefix_caching, sched.dynamic_split_fuse = 2, False, True
pipe = ov.ContinuousBatchingPipeline(spec["model"], sched, "CPU")
configs = []
for n in spec["max_tokens"]:
    c = ov.GenerationConfig()
    c.max_new_tokens, c.min_new_tokens, c.ignore_eos, c.do_sample = n, n, True, False
    configs.append(c)
warm = ov.GenerationConfig()
warm.max_new_tokens = 4
pipe.generate(prompts[:2], [warm, warm])
start = time.perf_counter()
results = pipe.generate(prompts, configs)
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": elapsed, "tokens": [len(r.m_generation_ids[0]) for r in results]}))
"""


def setup(hf_folder: Path) -> None:
    """Its venv (openvino-genai, optimum-intel, transformers < 5) and the int8 export of the default model."""
    if not VENV.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "pip"), "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first, as for inferd: the CPU build where one is at hand
    subprocess.run([*pip, "openvino-genai", "optimum-intel[openvino]", "transformers<5", "accelerate"], check=True)
    cli = VENV / "bin" / "optimum-cli"
    export = [str(cli), "export", "openvino", "--model", str(hf_folder), "--task", "text-generation-with-past"]
    subprocess.run([*export, "--weight-format", "int8", str(EXPORT)], check=True)


def workload(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n prompts of ~60-400 tokens, as token ids (BOS first) both engines take as they are, and 64-192 tokens out
    each."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.convert_ids_to_tokens(range(1000, 6000)) if w.isalpha() and len(w) > 3][:2000]
    prompts, outs = [], []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 320)))
        prompts.append(tokenizer(text)["input_ids"])
        outs.append(rng.randint(64, 192))
    return prompts, outs


def run_openvino(prompts: list[list[int]], outs: list[int], timeout_s: float) -> dict:
    spec = {"model": str(EXPORT), "prompts": prompts, "max_tokens": outs, **LIMITS}
    done = subprocess.run(
        [str(peer_python("openvino")), "-c", OPENVINO_RUN],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode:
        raise SystemExit(f"OpenVINO's run failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": result["seconds"], "output_tokens": sum(result["tokens"])}


def run_inferd(llm, prompts: list[list[int]], outs: list[int]) -> dict:
    from inferd import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
    llm.reset_prefix_cache()  # every round sends the same prompts; OpenVINO runs with its prefix cache off
    start = time.perf_counter()
    done = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="make OpenVINO's venv and export the model, then stop")
    ap.add_argument("--modes", default="default", help=f"inferd's modes, comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds OpenVINO's process may take a round")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()

    from inferd import LLM
    from inferd.models.loader import convert_gguf, default_gguf_path, load_tokenizer

    hf_folder = convert_gguf(default_gguf_path())
    if args.setup:
        setup(hf_folder)
        return
    if why := importable(peer_python("openvino"), "openvino_genai", "OpenVINO GenAI", 120):
        raise SystemExit(f"{why}: run `python benchmarks/vs_openvino.py --setup` first")
    if not (EXPORT / "openvino_model.xml").exists():
        raise SystemExit(f"no export at {home_path(EXPORT)}: run `python benchmarks/vs_openvino.py --setup`")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    prompts, outs = workload(load_tokenizer(hf_folder), args.requests, args.seed)
    lengths = sorted(len(p) for p in prompts)
    engines = {f"inferd-{m}": LLM(max_model_len=1024, **LIMITS, **MODES[m]) for m in modes}
    for llm in engines.values():  # warm: kernels built, first steps taken
        run_inferd(llm, prompts[:2], [4, 4])
    rounds: dict[str, list[dict]] = {name: [] for name in ["openvino", *engines]}
    for r in range(args.rounds):
        rounds["openvino"].append(run_openvino(prompts, outs, args.timeout))
        for name, llm in engines.items():
            rounds[name].append(run_inferd(llm, prompts, outs))
        line = "  ".join(f"{k} {v[-1]['output_tokens'] / v[-1]['seconds']:.1f}" for k, v in rounds.items())
        print(f"round {r + 1}: output tok/s  {line}", flush=True)
    workload_rec = {"requests": args.requests, "seed": args.seed, "prompt_tokens": [lengths[0], lengths[-1]]}
    workload_rec["prefix_cache"] = PREFIX_CACHE_RESET
    workload_rec |= {"prompt_tokens_total": sum(lengths), "output_tokens_total": sum(outs), **LIMITS}
    result = {"machine": machine(), "workload": workload_rec}
    result["engines"] = {
        name: {
            "weights": "int8 (optimum-cli --weight-format int8)"
            if name == "openvino"
            else engines[name].engine.quantization or "the dtype",
            "output_tok_s": statistics.median(x["output_tokens"] / x["seconds"] for x in runs),
            "rounds": runs,
        }
        for name, runs in rounds.items()
    }
    base = result["engines"]["openvino"]["output_tok_s"]
    for name in engines:
        result["engines"][name]["vs_openvino"] = result["engines"][name]["output_tok_s"] / base
        print(f"{name} ({result['engines'][name]['weights']}): {result['engines'][name]['vs_openvino']:.2f}x OpenVINO")
    print(f"wrote {record_run('vs_openvino', result, sys.argv, args.out)}")


if __name__ == "__main__":
    main()
