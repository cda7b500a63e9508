"""A replica killed under streams: do they all go on exactly, and what does the resume cost them?

Two `inferd serve` replicas of the default model behind `inferd gateway` with `resume` on the route (round
robin, so the streams split across both). Eight streams run at once, four greedy and four sampled at
temperature 0.8 with seeds, `--max-tokens` each; once every stream has its first tokens, one replica gets
SIGKILL. Each stream's text is compared with the same request's uninterrupted answer (asked of the survivor
before, one at a time), and for each stream the longest gap between two chunks is taken: for a stream that was
on the killed replica that is its stall, from its last chunk there to its first from the survivor. Beside it,
the survivor's TTFT for that stream's prompt plus the tokens it had delivered, asked alone afterwards (one
prefill of what the resume sends), and the TTFT of all the resumed streams' prefills sent at once. The stall
also holds the wait for the kill after the stream's last chunk, the gateway's notice of the break and the
survivor's running batch, which the resumed streams join; it is recorded in those parts, with the time the
killed process takes to end (the kernel closes its sockets only after freeing its memory: until then the
gateway sees a silent stream, not a broken one). `--quantization none` serves the checkpoint's values in float;
the default is int8 on CPU. The survivor computes the delivered tokens as decode rows, as the first replica
decoded them, so the continuation is exact with int8 weights too.

    python -m benchmarks.resume     # ~2 min on 2 cores; writes benchmarks/results/resume-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import OUT_HELP, record_run
from inferd.config import DEFAULT_MODEL
from inferd.procs import ProcGroup, gateway_config, start_gateway

PROMPTS = [
    "Write a short essay about the history of the printing press.",
    "Explain how a paged KV cache works, step by step.",
    "Tell me a story about a dragon who guards a library.",
    "List ten tips for writing clear technical documentation.",
    "Describe the water cycle to a ten-year-old.",
    "What are the trade-offs between trains and planes in Europe?",
    "Explain continuous batching to a new engineer.",
    "Write a letter to a friend about a trip to the mountains.",
]


def body(i: int, max_tokens: int) -> dict:
    sampling = {"temperature": 0} if i < 4 else {"temperature": 0.8, "seed": i}
    return {"model": "m", "prompt": PROMPTS[i], "max_tokens": max_tokens, "ignore_eos": True, **sampling}


def stream(url: str, req: dict, out: dict, started: threading.Event) -> None:
    """One stream through the gateway: its chunks' arrival times and texts, the replica it began on, its end."""
    out.update(times=[], text="", ids=[], done=False, error=None)
    # the final usage carries the engine's account of the last replica's part (`return_timing`): for a resumed
    # stream, the survivor's queue and prefill of the continuation
    extra = {"stream": True, "return_token_ids": True, "return_timing": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json={**req, **extra}, timeout=300) as r:
        out["replica"] = r.headers.get("x-inferd-replica")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                if chunk.get("usage"):
                    out["timing"] = chunk["usage"].get("timing")
                for c in chunk["choices"]:
                    out["text"] += c.get("text") or ""
                    out["ids"] += c.get("token_ids") or []
                out["times"].append(time.perf_counter())
                if len(out["ids"]) >= 4:
                    started.set()


