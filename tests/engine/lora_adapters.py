"""PEFT LoRA adapters for the tiny test models, made with peft itself, and transformers + peft as reference."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Path, out: Path, targets=ALL_TARGETS, r: int = 4, alpha: float = 8, seed: int = 0, **extra
) -> Path:
    """A random adapter (both A and B random, so it changes the model's output) saved as PEFT saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **extra)
    get_peft_model(model, config).save_pretrained(out)
    return out


@cache
def _peft_model(base: str, adapter: str, merged: bool):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    return (model.merge_and_unload() if merged else model).eval()


@torch.inference_mode()
def peft_greedy(base: Path, adapter: Path, prompt: list[int], n: int, merged: bool = False) -> list[int]:
    """Greedy tokens of transformers + peft (full forward each step, as tests/engine/hf_reference.py)."""
    model = _peft_model(str(base), str(adapter), merged)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]
