"""Resuming a broken stream: what the client has got so far, the request that continues it, and the splice.

A replica can fail after the client got the first bytes of a stream (killed, connection reset). With
`resume.enabled` on the route, the gateway then sends the request to another replica of the pool and splices
that replica's stream into the client's, which sees one unbroken stream. To know where to go on, it asks the
replica for the token ids of every chunk (`return_token_ids`, as vLLM names it; taken back out of the chunks
when the client did not ask for them) and keeps the ids of the chunks the client got (`StreamState`).

How it goes on (`continuation`):

- exact: the request again, with inferd's `resume` field holding the token ids sent. An inferd replica takes
  them as the output so far (they count toward max_tokens, stops and penalties) and streams only what follows,
  with the header `x-inferd-resumed`. Greedy requests continue exactly; seeded sampled requests too, because
  inferd draws a seeded request's noise per (seed, output position). A sampled request without a seed cannot
  be continued: its stream ends with the error event.
- greedy: a replica that is not inferd ignores `resume` (no header) or refuses it with a 400 naming it. A
  greedy request (temperature 0) is then sent again with the output so far as prompt: a completion's prompt
  grows by the tokens (token-id prompts) or the text sent, a chat gets them as a final assistant message
  continued (`continue_final_message`); max_tokens and min_tokens shrink by the tokens sent. Penalties then
  read the sent tokens as prompt, so it is greedy-equivalent, not exact.

The continuation's chunks are rewritten (`StreamState.splice`): the first stream's `id`, `created` and
`model`; no second role chunk; a completion's logprobs `text_offset` going on from the text sent before; usage
counting each token once (completion tokens: those sent before plus the continuation's; prompt tokens: the
client's prompt).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from inferd.sampling import RESUMED_HEADER  # an inferd replica's answer to `resume`

__all__ = ["RESUMED_HEADER", "SEED_HEADER", "StreamState", "continuation", "refuses_resume", "why_not_resumable"]
_TOKEN_IDS = re.compile(rb',\s*"token_ids"\s*:\s*\[[0-9,\s]*\]')  # digits only: it cannot match in a string


def is_greedy(body: dict) -> bool:
    t = body.get("temperature")
    return isinstance(t, int | float) and not isinstance(t, bool) and t < 1e-5


def is_seeded(body: dict) -> bool:
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


SEED_HEADER = "x-inferd-seed"  # the seed the gateway gave a sampled stream that had none (ResumeConfig.seed_unseeded)


def why_not_resumable(kind: str, body: dict, n: int, num_prompts: int) -> str | None:
    """Why a stream of this request could not be continued where it broke; None if it could."""
    if n != 1 or num_prompts != 1:
        return "it has several choices (n or a prompt list)"
    if kind == "chat" and body.get("tools") and body.get("tool_choice") != "none":
        return "it has tools (the tool-call reader's state is not replayed)"
    if not (is_greedy(body) or is_seeded(body)):
        return "it samples without a seed (send a seed, or temperature 0)"
    return None


@dataclass
class StreamState:
    """What the client has got of one stream (one choice), read from each event as it goes out."""

    kind: str  # completions | chat
    client_wants_ids: bool  # the client asked for `return_token_ids` itself
    token_ids: list[int] = field(default_factory=list)  # the choice's tokens in the events sent
    text: str = ""  # and their text
    finished: bool = False  # an event with the choice's finish_reason went out
    saw_ids: bool = False  # the replica sends token ids
    head: dict | None = None  # the first stream's id, created, model
    # the continuation being spliced in: the tokens sent before it, and how it counts the prompt
    base: int = 0
    next_offset: int = 0  # where a completion's next token starts, by its logprobs' text_offset and tokens
    text_base: int = 0  # next_offset when the continuation began: its own offsets count from 0
    prompt_extra: int = 0  # tokens a greedy continuation added to the prompt
    splicing: bool = False

    def event(self, event: bytes) -> bytes | None:
        """The event as the client gets it (None: dropped), noting what it carries."""
        if not event.startswith(b"data: {"):
            return event
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        if self.splicing:
            obj = self._splice(obj)
            if obj is None:
                return None
        elif self.head is None and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        stripped = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.saw_ids = True
                self.token_ids.extend(t for t in ids if isinstance(t, int))
                if not self.client_wants_ids:
                    del choice["token_ids"]
                    stripped = True
            delta = choice.get("delta") if self.kind == "chat" else choice
            text = delta.get("content" if self.kind == "chat" else "text") if isinstance(delta, dict) else None
            if isinstance(text, str):
                self.text += text
            lp = choice.get("logprobs") if self.kind != "chat" else None
            if isinstance(lp, dict) and lp.get("text_offset") and lp.get("tokens"):
                self.next_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if choice.get("finish_reason") is not None:
                self.finished = True
        if self.splicing:
            return b"data: " + _dumps(obj)
        if stripped:  # the replica's bytes with the field cut out, as the usage field is cut (proxy.SSEFilter)
            cut = _TOKEN_IDS.sub(b"", event)
            return cut if b'"token_ids"' not in cut else b"data: " + _dumps(obj)
        return event

    def begin(self, prompt_extra: int) -> None:
        """A continuation's events follow: their tokens come after the `token_ids` sent so far."""
        self.splicing, self.base, self.prompt_extra = True, len(self.token_ids), prompt_extra
        self.text_base = self.next_offset

    def _splice(self, obj: dict) -> dict | None:
        """A continuation's event made part of the first stream; None to drop it (a second role chunk)."""
        if "error" in obj:
            return obj
        obj.update(self.head or {})
        choices = obj.get("choices")
        if isinstance(choices, list):
            kept = []
            for c in choices:
                delta = c.get("delta") if isinstance(c, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    delta.pop("role")
                    if delta.get("content") == "":
                        delta.pop("content")
                    if not (delta or c.get("finish_reason") or c.get("token_ids") or c.get("logprobs")):
                        continue
                lp = c.get("logprobs") if isinstance(c, dict) and self.kind != "chat" else None
                if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):  # counted from the continuation
                    lp["text_offset"] = [o + self.text_base if isinstance(o, int) else o for o in lp["text_offset"]]
                kept.append(c)
            if choices and not kept:
                return None
            obj["choices"] = kept
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - self.prompt_extra)
            completion = int(usage.get("completion_tokens") or 0) + self.base
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return obj


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def continuation(kind: str, body: dict, state: StreamState, exact: bool) -> tuple[dict, int]:
    """The request that continues the stream after what `state` says was sent, and the tokens it adds to the
    prompt: exact (inferd's `resume`) or greedy (the output so far as prompt)."""
    sent = state.token_ids
    if not sent:  # the client got no token yet: the request as it was (the role chunk is dropped)
        return dict(body), 0
    if exact:
        return {**body, "resume": {"token_ids": [list(sent)]}}, 0
    out = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(name), int):
            out[name] = out[name] - len(sent)
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - len(sent))
    if kind == "chat":
        out["messages"] = [*body["messages"], {"role": "assistant", "content": state.text}]
        out["continue_final_message"], out["add_generation_prompt"] = True, False
    elif isinstance(body["prompt"], list):  # token ids (the gateway read it as one prompt)
        out["prompt"] = [*body["prompt"], *sent]
    else:
        out["prompt"] = body["prompt"] + state.text
    return out, len(sent)


def refuses_resume(status: int, body: bytes) -> bool:
    """A 400 whose error names `resume`: a replica that validates the field and cannot honour it."""
    if status != 400:
        return False
    try:
        param = json.loads(body)["error"].get("param") or ""
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return isinstance(param, str) and param.startswith("resume")


def left_to_generate(body: dict, sent: int) -> bool:
    """Whether max_tokens (when set) leaves anything after the tokens sent."""
    caps = [body.get(k) for k in ("max_completion_tokens", "max_tokens")]
    cap = next((c for c in caps if isinstance(c, int)), None)
    return cap is None or cap > sent