def ttft(url: str, prompt: list[int], salt: str) -> float:
    """The survivor's time to first token for a token-id prompt, computed whole: a fresh `cache_salt` keeps the
    blocks the resume left in its prefix cache out of it."""
    t = time.perf_counter()
    req = {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True, "cache_salt": salt}
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json=req) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t
    raise RuntimeError("no token")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--quantization", default=None, help="the replicas' --quantization (default: theirs, auto)")
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    started_at = time.time()
    logs = Path(tempfile.mkdtemp(prefix="inferd-resume-"))
    flags = ["--quantization", args.quantization] if args.quantization else []
    with ProcGroup(args.model, logs, flags, start_timeout=900) as group:
        reps = group.replicas(2)
        cfg = gateway_config([r.url for r in reps], routing={"picker": "round_robin"})
        cfg["models"][0]["resume"] = {"enabled": True}
        cfg["expose_replica_header"] = True
        gateway = group.started(start_gateway(cfg, logs))
        victim, survivor = reps
        want = []
        for i in range(len(PROMPTS)):  # the uninterrupted answers, from the survivor (salted: the resumes
            # must not find these blocks in its prefix cache)
            want_body = {**body(i, args.max_tokens), "return_token_ids": True, "cache_salt": "uninterrupted"}
            r = httpx.post(survivor.url + "/v1/completions", json=want_body, timeout=300)
            choice = r.json()["choices"][0]
            want.append((choice["text"], choice["token_ids"]))
        outs = [{} for _ in PROMPTS]
        firsts = [threading.Event() for _ in PROMPTS]
        threads = [threading.Thread(target=stream, args=(gateway.url, body(i, args.max_tokens), outs[i], firsts[i]))
                   for i in range(len(PROMPTS))]  # fmt: skip
        for t in threads:
            t.start()
        for e in firsts:
            e.wait(120)
        killed_at = time.perf_counter()
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait(60)  # the kernel closes a killed process's sockets only after freeing its memory
        dead_at = time.perf_counter()
        for t in threads:
            t.join(300)
        streams = []
        for i, out in enumerate(outs):
            gaps = [b - a for a, b in zip(out["times"], out["times"][1:], strict=False)]
            moved = out.get("replica") == victim.url
            # a moved stream's stall ends at the survivor's first chunk (the killed replica's last may arrive after
            # the kill: negative `last_chunk_to_kill_s`)
            stall = gaps.index(max(gaps)) + 1 if moved and gaps else None
            before = out["times"][:stall] if stall else []
            delivered = out["ids"][: len(before)]
            resumed_at = out["times"][stall] if stall else None
            streams.append({
                "sampling": "greedy" if i < 4 else "seeded",
                "on_killed_replica": moved,
                "completed": out["done"] and out["error"] is None,
                "text_equal": out["text"] == want[i][0],
                "token_ids_equal": out["ids"] == want[i][1],
                "tokens": len(out["ids"]),
                "longest_gap_s": round(max(gaps), 3) if gaps else None,
                "median_gap_s": round(sorted(gaps)[len(gaps) // 2], 3) if gaps else None,
                "delivered_before_kill": len(delivered),
                # the stall's two parts: its last chunk before the kill to the kill, the kill to its next chunk
                "last_chunk_to_kill_s": round(killed_at - before[-1], 3) if before else None,
                "kill_to_next_chunk_s": round(resumed_at - killed_at, 3) if resumed_at else None,
                # of which: the process's end (its sockets close then), and the resume from there
                "kill_to_exit_s": round(dead_at - killed_at, 3) if moved else None,
                "exit_to_next_chunk_s": round(resumed_at - dead_at, 3) if resumed_at else None,
                # on the replica that finished it (the survivor, for a resumed one): its wait and its first step
                "final_replica_queue_s": round(out["timing"]["queue_ms"] / 1000, 3) if out.get("timing") else None,
                "final_replica_ttft_s": round(out["timing"]["ttft_ms"] / 1000, 3) if out.get("timing") else None,
            })  # fmt: skip
        tokenize = lambda text: httpx.post(survivor.url + "/tokenize", json={"model": "m", "prompt": text},
                                           timeout=30).json()["tokens"]  # fmt: skip
        resent = {}
        for i, s in enumerate(streams):
            if s["on_killed_replica"]:  # one prefill of what the resume sent, on the survivor alone
                resent[i] = tokenize(PROMPTS[i]) + outs[i]["ids"][: s["delivered_before_kill"]]
                s["prefill_of_resume_s"] = round(ttft(survivor.url, resent[i], f"alone-{i}"), 3)
        # and all of them at once, as the resumes reached the survivor: the prefill they share
        together: dict[int, float] = {}

        def send(i: int) -> None:
            together[i] = ttft(survivor.url, resent[i], f"together-{i}")

        senders = [threading.Thread(target=send, args=(i,)) for i in resent]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        result = {"model": args.model, "quantization": args.quantization or "auto", "max_tokens": args.max_tokens}
        result["streams"] = streams
        moved = [s for s in streams if s["on_killed_replica"]]
        result["summary"] = {
            "streams": len(streams),
            "completed": sum(s["completed"] for s in streams),
            "identical": sum(s["text_equal"] and s["token_ids_equal"] for s in streams),
            "identical_resumed": sum(s["text_equal"] and s["token_ids_equal"] for s in moved),
            "resumed": len(moved),
            "stall_s": [s["longest_gap_s"] for s in moved],
            "prefill_of_resume_s": [s["prefill_of_resume_s"] for s in moved],
            "prefill_of_all_resumes_together_s": round(max(together.values()), 3) if together else None,
            "last_chunk_to_kill_s": [s["last_chunk_to_kill_s"] for s in moved],
            "kill_to_next_chunk_s": [s["kill_to_next_chunk_s"] for s in moved],
            "kill_to_exit_s": round(dead_at - killed_at, 3),
            "exit_to_next_chunk_s": [s["exit_to_next_chunk_s"] for s in moved],
            "survivor_queue_s": [s["final_replica_queue_s"] for s in moved],
            "survivor_ttft_s": [s["final_replica_ttft_s"] for s in moved],
            "median_gap_s": [s["median_gap_s"] for s in streams],
        }
        print(record_run("resume", result, sys.argv, args.out, started=started_at))
        print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
