"""Incremental detokenization and stop strings.

Text is decoded over a short window of preceding tokens so word-leading spaces come out right, and a
delta is only released once it no longer ends in U+FFFD (a byte sequence cut mid-character). Stop
strings are searched in the new text; the last len(longest stop) - 1 characters are held back from
streaming so a stop string is never sent before it is recognised.
"""

from __future__ import annotations

from inferd.sampling import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens decoded as context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet (or an incomplete UTF-8 character)
        start = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(start) if check_stop and self.stop else None

    def prime(self, token_ids: list[int]) -> int:
        """Take tokens already generated and sent (a resumed stream) without checking stops; returns the length
        of the text sent with them. A stream sends what `take_delta` released after each step: all the text
        of its tokens, less the stop hold-back, which grows with the text, so it depends on the tokens only."""
        for t in token_ids:
            self.add_token(t, check_stop=False)
        self.emitted = len(self.text) if not self.stop else max(0, len(self.text) - self.hold_back)
        return self.emitted

    def flush(self) -> None:
        """At the end, release whatever is still pending, even an incomplete character."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)

    def _find_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, new_from - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s) if self.include_stop else idx]
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet sent, minus the hold-back while a stop string could still be forming."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
