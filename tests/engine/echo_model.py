"""A tiny model that repeats itself, so speculative decoding's drafts are accepted (or, scaled less, mostly
rejected) on purpose: a random model's greedy text rarely repeats at all."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def echo_model(src: Path, dst: Path, residual_scale: float) -> Path:
    """The tiny Llama with its attention and MLP outputs scaled by `residual_scale` and its LM head tied to
    the embedding: at 0 it writes its last token again and again (every draft is accepted), at 0.3 mostly
    not (most are rejected); a random model's greedy text rarely repeats at all."""
    shutil.copytree(src, dst)
    (path,) = dst.glob("*.safetensors")
    weights = load_file(str(path))
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * residual_scale
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(path), metadata={"format": "pt"})
    return dst
