"""The tiny model `--quick` labs run on: a random-weight Llama built from a config, no download.

Big enough that a forward pass does real matmuls, small enough that every lab finishes in seconds. It is
built once per machine into the inferd cache (`~/.cache/inferd/labs/`), written to a temporary folder
and renamed into place, so concurrent runs never see half a model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

TINY_NAME = "tiny-llama-v1"
VOCAB = 512
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paged attention stores keys and values in fixed-size blocks. ",
    "Continuous batching lets requests join and leave every step. ",
    "Prefill reads the prompt; decode writes one token at a time. ",
    "Goodput is the throughput that meets the latency objectives. ",
    "def add(a, b):\n    return a + b\n",
    "1234567890 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \" ",
]


def tiny_dir() -> Path:
    from inferd.models.loader import cache_dir

    return cache_dir() / "labs" / TINY_NAME


def is_tiny(model: str | None) -> bool:
    return model is not None and Path(model).name == TINY_NAME


def _build(folder: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import ByteLevelBPETokenizer

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
    )
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(_CORPUS * 20, vocab_size=VOCAB, min_frequency=1, special_tokens=["<pad>", "<eos>", "<bos>"])
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)


def tiny_model(root: Path | None = None) -> Path:
    """The tiny model's folder, built on first use."""
    folder = (root / TINY_NAME) if root else tiny_dir()
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    try:
        _build(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first: use theirs
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
