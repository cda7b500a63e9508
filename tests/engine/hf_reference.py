"""Greedy generation with Hugging Face transformers, the reference every engine test compares with."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each chosen token under the model's raw distribution
    top_ids: list[list[int]]  # top-5 token ids at each step


@cache
def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(folder: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> Reference:
    """Full forward each step (no HF cache): slow but the plainest possible reference."""
    model = _hf_model(str(folder))
    seq = list(prompt_ids)
    out = Reference([], [], [])
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([seq])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        token = int(logits.argmax())
        out.token_ids.append(token)
        out.logprobs.append(float(lp[token]))
        out.top_ids.append(lp.topk(5).indices.tolist())
        seq.append(token)
    return out


def prompt_set(vocab: int, lengths=(3, 9, 17, 31, 40, 57, 80, 123), seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths; the longer ones exceed the tiny Gemma 3's sliding window (24)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
