"""The GGUF's own perplexity: inferd's modes against llama.cpp's `llama-perplexity`, on the very same token ids.

llama.cpp's perplexity tool scores a text this way: its tokens (BOS first) cut into chunks of `-c` tokens,
each chunk's first token replaced by BOS, and only the second half of each chunk scored, so every scored
token has at least half a chunk of context. This script runs that tool on the default model's GGUF and then
scores the same ids the same way in each inferd mode, through the engine's model and LM head
(`benchmarks.quality.window_nll`). The ids come from llama.cpp's own `llama-tokenize`, so a difference
between the two tokenizers cannot enter the comparison; whether inferd's tokenizer gives the same ids is
recorded beside it.

Modes (`--modes`, those of `benchmarks.quality`): `gguf` computes on the file's own blocks, as llama.cpp does,
both rounding activations to 8 bits; `fp32` is the blocks dequantized to floats (inferd's reference);
`default` is `inferd serve` with no flags. The text is `benchmarks.quality`'s (CPython's pydoc topics).

    python benchmarks/vs_peers.py --setup llama-server     # builds llama-perplexity and llama-tokenize too
    python -m benchmarks.perplexity_vs_llama_cpp --modes fp32,gguf,default --chunks 32

Results: benchmarks/results/perplexity_vs_llama_cpp-<this CPU's kind>.json (`--out`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT_HELP, machine, record_run
from benchmarks.quality import MODES, english_text, window_nll
from inferd import LLM
from inferd.bench.peers import home_path, llama_cpp_bin
from inferd.config import DEFAULT_MODEL

FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_tool(name: str) -> Path:
    path = llama_cpp_bin(name)
    if not path.exists():
        raise SystemExit(f"{home_path(path)} is missing: run `python benchmarks/vs_peers.py --setup llama-server`")
    return path


def llama_ids(gguf: Path, text_file: Path) -> list[int]:
    """The text's ids as llama.cpp tokenizes it for perplexity (BOS first, special tokens not parsed)."""
    cmd = [str(llama_tool("llama-tokenize")), "-m", str(gguf), "-f", str(text_file), "--ids", "--log-disable"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_perplexity(gguf: Path, text_file: Path, ctx: int, chunks: int, threads: int) -> dict:
    cmd = [str(llama_tool("llama-perplexity")), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx)]
    cmd += ["--chunks", str(chunks), "-t", str(threads), "-tb", str(threads), "-b", str(ctx)]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    found = FINAL.search(done.stdout + done.stderr)
    if done.returncode or not found:
        raise SystemExit(f"llama-perplexity failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    return {
        "perplexity": float(found.group(1)),
        "plus_minus": float(found.group(2)),
        "seconds": time.perf_counter() - t,
        "command": "llama-perplexity " + " ".join(a if "/" not in a else Path(a).name for a in cmd[1:]),
    }


def inferd_perplexity(name: str, model: str, ids: list[int], ctx: int, chunks: int, rows: int | None) -> dict:
    """llama-perplexity's score over `ids` in an inferd mode: per chunk, BOS for its first id, the second
    half scored."""
    t = time.perf_counter()
    llm = LLM(model, max_model_len=ctx, kv_cache_memory=2**30, **MODES[name])
    bos = llm.tokenizer.bos_token_id
    nll, count = 0.0, 0
    for i in range(chunks):
        chunk = ids[i * ctx : (i + 1) * ctx]
        n, c = window_nll(llm, [bos, *chunk[1:]], rows, score_from=ctx // 2)
        nll, count = nll + n, count + c
    engine = llm.engine
    result = {
        "settings": MODES[name],
        "dtype": engine.dtype_choice.name,
        "quantization": engine.quantization,
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "seconds": time.perf_counter() - t,
    }
    engine.check_idle()
    del llm, engine
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="fp32,gguf,default", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity's -c)")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rows", type=int, help="inferd: score in prefill chunks of this many rows (quality.py)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")

    from inferd.models.loader import default_gguf_path, load_tokenizer, resolve_model

    gguf = default_gguf_path()
    text = english_text().rstrip("\n")  # llama.cpp drops a file's last newline
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text)
        ids = llama_ids(gguf, text_file)
        if len(ids) < args.chunks * args.ctx:
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than {args.chunks} chunks of {args.ctx}")
        llama = llama_perplexity(gguf, text_file, args.ctx, args.chunks, args.threads)
    print(f"llama.cpp   ppl {llama['perplexity']:.4f} +/- {llama['plus_minus']:.4f}", flush=True)
    ours = load_tokenizer(resolve_model(DEFAULT_MODEL)).encode(text)
    used = args.chunks * args.ctx
    same = sum(a == b for a, b in zip(ids[:used], ours[:used], strict=False))
    results = {}
    for name in modes:
        r = results[name] = inferd_perplexity(name, DEFAULT_MODEL, ids, args.ctx, args.chunks, args.rows)
        r["over_llama_cpp"] = r["perplexity"] / llama["perplexity"]
        print(f"{name:10s} ppl {r['perplexity']:.4f}  over llama.cpp {r['over_llama_cpp']:.4f}", flush=True)
    out = {
        "model": DEFAULT_MODEL,
        "gguf": gguf.name,
        "workload": {
            "text": "pydoc_data.topics, topics in sorted order, joined by blank lines (benchmarks.quality)",
            "ctx": args.ctx,
            "chunks": args.chunks,
            "scored_tokens_per_chunk": args.ctx - 1 - args.ctx // 2,
            "rows": args.rows,
            "ids": f"llama-tokenize's; inferd's tokenizer gives the same id at {same} of the first {used} positions",
        },
        "machine": machine(),
        "llama_cpp": llama,
        "modes": results,
    }
    print(f"wrote {record_run('perplexity_vs_llama_cpp', out, sys.argv, args.out)}")


if __name__ == "__main__":
    main()
