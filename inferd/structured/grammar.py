"""Constraints compiled to token masks, on xgrammar.

A `Constraint` compiles once per tokenizer into an xgrammar `CompiledGrammar` (the expensive part: tens
of milliseconds for a schema over Gemma's 262,144 tokens) and is cached by its value, so a second request
with the same schema starts at once. Each request then gets its own `Matcher`, a cursor in the grammar
advanced by every token the request samples; before a step samples, the matcher fills its row of a
bitmask (one bit per vocabulary entry: may this token come next?), and the sampler sets the logits of
forbidden tokens to -inf in place.

Why xgrammar: on this project's CPUs and vocabulary it builds its tokenizer tables in ~1 s (llguidance
~5 s), fills a row's mask in microseconds for most states (llguidance ~10x more), and applies 16 rows in
~0.1 ms (llguidance's CPU path ~1 s); vLLM, SGLang and TensorRT-LLM use it too.

The tokenizer tables are built on a background thread when the compiler is made, so the engine starts at
once and the first constrained request rarely waits for them; the thread runs at the lowest priority, so
steps taken meanwhile keep the cores. `compile` blocks; `AsyncEngine` calls it off the event loop and the
engine's step loop only looks compiled grammars up.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inferd.errors import InvalidRequestError
from inferd.structured.spec import Constraint

# xgrammar writes a bounded string's characters (maxLength) as [^"\\\r\n], which admits raw control
# characters JSON forbids; its unbounded strings exclude them. The bounded class is made the same.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


@dataclass
class CompileStats:
    """What compiling has cost this process: requests served from the cache, compiles and their seconds."""

    hits: int = 0
    misses: int = 0
    seconds: float = 0.0
    last_seconds: float = 0.0


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching up to `cache_size` grammars (least recently used out)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = 256):
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._pending: dict[Constraint, threading.Event] = {}
        self._lock = threading.Lock()
        self._compiler = None
        self._ready = threading.Event()
        self._tables_error: BaseException | None = None
        # not a daemon: a process leaving while xgrammar builds (its own threads running) died in std::terminate
        # (exit status 134); Python now waits for the build, a second or two, before it exits
        self._tables = threading.Thread(
            target=self._build_tables, args=(tokenizer, sorted(stop_token_ids)), daemon=False, name="xgrammar-tables"
        )
        self._tables.start()

    def _build_tables(self, tokenizer, stop_token_ids: list[int]) -> None:
        # at the lowest priority (Linux: a thread's nice value, which threads it starts inherit): the build
        # takes a core for about a second after start, and steps started meanwhile must not share it
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        except BaseException as e:  # reported to whoever compiles first
            self._tables_error = e
        finally:
            self._ready.set()

    def _xgr_compiler(self):
        self._ready.wait()
        if self._tables_error is not None:
            raise RuntimeError(f"structured outputs are unavailable: {self._tables_error}") from self._tables_error
        return self._compiler

    # -- compiling ----------------------------------------------------------------------------------
    def cached(self, c: Constraint):
        """The compiled grammar if it is cached, else None (never compiles: the step loop's lookup)."""
        with self._lock:
            grammar = self._cache.get(c)
            if grammar is not None:
                self._cache.move_to_end(c)
            return grammar

    def compile(self, c: Constraint):
        """The compiled grammar of `c`, compiling it if no one has; a constraint the compiler refuses raises
        InvalidRequestError naming the request field. Concurrent callers of one constraint compile it once."""
        while True:
            with self._lock:
                if c in self._cache:
                    self.stats.hits += 1
                    self._cache.move_to_end(c)
                    return self._cache[c]
                waiting = self._pending.get(c)
                if waiting is None:
                    self._pending[c] = threading.Event()
                    break
            waiting.wait()  # another thread compiles it; look again (it may have failed)
        try:
            start = time.perf_counter()
            grammar = self._compile(c)
            elapsed = time.perf_counter() - start
            with self._lock:
                self.stats.misses += 1
                self.stats.seconds += elapsed
                self.stats.last_seconds = elapsed
                self._cache[c] = grammar
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return grammar
        finally:
            with self._lock:
                self._pending.pop(c).set()

    def _compile(self, c: Constraint):
        compiler = self._xgr_compiler()
        import xgrammar as xgr

        try:
            if c.kind in ("json", "json_object"):  # JSON mode is any object (xgrammar's builtin is any value)
                schema, strict = (c.value, True) if c.kind == "json" else ('{"type": "object"}', False)
                text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=c.any_whitespace, strict_mode=strict))
                return compiler.compile_grammar(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
            if c.kind == "regex":
                return compiler.compile_regex(c.value)
            if c.kind == "choice":
                return compiler.compile_grammar(choice_grammar(c.choices))
            if c.kind == "grammar":
                return compiler.compile_grammar(c.value)
            if c.kind == "structural_tag":
                return compiler.compile_structural_tag(_structural_tag(c.value))
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"this {_NAMES[c.kind]} cannot be compiled: {reason}", param=c.param) from None
        raise InvalidRequestError(f"unknown constraint kind {c.kind!r}", param=c.param)

    def matcher(self, c: Constraint) -> Matcher:
        """A fresh matcher at the grammar's start; the grammar must have been compiled (`compile`)."""
        grammar = self.cached(c) or self.compile(c)
        return Matcher(grammar)


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def _structural_tag(value: str):
    """vLLM's response_format {"type": "structural_tag", "structures": [...], "triggers": [...]} or xgrammar's
    own structural tag format ({"type": "structural_tag", "format": {...}})."""
    spec = json.loads(value)
    if "format" in spec:
        return spec
    import xgrammar as xgr

    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("a structural tag needs a non-empty 'structures' list (or a 'format')")
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s.get("schema", {})},
            "end": s["end"],
        }
        for s in structures
    ]
    triggers = spec.get("triggers") or sorted({s["begin"] for s in structures})
    return xgr.StructuralTag.model_validate(
        {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    )


def choice_grammar(options: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `options`."""
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, grammar):
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(grammar)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar forbids it (the matcher then stays put)."""
        return self._m.accept_token(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write which tokens may come next into row `row` of `bitmask` (from `allocate_bitmask`)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def can_stop(self) -> bool:
        """The output so far is a whole sentence of the grammar: a stop token may come next."""
        return self._m.is_completed()

    @property
    def done(self) -> bool:
        """A stop token has been accepted: nothing may follow."""
        return self._m.is_terminated()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows, all tokens allowed (int32 words, one bit per token, as xgrammar lays it out)."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the forbidden tokens' logits of `rows` to -inf, in place (`bitmask` row i goes with logits row i)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def fill_bitmasks(matchers: list[Matcher | None], vocab_size: int) -> torch.Tensor:
    """One bitmask row per matcher (all tokens allowed where it is None)."""
    bitmask = allocate_bitmask(len(matchers), vocab_size)
    for row, m in enumerate(matchers):
        if m is not None and not m.done:  # a finished grammar's request stops this step: nothing to mask
            m.fill(bitmask, row)
    return bitmask
