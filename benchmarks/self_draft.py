"""Self-drafting on open text: one stream (requests one at a time) of the default model writing prose that does
not repeat its prompt, with speculation off, n-gram lookup, and self-drafting (the model's body with its LM head
cut to its traffic's most frequent tokens, inferd/engine/draft_head.py), offline through `LLM`.

The three engines are loaded once and alternated request by request for `--rounds` rounds (this VM's speed
drifts); a first pass over the prompts fills the draft head's token counts and is not timed. Reported per mode:
output tok/s (median of the rounds), drafted and accepted tokens, and whether every greedy output equals the
output without speculation.

    python -m benchmarks.self_draft     # ~3 min on 2 cores; writes benchmarks/results/self_draft-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import OUT_HELP, record_run
from inferd.config import DEFAULT_MODEL
from inferd.engine.engine import LLM
from inferd.sampling import SamplingParams

PROMPTS = [
    "Write a short essay about the history of the printing press and its effect on Europe.",
    "Explain how a paged KV cache works in an LLM inference server, step by step.",
    "Tell me a story about a dragon who guards a library.",
    "List ten tips for writing clear technical documentation, with a sentence on each.",
    "Describe the water cycle to a ten-year-old.",
    "What are the trade-offs between trains and planes for travel within Europe?",
]
MODES = {
    "off": {},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    "self_draft": {"speculative_config": {"method": "self_draft", "num_speculative_tokens": 3}},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    started = time.time()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llms = {mode: LLM(args.model, max_model_len=1024, max_num_seqs=4, **kw) for mode, kw in MODES.items()}
    for llm in llms.values():
        llm.generate(PROMPTS, params)  # the draft head's first counts
    outputs: dict[str, list[list[int]]] = {mode: [] for mode in MODES}  # the first round's, one request at a time
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    before = {mode: llm.engine.stats() for mode, llm in llms.items()}
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            for mode, llm in llms.items():  # alternated request by request
                llm.reset_prefix_cache()  # each round repeats the prompts
                t = time.perf_counter()
                out = llm.generate([prompt], params)[0].outputs[0].token_ids
                seconds[mode].append(time.perf_counter() - t)
                if len(outputs[mode]) < len(PROMPTS):
                    outputs[mode].append(out)
    result = {"model": args.model, "max_tokens": args.max_tokens, "prompts": len(PROMPTS), "modes": {}}
    for mode, llm in llms.items():
        s, s0 = llm.engine.stats(), before[mode]
        per_round = [sum(seconds[mode][r * len(PROMPTS) : (r + 1) * len(PROMPTS)]) for r in range(args.rounds)]
        result["modes"][mode] = {
            "settings": MODES[mode],
            "output_tokens_per_s": len(PROMPTS) * args.max_tokens / statistics.median(per_round),
            "rounds_s": per_round,
            "draft_tokens": s.spec_num_draft_tokens - s0.spec_num_draft_tokens,
            "accepted_tokens": s.spec_num_accepted_tokens - s0.spec_num_accepted_tokens,
            "greedy_equal_to_off": outputs[mode] == outputs["off"],
        }
    off = result["modes"]["off"]["output_tokens_per_s"]
    for mode in MODES:
        result["modes"][mode]["over_off"] = result["modes"][mode]["output_tokens_per_s"] / off
    print(record_run("self_draft", result, sys.argv, args.out, started=started))
    for mode, m in result["modes"].items():
        print(mode, {k: v for k, v in m.items() if k not in ("settings", "rounds_s")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
