"""Engine: add requests, step, abort. LLM: the offline facade over it.

The engine owns what belongs to an API request: the fan-out of `n` into sequences, detokenization,
stop strings and the outputs. A sequence's progress through the model is the scheduler's
(`Scheduler.update_from_output`); the engine only asks it to finish a sequence whose text hit a stop
string, or that was aborted. A resumed request (`SamplingParams.resume_token_ids`: a stream another
replica began) starts with the tokens already sent as its output, and its outputs leave them out.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from inferd.chat import render_chat
from inferd.config import DEFAULT_MODEL, EngineConfig, SpeculativeConfig, make_engine_config
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.draft_head import DraftHead
from inferd.engine.events import StepEvents
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.kv_publisher import KVEventRecorder, ZmqEventPublisher
from inferd.engine.kv_tier import KVTiers, TierStats
from inferd.engine.lora import LoRAManager
from inferd.engine.runner import ModelRunner
from inferd.engine.scheduler import SampledToken, Scheduler
from inferd.engine.spec_decode import PROPOSERS, DraftPlanner, Proposer, SpecStats
from inferd.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from inferd.models import loader
from inferd.models.dtypes import resolve_dtype, resolve_kv_cache_dtype
from inferd.models.quant import check_quantization, resolve_quantization
from inferd.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestTimes, TokenLogprobs
from inferd.request import Request, RequestStatus, sub_request_id
from inferd.sampling import SamplingParams
from inferd.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class _Sequence:
    """Engine-side state of one of a parent's n sequences."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    # a resumed stream: its first `resumed` output tokens and `resumed_text` characters were sent before (by
    # another replica) and are left out of its outputs
    resumed: int = 0
    resumed_text: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence] = field(default_factory=list)
    lora_name: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    """Counters and gauges for the metrics endpoint, read after any step."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA: unfinished sequences per adapter, running and waiting (vLLM's lora_requests_info)
    running_loras: dict[str, int] = field(default_factory=dict)
    waiting_loras: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0  # slots (0: no LoRA)
    lora_loads: int = 0
    lora_load_seconds: float = 0.0
    lora_prompt_tokens: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)  # per medium (HOST, DISK): a copy
    taken: float = field(default_factory=time.time)  # when (Unix time): lora_requests_info's value, as vLLM's


class Engine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype_choice = resolve_dtype(config.dtype, self.device)
        self.dtype = self.dtype_choice.dtype
        logger.info("dtype: %s (%s)", self.dtype_choice.name, self.dtype_choice.reason)
        auto_dtype = config.dtype == "auto"
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, auto_dtype, self.device.type)
        if self.kv_dtype != self.dtype and config.cache.kv_cache_dtype == "auto":
            logger.info("KV cache: bfloat16 (auto: under float32 activations, half the bytes, widened as read)")
        check_quantization(config.quantization, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        folder = loader.resolve_model(config.model)
        self.tokenizer = loader.load_tokenizer(config.tokenizer or folder)
        hf_config = loader.text_config(loader.load_config(folder))
        self.max_model_len = config.context_len(loader.model_max_len(hf_config))
        gguf = loader.gguf_source(folder)
        formats = loader.checkpoint_formats(folder)
        self.quant_choice = resolve_quantization(config.quantization, self.device, formats, gguf)
        self.quantization = self.quant_choice.name  # int8, int4, gguf, or None: the checkpoint's values in self.dtype
        logger.info("quantization: %s (%s)", self.quantization or "none", self.quant_choice.reason)
        self.model = loader.load_model(
            folder,
            hf_config,
            self.dtype,
            self.device,
            self.max_model_len,
            config.cpu_linear,
            self.quantization,
            gguf,
            self.quant_choice.small_on_blocks,
        )
        self.vocab_size = hf_config.vocab_size
        self.model_type = getattr(hf_config, "model_type", "")  # the family's formats (tool calls) follow it
        self.eos_token_ids = self._eos_ids(folder, hf_config)
        num_blocks, block_size = self._num_blocks(), config.cache.block_size
        # KV cache events (inferd/engine/kv_publisher.py): recorded by the block pool, published after each step
        medium = "GPU" if self.device.type == "cuda" else "CPU"
        recorder = KVEventRecorder(block_size, medium) if config.kv_events.enabled else None
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, recorder)
        self.kv_events = (
            ZmqEventPublisher(config.kv_events, block_size, medium, self.kv.snapshot_events) if recorder else None
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        # speculative decoding: drafts for the next step, verified by the runner (inferd/engine/spec_decode.py)
        self.spec_stats = SpecStats()
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            block_size,
            self.dtype,
            self.device,
            config.attention_backend,
            config.seed,
            kv_dtype=self.kv_dtype,
        )
        self.kv.attach_tiers(self._kv_tiers(recorder))
        self.proposer = self._proposer(config.speculative)
        # structured outputs: the tokenizer's tables build in the background; requests compile their grammar
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.runner.grammars = self.grammars
        # LoRA adapters over the base model: slots wrapped around its layers, loaded as steps need them
        self.lora = LoRAManager(self.model, config.lora, self.dtype, self.device) if config.lora.enabled else None
        self.runner.lora = self.lora
        self.scheduler.max_loras = config.lora.max_loras if self.lora is not None else None
        self.model.pin_attributes()  # the model is final here (quantized, packed, LoRA slots wrapped)
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._ids = itertools.count()
        self.model_name = config.model
        self.model_folder = folder
        self.events: StepEvents | None = None  # set by whoever wants step events (the dashboard)
        self.kv_connector = None  # disaggregated prefill/decode (attach_kv_connector)

    def attach_kv_connector(self, connector) -> None:
        """Plug in a KV connector (inferd.engine.kv_connector) before the first step."""
        if self.lora is not None:
            raise ConfigError("LoRA adapters are not served by disaggregated prefill/decode roles yet")
        self.kv_connector = connector
        self.runner.kv_caches = connector.register_kv_caches(self.runner.kv_caches)
        self.runner.kv_connector = connector
        self.scheduler.connector = connector

    def housekeeping(self) -> None:
        """Free blocks lent out through the KV connector whose borrowers are done or whose time ran out."""
        if self.kv_connector is not None:
            self.kv_connector.housekeeping(self.kv)

    def idle_timeout(self) -> float | None:
        """How long the engine loop may sleep while idle (None: until a request comes)."""
        return 0.1 if self.kv_connector is not None and self.kv_connector.needs_wakeup else None

    # -- set-up ------------------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        cache = self.config.cache
        per_block = ModelRunner.bytes_per_block(self.model, cache.block_size, self.kv_dtype)
        num_blocks = cache.blocks(per_block)
        tokens = num_blocks * cache.block_size
        if tokens < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {tokens} tokens ({num_blocks} blocks), fewer than max_model_len="
                f"{self.max_model_len}; raise --kv-cache-memory or lower --max-model-len"
            )
        logger.info(
            "KV cache (%s): %d blocks x %d tokens = %d tokens (%.2f GiB); max concurrency at %d tokens: %.1fx",
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks,
            cache.block_size,
            tokens,
            num_blocks * per_block / 1024**3,
            self.max_model_len,
            tokens / self.max_model_len,
        )
        return num_blocks

    def _kv_tiers(self, events: KVEventRecorder | None) -> KVTiers | None:
        """Host-memory and disk tiers behind the KV cache (inferd/engine/kv_tier.py), as configured."""
        cache = self.config.cache
        per_block = ModelRunner.bytes_per_block(self.model, cache.block_size, self.kv_dtype)
        host, disk = cache.kv_offload_memory // per_block, cache.kv_offload_disk_memory // per_block
        if (cache.kv_offload_memory and not host) or (cache.kv_offload_disk_memory and not disk):
            raise ConfigError(f"a KV tier must hold at least one block ({per_block} bytes here)")
        tiers = KVTiers.build(lambda: self.runner.kv_caches, host, disk, cache.kv_offload_disk, events)
        if tiers is not None:
            logger.info("KV tiers: %s", tiers.describe())
        return tiers

    def _eos_ids(self, folder, hf_config) -> frozenset[int]:
        ids: set[int] = set()
        candidates = [getattr(hf_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        gen = folder / "generation_config.json"
        if gen.exists():
            candidates.append(json.loads(gen.read_text()).get("eos_token_id"))
        for c in candidates:
            if isinstance(c, int):
                ids.add(c)
            elif isinstance(c, list):
                ids.update(int(x) for x in c)
        return frozenset(ids)

    # -- requests ----------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        ttft_deadline: float | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError (and queues nothing) if it can't run.
        `lora_name`: the LoRA adapter it runs under (None: the base model); `priority`: its class under
        `--scheduling-policy priority` (lower first); `ttft_deadline`: seconds after arrival its first token is
        due, under `--scheduling-policy deadline`."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        lora_key = self._lora_key(lora_name)
        policy = self.config.scheduler.scheduling_policy
        if priority != 0 and policy != "priority":
            raise InvalidRequestError(
                "priority needs the priority scheduling policy (--scheduling-policy priority)", param="priority"
            )
        if ttft_deadline is not None and (policy != "deadline" or not ttft_deadline >= 0):
            raise InvalidRequestError(
                "a TTFT deadline needs the deadline scheduling policy (--scheduling-policy deadline)"
                if policy != "deadline"
                else f"a TTFT deadline is a number of seconds from 0 up, not {ttft_deadline!r}",
                param="ttft_deadline_ms",
            )
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        params = self._validate(token_ids, params)
        parent = _Parent(request_id, text, token_ids, lora_name=lora_name)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        for i in range(params.n):
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            req = Request(
                request_id=sub_request_id(request_id, i) if params.n > 1 else request_id,
                parent_id=request_id,
                index=i,
                prompt_token_ids=token_ids,
                params=child_params,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
                lora_name=lora_name,
                lora_key=lora_key,
                priority=priority,
                ttft_deadline=ttft_deadline,
                output_token_ids=list(child_params.resume_token_ids or ()),  # a resumed stream's output so far
                times=RequestTimes(arrival=arrival),
            )
            seq = _Sequence(
                req,
                IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                [] if child_params.logprobs is not None else None,
            )
            if child_params.resume_token_ids:
                seq.resumed = seq.sent_tokens = len(child_params.resume_token_ids)
                seq.resumed_text = seq.detok.prime(child_params.resume_token_ids)
            parent.seqs.append(seq)
        # register only once every copy is built: a copy that fails (e.g. its seed) leaves nothing behind
        if self.kv_connector is not None:
            self.kv_connector.add_request(request_id, params.kv_transfer_params, token_ids, cache_salt, params.n)
        elif params.kv_transfer_params is not None:
            raise InvalidRequestError(
                "kv_transfer_params need a disaggregated server (inferd serve --role prefill or decode)",
                param="kv_transfer_params",
            )
        for seq in parent.seqs:
            self._seqs[seq.request.request_id] = seq
        self._parents[request_id] = parent
        for seq in parent.seqs:
            self.scheduler.add(seq.request)

    def _lora_key(self, name: str | None) -> str | None:
        if name is None:
            return None
        if self.lora is None:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r}: this engine serves none")
        if name not in self.lora.adapters:
            known = ", ".join(sorted(self.lora.adapters)) or "none"
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} (served: {known})")
        return self.lora.key(name)

    # -- LoRA adapters at run time -------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (a LoRAError, and nothing changed, if it does not fit)."""
        if self.lora is None:
            raise ConfigError("this engine serves no LoRA adapters; start it with --enable-lora")
        if name in self.lora.adapters and self._lora_in_use(name):  # its running requests keep their weights
            raise InvalidRequestError(f"LoRA adapter {name!r} serves running requests; unload it when they end")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`; refused while unfinished requests use it."""
        if self.lora is None or name not in self.lora.adapters:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r}", param="lora_name")
        if self._lora_in_use(name):
            raise InvalidRequestError(f"LoRA adapter {name!r} serves running requests; unload it when they end")
        self.lora.remove(name)

    def _lora_in_use(self, name: str) -> bool:
        return any(p.lora_name == name for p in self._parents.values())

    def _validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}); got {min(token_ids)}..{max(token_ids)}",
                param="prompt",
            )
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the context is {self.max_model_len} tokens and must leave "
                "room for at least one output token; shorten the prompt or raise --max-model-len",
                param="prompt",
            )
        if params.resume_token_ids:
            self._check_resume(n, params)
        max_tokens = params.max_tokens
        if max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - n)
        elif n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's context is {self.max_model_len} tokens, but {n + max_tokens} were asked for "
                f"({n} in the prompt, {max_tokens} max_tokens); lower max_tokens to at most "
                f"{self.max_model_len - n}",
                param="max_tokens",
            )
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary [0, {self.vocab_size})",
                param="logit_bias",
            )
        if params.structured is not None:
            self.grammars.compile(params.structured)  # an AsyncEngine compiled it already: a cache hit
        needed = self.kv.blocks_needed(n + params.max_tokens)
        if needed > self.kv.num_blocks:
            raise InvalidRequestError(
                f"this request needs {needed} KV blocks but the cache has {self.kv.num_blocks}; lower "
                "max_tokens or the prompt, or raise --kv-cache-memory",
                param="max_tokens",
            )
        return params

    def _check_resume(self, prompt_len: int, params: SamplingParams) -> None:
        """A resumed stream's delivered tokens (`resume_token_ids`) must be tokens of this model, leave room in the
        context, and (for a structured request) follow its grammar, which replays them."""
        resumed = params.resume_token_ids
        if max(resumed) >= self.vocab_size:
            raise InvalidRequestError(
                f"resume token ids must be in [0, {self.vocab_size}); got {max(resumed)}", param="resume"
            )
        if prompt_len + len(resumed) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({prompt_len} tokens) and the resumed tokens ({len(resumed)}) fill the context of "
                f"{self.max_model_len} tokens: nothing is left to generate",
                param="resume",
            )
        if params.kv_transfer_params is not None:
            raise InvalidRequestError("resume cannot be combined with kv_transfer_params", param="resume")
        if params.structured is not None:
            matcher = self.grammars.matcher(params.structured)
            for i, token_id in enumerate(resumed):
                if not matcher.accept(token_id):
                    raise InvalidRequestError(
                        f"resume token {i} ({token_id}) is not allowed by the request's grammar there",
                        param="resume",
                    )

    def abort(self, request_id: str) -> None:
        """Stop a request (all its n sequences) at once and free its blocks. Unknown ids are ignored."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for seq in parent.seqs:
            req = seq.request
            self._seqs.pop(req.request_id, None)
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                if self.proposer is not None:
                    self.proposer.finish([req])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def _proposer(self, spec: SpeculativeConfig) -> Proposer | None:
        self_draft = spec.speculative_method == "self_draft"  # the runner drafts, into slots the scheduler adds
        self.runner.draft_head = DraftHead(self.model, spec.draft_vocab_size) if self_draft else None
        self.scheduler.lookahead = spec.draft_tokens if self_draft else 0
        self.scheduler.lookahead_max_running = spec.draft_max_running
        if spec.speculative_method not in PROPOSERS:
            return None
        # self-drafting carries every draft it made: their passes already ran, so the planner has nothing to save
        cost = spec.speculative_draft_policy == "cost" and not self_draft
        planner = DraftPlanner(self.spec_stats) if cost else None
        return PROPOSERS[spec.speculative_method](spec, self.max_model_len, planner)

    def set_speculative(self, spec: SpeculativeConfig) -> None:
        """New speculative settings for an idle engine (the model and the cache stay): drafts are proposed
        between steps, so nothing else holds the old ones."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot change speculative settings while requests run")
        spec.validate()
        self.config = dataclasses.replace(self.config, speculative=spec)
        self.proposer = self._proposer(spec)
        self.scheduler.set_drafts({})

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
            kv_tiers={t.medium: replace(t.stats) for t in self.kv.tiers.tiers} if self.kv.tiers else {},
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        s = self.lora.stats
        return {
            "running_loras": _count_adapters(self.scheduler.running),
            "waiting_loras": _count_adapters(self.scheduler.waiting),
            "max_loras": self.lora.max_loras,
            "lora_loads": s.loads,
            "lora_load_seconds": s.load_seconds,
            "lora_prompt_tokens": dict(s.prompt_tokens),
            "lora_generation_tokens": dict(s.generation_tokens),
        }

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        runner_output = self.runner.execute(sched)
        self.publish_kv_events()
        if sched.empty and not (runner_output.finished_loading or runner_output.failed_loading):
            return []
        touched: dict[str, _Parent] = {}
        sampled_tokens = self.scheduler.update_from_output(sched, runner_output)
        for sampled in sampled_tokens:
            seq = self._seqs[sampled.request.request_id]
            self._on_token(seq, sampled)
            touched[seq.request.parent_id] = self._parents[seq.request.parent_id]
        if self.events is not None:  # the dashboard's step events (inferd/engine/events.py)
            self.events.record(self.scheduler, sched, sampled_tokens, started)
        if self.proposer is not None:
            self._count_drafts(sched, runner_output, time.perf_counter() - started)
            # requests this step ended (their outputs final: a stop string's tail is cut by now)
            self.proposer.finish(dict.fromkeys(s.request for s in sampled_tokens if s.request.is_finished))
            self.proposer.take_runner_drafts(runner_output.draft_token_ids)
            self.scheduler.set_drafts(self.proposer.propose(self.scheduler.running))
        return [self._make_output(p) for p in touched.values()]

    def publish_kv_events(self) -> None:
        """Hand the cache changes recorded since the last call to the KV event publisher (one batch)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.events.take())

    def close(self) -> None:
        """Stop what the engine started besides the step (the KV event publisher's thread and sockets, the KV
        tiers' memory and file)."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv.tiers is not None:
            self.kv.tiers.close()
            self.kv.attach_tiers(None)

    def _count_drafts(self, sched, out, seconds: float) -> None:
        planner = self.proposer.planner
        for chunk in sched.chunks:
            if chunk.num_drafts:
                accepted = len(out.accepted_drafts.get(chunk.request_id, ()))
                self.spec_stats.add(chunk.num_drafts, accepted)
                if planner is not None:
                    planner.observe_drafts(chunk.request_id, chunk.num_drafts, accepted)
        if planner is not None and sched.chunks and not any(c.is_prefill for c in sched.chunks):  # decode rows only
            planner.observe_step(sum(c.num_tokens for c in sched.chunks), seconds)

    def _on_token(self, seq: _Sequence, sampled: SampledToken) -> None:
        """Detokenize a sequence's new token and look for its stop strings."""
        req = seq.request
        if seq.logprobs is not None and sampled.logprobs is not None:
            seq.logprobs.append(sampled.logprobs)
        # at this point only an eos or stop token can have stopped it: those are not text
        if req.status != RequestStatus.FINISHED_STOPPED:
            count = sampled.index + 1 if sampled.index >= 0 else len(req.output_token_ids)  # tokens up to this one
            check = count >= req.params.min_tokens
            stop = seq.detok.add_token(sampled.token_id, check_stop=check)
            if stop is not None:
                # a step that verified drafts may have appended tokens after this one: they are not output
                if sampled.index >= 0:
                    del req.output_token_ids[sampled.index + 1 :]
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop)
        if req.is_finished:
            seq.detok.flush()

    def _make_output(self, parent: _Parent) -> RequestOutput:
        finished = parent.finished
        outputs = []
        for seq in parent.seqs:
            req = seq.request
            new_tokens = req.output_token_ids[seq.sent_tokens :]
            if not new_tokens and not finished:
                continue
            seq.sent_tokens = len(req.output_token_ids)
            delta_lp = None
            if seq.logprobs is not None:
                delta_lp = seq.logprobs[seq.sent_logprobs :]
                seq.sent_logprobs = len(seq.logprobs)
            outputs.append(
                CompletionOutput(
                    index=req.index,
                    text=seq.detok.text[seq.resumed_text :] if seq.resumed else seq.detok.text,
                    token_ids=req.output_token_ids[seq.resumed :] if seq.resumed else req.output_token_ids,
                    delta_text=seq.detok.take_delta(req.is_finished),
                    delta_token_ids=new_tokens,
                    logprobs=seq.logprobs,
                    delta_logprobs=delta_lp,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        if finished:
            if parent.lora_name is not None and self.lora is not None:
                generated = sum(len(s.request.output_token_ids) - s.resumed for s in parent.seqs)
                self.lora.count_tokens(parent.lora_name, len(parent.prompt_token_ids), generated)
            self._parents.pop(parent.request_id, None)
            for seq in parent.seqs:
                self._seqs.pop(seq.request.request_id, None)
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            finished,
            self._metrics(parent) if finished else None,
            self.kv_connector.take_transfer_params(parent.request_id) if finished and self.kv_connector else None,
        )

    @staticmethod
    def _metrics(parent: _Parent) -> RequestMetrics:
        reqs = [s.request for s in parent.seqs]
        prompt_len = len(parent.prompt_token_ids)
        return RequestMetrics(
            times=RequestTimes.merge([r.times for r in reqs]),
            num_prompt_tokens=prompt_len,
            num_generation_tokens=sum(len(s.request.output_token_ids) - s.resumed for s in parent.seqs),
            # a resumed request's cache hit may reach into its resumed tokens, which are no prompt
            num_cached_tokens=min(prompt_len, max(r.num_cached_tokens for r in reqs)),
            num_preemptions=sum(r.num_preemptions for r in reqs),
            num_prefill_chunks=sum(r.num_prefill_chunks for r in reqs),
            num_decode_steps=sum(r.num_decode_steps for r in reqs),
            num_loaded_tokens=max(r.num_loaded_tokens for r in reqs),
            kv_load_seconds=max(r.kv_load_seconds for r in reqs),
        )

    def check_idle(self) -> None:
        """Invariant after all requests are done: every block free (or cached), no state left behind."""
        if self.has_unfinished_requests() or self._parents:
            raise AssertionError("engine still holds requests")
        self.kv.check_idle()


def _count_adapters(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name is not None:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts


class LLM:
    """Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | EngineConfig = DEFAULT_MODEL, **kwargs):
        config = model if isinstance(model, EngineConfig) else make_engine_config(model, **kwargs)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def reconfigure(self, config: EngineConfig) -> bool:
        """Take `config` without reloading when only its scheduling and speculative settings differ (both are
        read every step; the scheduling policy, which shapes the scheduler's queue, is not): True once taken,
        False when anything else differs and the model must load anew. Refused while requests run."""
        engine = self.engine
        same_policy = config.scheduler.scheduling_policy == engine.config.scheduler.scheduling_policy
        kept = dataclasses.replace(engine.config, scheduler=config.scheduler, speculative=config.speculative)
        if kept != config or not same_policy:
            return False
        if config != engine.config:
            config.validate()
            engine.set_speculative(config.speculative)  # refused while requests run
            engine.scheduler.config = config.scheduler
            engine.config = config
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix no running request holds (as vLLM's `LLM.reset_prefix_cache`): the next
        prompts are computed in full, as a benchmark's repeated runs must be. True when no block stays cached."""
        return self.engine.kv.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """`lora_name`: the LoRA adapter (by its name) every prompt runs under, or one per prompt (None: the
        base model); `priority`: every prompt's class, or one per prompt (`scheduling_policy="priority"`)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("give one SamplingParams, or one per prompt")
        loras = [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(loras) != len(prompts) or len(priorities) != len(prompts):
            raise InvalidRequestError("give one lora_name (and priority), or one per prompt")
        ids = []
        try:
            for prompt, p, lora, prio in zip(prompts, params_list, loras, priorities, strict=True):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, prompt, p, lora_name=lora, priority=prio)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None):
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([render_chat(self.tokenizer, c) for c in conversations], sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]
