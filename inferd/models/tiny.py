"""Tiny random-weight models built from a config, no download: the one builder the labs' `--quick` model,
the benchmarks' random models and the tests' models of every architecture come from (it sits beside the
models, so none of them imports another's package for it).

`write_random_model` saves a Hugging Face folder (config, safetensors, tokenizer) that both inferd and
transformers load; `build_tokenizer` trains the byte-level BPE tokenizer it carries; `llama_config` is
the shape the labs and the benchmarks use, a Llama of a given size.

The labs' model (`tiny_model`) is big enough that a forward pass does real matmuls, small enough that every
lab finishes in seconds. It is built once per machine into the inferd cache (`~/.cache/inferd/labs/`),
written to a temporary folder and renamed into place, so concurrent runs never see half a model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TINY_NAME = "tiny-llama-v1"
VOCAB = 512
# what the tokenizers are trained on (the weights are random anyway)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "Paged attention stores keys and values in fixed-size blocks. ",
    "Continuous batching lets requests join and leave every step. ",
    "Prefill reads the prompt; decode writes one token at a time. ",
    "Goodput is the throughput that meets the latency objectives. ",
    "def add(a, b):\n    return a + b\n",
    "1234567890 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \" ",
)


def tiny_dir() -> Path:
    from inferd.models.loader import cache_dir

    return cache_dir() / "labs" / TINY_NAME


def is_tiny(model: str | None) -> bool:
    return model is not None and Path(model).name == TINY_NAME


def build_tokenizer(vocab_size: int, corpus: Sequence[str] = CORPUS, chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on `corpus`, with <pad> = 0, <eos> = 1 and <bos> = 2."""
    import transformers as tf
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        list(corpus) * 20, vocab_size=vocab_size, min_frequency=1, special_tokens=["<pad>", "<eos>", "<bos>"]
    )
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def llama_config(vocab_size: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **extra: Any):
    """A Llama config of this size, with the special token ids `build_tokenizer` gives."""
    import transformers as tf

    return tf.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
        **extra,
    )


def write_random_model(
    folder: Path, config, tokenizer, seed: int = 0, adjust: Callable[[Any], None] | None = None
) -> Path:
    """Random float32 weights for `config` (from `seed`; `adjust` may change them before saving) and the
    tokenizer, saved into `folder`."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _build(folder: Path) -> None:
    config = llama_config(VOCAB, 128, 384, 4, 4, 2, rms_norm_eps=1e-6)
    write_random_model(folder, config, build_tokenizer(VOCAB))


def tiny_model(root: Path | None = None) -> Path:
    """The labs' tiny model's folder, built on first use."""
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
