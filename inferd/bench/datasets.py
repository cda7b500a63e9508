"""What a benchmark sends: seeded request sets (prompt text, its token count, the output length).

A dataset hands out requests with `take(count)`; the runner calls it in a fixed order (warm-ups, then each
sweep level), so the same seed gives the same requests, and no two requests of a run share a prompt:
vLLM and llama.cpp cache repeated prompts, and a benchmark that repeats itself measures the cache.
Redrawing a repeated prompt is bounded: when the settings allow too few distinct prompts (a tiny
--random-input-len), or the tokenizer gives the same tokens for every text, the run stops with an error
that says so, instead of drawing forever.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from inferd.bench.tokenizers import Tokenizer
from inferd.errors import InferdError


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens of the prompt text, by the benchmark's tokenizer (the server's usage may add a BOS)
    output_len: int  # max_tokens asked for
    extra_body: dict | None = None  # fields of this request's own (a response_format), over the run's
    schema: dict | bool | None = None  # the JSON schema its output should follow, counted in schema_valid_rate
    model: str | None = None  # the model (or LoRA adapter) it asks for, over the run's --model


class Dataset(Protocol):
    name: str
    default_count: int

    def take(self, count: int) -> list[BenchRequest]: ...


@dataclass
class ModelMix:
    """Another dataset's requests, each asking for the next of `models` in turn (LoRA adapters served by one
    server; vLLM's benchmark picks one at random per request, this gives each the same share)."""

    inner: Dataset
    models: list[str]
    _next: int = 0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def default_count(self) -> int:
        return self.inner.default_count

    def take(self, count: int) -> list[BenchRequest]:
        out = []
        for r in self.inner.take(count):
            out.append(replace(r, model=self.models[self._next % len(self.models)]))
            self._next += 1
        return out


