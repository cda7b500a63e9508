"""Tiny random-weight models for every architecture, built from configs (no downloads).

`tiny_model(arch)` returns a Hugging Face folder (config.json, model.safetensors, tokenizer) that both
inferd and transformers load, so tests can compare them token for token.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from inferd.models import tiny

TINY_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Question: What is the capital of France?\nAnswer: Paris. ",
    "Paged attention stores keys and values in fixed-size blocks. ",
    "Continuous batching lets requests join and leave every step. ",
    "Größe, café, naïve, 東京, こんにちは, 🙂🚀 — unicode for the byte-level tokenizer. ",
    "def add(a, b):\n    return a + b\n",
    "1234567890 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \" ",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

VOCAB = 384


def build_tokenizer():
    """The tests' tokenizer: a corpus with non-ASCII text, and a chat template."""
    return tiny.build_tokenizer(VOCAB, _CORPUS, CHAT_TEMPLATE)


def tiny_config(arch: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
        return tf.LlamaConfig(**common, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True}, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, architectures=["Qwen3ForCausalLM"])
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4, "num_key_value_heads": 1, "tie_word_embeddings": True},
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=24,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            architectures=["Gemma3ForCausalLM"],
        )
    raise ValueError(arch)


def build_tiny_model(arch: str, folder: Path) -> Path:
    config = tiny_config(arch)
    config.initializer_range = 0.2  # peaked distributions: greedy ties would make exactness tests fragile

    def random_norms(model) -> None:  # so a wrong norm formula cannot hide behind weight=1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if arch == "gemma3" else 1.0))

    return tiny.write_random_model(folder, config, build_tokenizer(), seed=1234, adjust=random_norms)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request, tiny_models) -> Path:
    return tiny_models[request.param]


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # two cores here: let torch use them, and keep tokenizers from spawning more
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


_kernels_built: dict[str, bool] = {}


def pytest_sessionstart(session):
    """The native kernels compiled once, before any test starts a server. On a new machine each takes about a
    minute to compile on 2 cores (-march=native, cached per CPU), and a server compiling them at start-up
    overran the tests' start-up deadlines. This is a session hook, not a fixture: a fixture's setup counts
    against the first test's timeout, and the compiles alone overran it in CI."""
    from inferd.models import cpu_kernels

    _kernels_built.update(cpu_kernels.build_all())


@pytest.fixture(autouse=True, scope="session")
def _native_kernels_built():
    """A kernel that failed to build is reported first, and visibly: the tests then run the reference path,
    which the kernels' own tests catch."""
    missing = [name for name, ok in _kernels_built.items() if not ok]
    if missing and not os.environ.get("INFERD_DISABLE_CPU_KERNELS"):
        warnings.warn(f"native kernels that did not build: {', '.join(missing)}", stacklevel=1)
    yield


def pytest_addoption(parser):
    parser.addoption(
        "--shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="run the modules in a shuffled order, and each module's tests in a shuffled order (a test must pass "
        "alone and after any other); SEED makes the order repeatable. Also INFERD_TEST_SHUFFLE=SEED",
    )


def _shuffle_seed(config) -> int | None:
    seed = config.getoption("--shuffle")
    env = os.environ.get("INFERD_TEST_SHUFFLE")
    return seed if seed is not None else int(env) if env else None


def pytest_report_header(config):
    seed = _shuffle_seed(config)
    return None if seed is None else f"tests shuffled: --shuffle {seed} repeats this order"


def pytest_collection_modifyitems(config, items):
    """--shuffle: modules in a random order, tests within each in a random order. Modules stay whole, so a
    module's servers start once, as in file order."""
    import random

    seed = _shuffle_seed(config)
    if seed is None:
        return
    rng = random.Random(seed)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules.values())
    rng.shuffle(order)
    for group in order:
        rng.shuffle(group)
    items[:] = [item for group in order for item in group]


def cpu_feature_marks(missing: bool, reason: str) -> list:
    """The marks that skip a test where this CPU lacks (or has) the feature it is about, with `reason`: the only
    skip CI allows (`pytest.mark.cpu_feature` on a test that calls `pytest.skip` itself does the same). As a
    list, for `pytest.param(..., marks=...)`; `cpu_feature` applies them to a test."""
    return [pytest.mark.cpu_feature, pytest.mark.skipif(missing, reason=reason)]


def cpu_feature(missing: bool, reason: str):
    """A decorator: `cpu_feature_marks` on a test."""

    def mark(test):
        for m in cpu_feature_marks(missing, reason):
            test = m(test)
        return test

    return mark


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (`CI=true`) a skip fails the test unless the test is about a CPU feature this machine lacks: a
    missing system package (redis-server, prometheus, chromium) or tool must not turn a test into a pass."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and in_ci() and not item.get_closest_marker("cpu_feature"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where only a missing CPU feature may skip a test: {reason}"


def assert_idle(llm) -> None:
    """The invariant after every engine test: no request left, every block free or cached."""
    llm.engine.check_idle()