# Common words, each one token in most tokenizers: random sequences of them tokenize to predictable lengths,
# unlike random token ids, which re-tokenize into different counts.
_WORD_TEXT = """
the of and to in is was he for it with as his on be at by had are but from or have an they which one you were
all her she there would their we him been has when who will no more if out so up said what its about than into
them can only other time new some could these two may first then do any like my now over such our man me even
most made after also did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come since against go came
right used take three small house water light river stone garden window paper music table city road market
morning evening summer winter north south green blue red yellow quiet simple bright heavy early late open
close answer question number letter story picture animal forest mountain ocean island village engine signal
energy
"""
WORDS = tuple(_WORD_TEXT.split())


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random lengths: uniform integers in [mean*(1-r), mean*(1+r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise InferdError("--random-range-ratio must be in [0, 1)")
    lo = max(1, math.floor(mean * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + range_ratio)))
    return lo, hi


def sample_len(rng: np.random.Generator, mean: int, range_ratio: float) -> int:
    lo, hi = length_range(mean, range_ratio)
    return int(rng.integers(lo, hi + 1))


def random_text(tok: Tokenizer, num_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
    """Text of random words cut to `num_tokens` tokens of `tok`; returns (text, its re-encoded token count)."""
    if num_tokens <= 0:
        return "", 0
    ids: list[int] = []
    while len(ids) < num_tokens:
        words = rng.choice(WORDS, size=num_tokens - len(ids) + 1)
        more = tok.encode((" " if ids else "") + " ".join(words))
        if not more:
            raise InferdError(f"the tokenizer ({tok.name}) returned no tokens for a non-empty text")
        ids += more
    text = tok.decode(ids[:num_tokens])
    return text, len(tok.encode(text))


class _Distinct:
    """Remembers every prompt handed out, so a collision can be redrawn; gives up (InferdError) after
    MAX_REPEATS repeats in a row, or when one take() needs more than twice its count (plus MAX_REPEATS) draws."""

    MAX_REPEATS = 100

    def __init__(self, hint: str) -> None:
        self._seen: set[str] = set()
        self._repeats = 0
        self._hint = hint  # which setting to change when the distinct prompts run out

    def budget(self, count: int) -> int:
        """Draws one take(count) may make."""
        return 2 * count + self.MAX_REPEATS

    def add(self, prompt: str) -> bool:
        if prompt not in self._seen:
            self._seen.add(prompt)
            self._repeats = 0
            return True
        self._repeats += 1
        if self._repeats >= self.MAX_REPEATS:
            self.give_up(f"{self._repeats} draws in a row repeated an earlier prompt")
        return False

    def give_up(self, why: str) -> None:
        raise InferdError(
            f"cannot draw enough distinct prompts: {why} ({len(self._seen)} distinct so far). "
            f"Too few distinct prompts exist for these settings, or the tokenizer returns the same tokens for "
            f"every text; {self._hint}"
        )


def _draw(distinct: _Distinct, count: int, draw) -> list[BenchRequest]:
    """`count` requests from `draw()` (None: a repeat), within the budget of draws."""
    out: list[BenchRequest] = []
    for _ in range(distinct.budget(count)):
        if len(out) == count:
            return out
        req = draw()
        if req is not None:
            out.append(req)
    if len(out) < count:
        distinct.give_up(f"{distinct.budget(count)} draws gave only {len(out)} of {count} new prompts")
    return out


class RandomDataset:
    name = "random"
    default_count = 1000

    def __init__(self, tok: Tokenizer, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0):
        if input_len < 1 or output_len < 1:
            raise InferdError("--random-input-len and --random-output-len must be >= 1")
        length_range(input_len, range_ratio)  # validates the ratio now, not mid-run
        self.tok, self.input_len, self.output_len, self.range_ratio = tok, input_len, output_len, range_ratio
        self.rng = np.random.default_rng(seed)
        # the server adds its special tokens (a BOS) to the prompt; leave room so usage shows input_len
        self._special = tok.num_special_tokens()
        self._distinct = _Distinct("raise --random-input-len or lower --num-prompts")

    def take(self, count: int) -> list[BenchRequest]:
        return _draw(self._distinct, count, self._draw_one)

    def _draw_one(self) -> BenchRequest | None:
        n_in = sample_len(self.rng, self.input_len, self.range_ratio)
        n_out = sample_len(self.rng, self.output_len, self.range_ratio)
        text, n = random_text(self.tok, max(1, n_in - self._special), self.rng)
        return BenchRequest(text, n + self._special, n_out) if self._distinct.add(text) else None


class QuoteDataset:
    """Requests whose answer quotes the prompt: a passage of random words (`input_len` tokens) and the
    instruction to copy it, as extraction, editing and summaries that quote their source do. Outputs repeat
    text the server has seen, which is what prompt-lookup speculative decoding (`--speculative-method ngram`)
    drafts from; `random` is the open-continuation counterpart."""

    name = "quote"
    default_count = 1000
    INSTRUCTION = "Copy the text below exactly, word for word.\n\nText:\n{passage}\n\nCopy:\n"

    def __init__(self, tok: Tokenizer, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0):
        if input_len < 1 or output_len < 1:
            raise InferdError("--random-input-len and --random-output-len must be >= 1")
        length_range(input_len, range_ratio)
        self.tok, self.input_len, self.output_len, self.range_ratio = tok, input_len, output_len, range_ratio
        self.rng = np.random.default_rng(seed)
        self._special = tok.num_special_tokens() + len(tok.encode(self.INSTRUCTION.format(passage="")))
        self._distinct = _Distinct("raise --random-input-len or lower --num-prompts")

    def take(self, count: int) -> list[BenchRequest]:
        return _draw(self._distinct, count, self._draw_one)

    def _draw_one(self) -> BenchRequest | None:
        n_in = sample_len(self.rng, self.input_len, self.range_ratio)
        passage, _ = random_text(self.tok, max(1, n_in - self._special), self.rng)
        prompt = self.INSTRUCTION.format(passage=passage)
        if not self._distinct.add(prompt):
            return None
        n_out = sample_len(self.rng, self.output_len, self.range_ratio)
        return BenchRequest(prompt, len(self.tok.encode(prompt)) + self.tok.num_special_tokens(), n_out)


class SharedPrefixDataset:
    """N prefixes x M suffixes: each take() draws fresh prefixes, then suffixes that share them, shuffled."""

    name = "shared-prefix"

    def __init__(
        self,
        tok: Tokenizer,
        prefix_len: int,
        num_prefixes: int,
        suffixes_per_prefix: int,
        suffix_len: int,
        output_len: int,
        range_ratio: float = 0.0,
        seed: int = 0,
    ):
        if min(prefix_len, num_prefixes, suffixes_per_prefix, suffix_len, output_len) < 1:
            raise InferdError("--prefix-len, --num-prefixes, --suffixes-per-prefix and the lengths must be >= 1")
        length_range(suffix_len, range_ratio)
        self.tok, self.prefix_len, self.num_prefixes = tok, prefix_len, num_prefixes
        self.suffix_len, self.output_len, self.range_ratio = suffix_len, output_len, range_ratio
        self.default_count = num_prefixes * suffixes_per_prefix
        self.rng = np.random.default_rng(seed)
        self._special = tok.num_special_tokens()
        self._distinct = _Distinct("raise --random-input-len (the suffix length) or lower --suffixes-per-prefix")

    def take(self, count: int) -> list[BenchRequest]:
        n_prefix = max(1, self.prefix_len - self._special)
        prefixes = [random_text(self.tok, n_prefix, self.rng)[0] for _ in range(self.num_prefixes)]
        out: list[BenchRequest] = []

        def draw() -> BenchRequest | None:
            prefix = prefixes[len(out) % self.num_prefixes]
            suffix, _ = random_text(self.tok, sample_len(self.rng, self.suffix_len, self.range_ratio), self.rng)
            prompt = f"{prefix} {suffix}"
            if not self._distinct.add(prompt):
                return None
            n_out = sample_len(self.rng, self.output_len, self.range_ratio)
            req = BenchRequest(prompt, len(self.tok.encode(prompt)) + self._special, n_out)
            out.append(req)
            return req

        _draw(self._distinct, count, draw)
        order = self.rng.permutation(len(out))
        return [out[i] for i in order]


class JsonSchemaDataset:
    """Extraction requests over real JSON schemas (those of `inferd.bench.schemas` the mask enforces whole): each
    asks for one JSON object following a schema, as text in the prompt, and a `structured_output_ratio` share
    of them also sends the schema as `response_format` (vLLM's benchmark names the ratio so), so a run
    measures what the constraint costs and how often outputs are valid with and without it. Schemas whose
    compact text exceeds `max_schema_chars` are left out (Kubernetes types run to 40 KB). `salt` goes into each
    prompt's leading tag: runs of one seed with different salts send the same schemas and no shared prefix."""

    name = "json-schema"

    def __init__(
        self,
        tok: Tokenizer,
        output_len: int,
        structured_output_ratio: float = 1.0,
        seed: int = 0,
        max_schema_chars: int = 1500,
        path: str | None = None,
        salt: str = "",
    ):
        from inferd.bench.schemas import compact, small_schemas

        if not 0.0 <= structured_output_ratio <= 1.0:
            raise InferdError("--structured-output-ratio must be in [0, 1]")
        entries = json.loads(Path(path).read_text()) if path else None
        self.schemas = [(schema, compact(schema)) for schema in small_schemas(max_schema_chars, entries)]
        if not self.schemas:
            raise InferdError(f"no schema of {path or 'the corpus'} is at most {max_schema_chars} characters")
        self.tok, self.output_len, self.ratio, self.salt = tok, output_len, structured_output_ratio, salt
        self.default_count = len(self.schemas)
        self.rng = np.random.default_rng(seed)
        self._special = tok.num_special_tokens()
        self._drawn = 0
        self._distinct = _Distinct("lower --num-prompts")

    def take(self, count: int) -> list[BenchRequest]:
        return _draw(self._distinct, count, self._draw_one)

    def _draw_one(self) -> BenchRequest | None:
        from inferd.bench.schemas import extraction_prompt

        schema, text = self.schemas[int(self.rng.integers(len(self.schemas)))]
        self._drawn += 1
        # a number of its own in each prompt: no two requests share a prompt (nor a prefix-cache hit beyond it)
        tag = f"Request {self._drawn}-{int(self.rng.integers(1 << 30))}{self.salt}."
        prompt = f"{tag} {extraction_prompt(text)}"
        if not self._distinct.add(prompt):
            return None
        extra = None
        if self.rng.random() < self.ratio:
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
        n = len(self.tok.encode(prompt)) + self._special
        return BenchRequest(prompt, n, self.output_len, extra, schema)


# vLLM's ShareGPT filter: drop very short pairs and those that do not fit a 2048-token context
_SHAREGPT_MIN_LEN, _SHAREGPT_MAX_PROMPT, _SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def _first_turns(conv: list[dict]) -> tuple[str, str] | None:
    """ShareGPT ({"from", "value"}) or OpenAI-style ({"role", "content"}) turns -> (first prompt, first reply)."""
    if len(conv) < 2:
        return None
    texts = [turn.get("value", turn.get("content")) for turn in conv[:2]]
    if not all(isinstance(t, str) for t in texts):
        return None
    return texts[0], texts[1]


class ShareGPTDataset:
    """First human turn as the prompt, the reply's token count as max_tokens, in a seeded order."""

    name = "sharegpt"
    default_count = 1000

    def __init__(self, path: str | Path, tok: Tokenizer, seed: int = 0, output_len: int | None = None):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise InferdError(f"cannot read ShareGPT file {path}: {e}") from e
        if not isinstance(data, list):
            raise InferdError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries")
        pairs = [p for entry in data if isinstance(entry, dict) and (p := _first_turns(entry.get("conversations", [])))]
        rng = np.random.default_rng(seed)
        self._pairs = [pairs[i] for i in rng.permutation(len(pairs))]
        self._next = 0
        self.tok, self.output_len, self.path = tok, output_len, str(path)
        self._distinct = _Distinct(f"{path} has too few distinct prompts; lower --num-prompts")

    def take(self, count: int) -> list[BenchRequest]:
        out: list[BenchRequest] = []
        while len(out) < count:
            if self._next >= len(self._pairs):
                raise InferdError(
                    f"{self.path} has too few usable conversations for {count} more requests "
                    f"(prompt {_SHAREGPT_MIN_LEN}-{_SHAREGPT_MAX_PROMPT} tokens, total <= {_SHAREGPT_MAX_TOTAL})"
                )
            prompt, reply = self._pairs[self._next]
            self._next += 1
            n_in = len(self.tok.encode(prompt))
            n_out = self.output_len or len(self.tok.encode(reply))
            too_short = n_in < _SHAREGPT_MIN_LEN or (self.output_len is None and n_out < _SHAREGPT_MIN_LEN)
            if too_short or n_in > _SHAREGPT_MAX_PROMPT or n_in + n_out > _SHAREGPT_MAX_TOTAL:
                continue
            if self._distinct.add(prompt):
                out.append(BenchRequest(prompt, n_in, n_out))
        return out
