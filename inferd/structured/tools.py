"""OpenAI tool calling as pure functions: validate the request, say what the grammar must enforce, read the
calls back out of the model's text (whole or streamed), and shape chat history for chat templates.

Nothing here touches an engine, a tokenizer or a server, so every rule of OpenAI's tool calling is tested on
plain strings; the server wires these into a request. Errors in a request raise InvalidRequestError naming
the field (`tools.0.function.name`, `tool_choice`, `messages.2.tool_calls.0.function.arguments`, ...).

The request:
  `parse_tools(tools) -> list[Tool]`; `Tool(name, description, parameters)`.
  `resolve_tool_choice(tools, tool_choice, parallel_tool_calls) -> ToolChoice(mode, name, parallel)`, with
  OpenAI's defaults (no tools: "none"; tools: "auto"; `parallel_tool_calls` true).
  `constraint_schema(tools, choice, parallel=None) -> dict | None`: the JSON schema the output must follow
  when the grammar enforces the choice. "named": the function's parameters (the output text IS the
  arguments JSON, as in vLLM); "required": an array of `{"name": <const>, "parameters": <schema>}`;
  None for "none" and "auto", where the model is free.
Constrained output ("named", "required"):
  `calls_from_constrained(text, choice) -> list[ToolCall]`; `ToolCall(id, name, arguments).to_openai()`;
  `new_call_id()` (`call_` and 24 random letters and digits).
  `ToolCallStream(choice).feed(accumulated_text) -> list[dict]`: OpenAI's `delta.tool_calls` entries.
  Arguments are the JSON text as the model generated it, not re-serialised (less the whitespace around
  it), so streamed fragments and non-streamed arguments are the same string; after a "length" stop they
  may be incomplete JSON, as OpenAI's are.
"auto", where the model writes calls in its own format:
  `parser_for(model_type) -> ToolParser` (or `PARSERS[parser_name(model_type)]()`): hermes/Qwen
  `<tool_call>`, llama3_json, mistral `[TOOL_CALLS]`, pythonic (Gemma 3, Llama 4).
  `parse(text) -> (content, calls)`; streaming `feed(accumulated_text) -> (content_delta, tool_call_deltas)`
  and, at the end, `finish()` (same shape).
  Text that is not a well-formed call stays content; nothing raises. Arguments are re-serialised as
  compact JSON (the model's text is not always JSON).
  `tools_system_prompt(tools) -> str` teaches the pythonic format to a model whose chat template ignores
  `tools` (Gemma 3).
History:
  `history_messages(messages) -> list[dict]`: OpenAI history as HF chat templates expect it (a call's
  arguments as a dict). `flatten_tool_history(messages) -> list[dict]`: the same as plain user/assistant
  turns for templates with no tool roles (Gemma), calls written by `pythonic_calls_text(calls) -> str`.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

from inferd.errors import InvalidRequestError

__all__ = [
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Tool",
    "ToolCall",
    "ToolCallStream",
    "ToolChoice",
    "ToolParser",
    "calls_from_constrained",
    "constraint_schema",
    "flatten_tool_history",
    "history_messages",
    "new_call_id",
    "parse_tools",
    "parser_for",
    "parser_name",
    "pythonic_calls_text",
    "resolve_tool_choice",
    "tools_system_prompt",
]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_WS = " \t\n\r"


# ---------------------------------------------------------------------------------------------------------
# The request: tools and tool_choice


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is its JSON schema (an object schema)."""

    name: str
    description: str | None
    parameters: dict


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: "none" (no calls), "auto" (the model decides), "required" (at least one call),
    "named" (exactly one call, of `name`). `parallel` is OpenAI's `parallel_tool_calls` (default true)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None
    parallel: bool = True


def parse_tools(tools: list[dict] | None) -> list[Tool]:
    """OpenAI's `tools` validated: `[{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}]`. None and [] are no tools; a missing `parameters` is an object with no properties."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of tools", param="tools")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"{where}.type must be 'function', got {tool.get('type')!r}", param=f"{where}.type"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise InvalidRequestError(
                f"{where}.function.name {name!r} is not unique: tools must have different names",
                param=f"{where}.function.name",
            )
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{where}.function.description must be a string", param=f"{where}.function.description"
            )
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema (an object)", param=f"{where}.function.parameters"
            )
        if "type" in parameters and parameters["type"] != "object":
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema of type 'object', got type {parameters['type']!r}",
                param=f"{where}.function.parameters",
            )
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
        out.append(Tool(name, description, parameters))
    return out


def resolve_tool_choice(tools: list[Tool], tool_choice: Any, parallel_tool_calls: bool | None = None) -> ToolChoice:
    """`tool_choice` with OpenAI's defaults: None means "auto" with tools and "none" without; "auto" without
    tools is "none" (there is nothing to call); "required" or a named function without tools is a 400."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice == "none" or (tool_choice == "auto" and not tools):
            return ToolChoice("none", parallel=parallel)
        if tool_choice == "auto":
            return ToolChoice("auto", parallel=parallel)
        if tool_choice == "required":
            if not tools:
                raise InvalidRequestError("tool_choice is 'required' but the request has no tools", param="tool_choice")
            return ToolChoice("required", parallel=parallel)
        raise InvalidRequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
            param="tool_choice",
        )
    if not isinstance(tool_choice, dict):
        raise InvalidRequestError(
            "tool_choice must be a string or an object {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if tool_choice.get("type") != "function":
        raise InvalidRequestError(
            f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}", param="tool_choice.type"
        )
    fn = tool_choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(
            "tool_choice.function must be an object with a string name", param="tool_choice.function"
        )
    name = fn["name"]
    if name not in {t.name for t in tools}:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not in tools", param="tool_choice.function.name"
        )
    return ToolChoice("named", name, parallel=parallel)


# ---------------------------------------------------------------------------------------------------------
# What the grammar enforces


def constraint_schema(tools: list[Tool], choice: ToolChoice, parallel: bool | None = None) -> dict | None:
    """The JSON schema the output must follow, or None where the model is free ("none", "auto").

    "named": the function's parameters schema (the output is the arguments object). "required": an array
    (at least one item; at most one when `parallel` is false; `parallel` defaults to `choice.parallel`) of
    `{"name": <const>, "parameters": <schema>}`, any of the tools. Root-relative `$ref`s of a tool's schema
    are rewritten to point into it where it now sits, so `$defs` keep working."""
    if choice.mode in ("none", "auto"):
        return None
    by_name = {t.name: t for t in tools}
    if choice.mode == "named":
        if choice.name not in by_name:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        return by_name[choice.name].parameters
    if not tools:
        raise ValueError("tool_choice 'required' needs tools")
    parallel = choice.parallel if parallel is None else parallel
    items = []
    for i, tool in enumerate(tools):
        base = f"#/items/anyOf/{i}/properties/parameters"
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "parameters": _rebase_refs(tool.parameters, base)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_NOT_SCHEMAS = {"const", "enum", "default", "examples"}  # values, not schemas: a "$ref" in them is data


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every root-relative `$ref` ("#", "#/...") made relative to `base` instead."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _NOT_SCHEMAS:
            out[key] = value
        else:
            out[key] = _rebase_refs(value, base)
    return out


# ---------------------------------------------------------------------------------------------------------
# Calls


_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    """One call the model made; `arguments` is a JSON string, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an entry of OpenAI's `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _header(index: int, call: ToolCall) -> dict:
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}


def _fragment(index: int, arguments: str) -> dict:
    return {"index": index, "function": {"arguments": arguments}}


def calls_from_constrained(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls in the output of a "named" or "required" request: the same calls, with the same arguments,
    that `ToolCallStream` streams for it (see there)."""
    stream = ToolCallStream(choice)
    stream.feed(text)
    return stream.calls


class _Value:
    """Finds the end of one JSON value fed a character at a time (string- and escape-aware). `step` says
    whether the character is part of the value: MORE (and the value goes on), LAST (it closes the value),
    AFTER (the value, a bare number or literal, ended before it) or BAD (no value starts so)."""

    MORE, LAST, AFTER, BAD = range(4)

    def __init__(self):
        self.kind: str | None = None  # "container", "string", "scalar"
        self.depth = 0
        self.in_string = False
        self.escape = False

    def step(self, ch: str) -> int:
        if self.kind is None:
            if ch in "{[":
                self.kind, self.depth = "container", 1
            elif ch == '"':
                self.kind, self.in_string = "string", True
            elif ch in "-0123456789tfn":
                self.kind = "scalar"
            else:
                return self.BAD
            return self.MORE
        if self.kind == "scalar":
            return self.MORE if ch.isalnum() or ch in "+-." else self.AFTER
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.kind == "string":
                    return self.LAST
            return self.MORE
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                return self.LAST
        return self.MORE


class ToolCallStream:
    """Streams the calls of a "named" or "required" request as OpenAI's `delta.tool_calls` entries.

    `feed(text)` takes the whole output so far (each time longer) and returns the new entries: for call i
    first `{"index": i, "id", "type": "function", "function": {"name", "arguments": ""}}`, then
    `{"index": i, "function": {"arguments": <fragment>}}` entries whose fragments add up to the call's
    arguments. (A caller may send the entries of one feed in one chunk or one per chunk.) `calls` holds the
    calls so far, their arguments as streamed.

    "named": the text is the arguments, streamed as it grows, less leading whitespace and less trailing
    whitespace until something follows it. "required": the text is a JSON array of `{"name": ...,
    "parameters": {...}}`; a small scanner emits a call's header once its name string is closed and then
    the raw characters of its parameters value, never characters it might have to take back (a bare
    number waits for what ends it). Text off that shape stops the scanner; nothing raises.
    """

    def __init__(self, choice: ToolChoice):
        if choice.mode not in ("named", "required"):
            raise ValueError(f"ToolCallStream streams 'named' or 'required' tool calls, not {choice.mode!r}")
        self.choice = choice
        self.calls: list[ToolCall] = []
        self._seen = 0  # characters of the text consumed
        # required mode: the scanner's state
        self._state = "array"
        self._raw = ""  # the key or name string being read, undecoded
        self._key: str | None = None
        self._value: _Value | None = None
        self._item_name: str | None = None
        self._item_call: ToolCall | None = None
        self._pending: list[str] = []  # argument characters of the current item not yet sent
        self._scalar = ""

    def feed(self, text: str) -> list[dict]:
        """The new `delta.tool_calls` entries, given the whole output so far."""
        if len(text) < self._seen:
            raise ValueError("ToolCallStream.feed takes the whole output so far, which only grows")
        out: list[dict] = []
        if self.choice.mode == "named":
            if not self.calls:
                self.calls.append(ToolCall(new_call_id(), self.choice.name or "", ""))
                out.append(_header(0, self.calls[0]))
            call = self.calls[0]
            visible = text.strip()
            if len(visible) > len(call.arguments):
                out.append(_fragment(0, visible[len(call.arguments) :]))
                call.arguments = visible
            self._seen = len(text)
            return out
        for ch in text[self._seen :]:
            self._step(ch, out)
        self._seen = len(text)
        self._flush(out)
        return out

    # the required-mode scanner

    def _args(self, chars: str) -> None:
        self._pending.append(chars)

    def _flush(self, out: list[dict]) -> None:
        call = self._item_call
        if call is not None and self._pending:
            fragment = "".join(self._pending)
            out.append(_fragment(len(self.calls) - 1, fragment))
            call.arguments += fragment
            self._pending = []

    def _end_item(self, out: list[dict]) -> None:
        self._flush(out)
        self._item_name = self._item_call = None
        self._pending = []
        self._state = "item_sep"

    def _read_string(self, ch: str) -> str | None:
        """Adds `ch` to the string being read; its decoded value once `ch` closes it, else None."""
        if ch == '"' and not _odd_backslashes(self._raw):
            try:
                return json.loads('"' + self._raw + '"')
            except ValueError:
                self._state = "bad"
                return None
        self._raw += ch
        return None

    def _step(self, ch: str, out: list[dict]) -> None:
        state = self._state
        if state in ("done", "bad"):
            return
        if state in ("key", "name"):
            value = self._read_string(ch)
            if value is None:
                return
            self._raw = ""
            if state == "key":
                self._key, self._state = value, "colon"
            else:
                if self._item_name is None:
                    self._item_name = value
                    call = ToolCall(new_call_id(), value, "")
                    self.calls.append(call)
                    self._item_call = call
                    out.append(_header(len(self.calls) - 1, call))
                    self._flush(out)
                self._state = "pair_sep"
            return
        if state in ("params", "skip"):
            assert self._value is not None
            r = self._value.step(ch)
            if r == _Value.BAD:
                self._state = "bad"
            elif r == _Value.AFTER:  # a bare scalar ended before ch
                if state == "params":
                    self._args(self._scalar)
                self._scalar = ""
                self._state = "pair_sep"
                self._step(ch, out)
            elif self._value.kind == "scalar":
                self._scalar += ch
            else:
                if state == "params":
                    self._args(ch)
                if r == _Value.LAST:
                    self._state = "pair_sep"
            return
        if ch in _WS:
            return
        if state == "array":
            self._state = "first_item" if ch == "[" else "bad"
        elif state in ("first_item", "item_sep", "item"):
            if ch == "{" and state != "item_sep":
                self._state = "first_key"
            elif ch == "]" and state != "item":
                self._state = "done"
            elif ch == "," and state == "item_sep":
                self._state = "item"
            else:
                self._state = "bad"
        elif state in ("first_key", "key_next"):
            if ch == '"':
                self._state = "key"
            elif ch == "}" and state == "first_key":
                self._end_item(out)
            else:
                self._state = "bad"
        elif state == "colon":
            self._state = "value" if ch == ":" else "bad"
        elif state == "value":
            if self._key == "name" and ch == '"':
                self._state = "name"
                return
            self._value = _Value()
            self._state = "params" if self._key == "parameters" else "skip"
            self._step(ch, out)
        elif state == "pair_sep":
            if ch == ",":
                self._state = "key_next"
            elif ch == "}":
                self._end_item(out)
            else:
                self._state = "bad"


def _odd_backslashes(raw: str) -> bool:
    """Whether `raw` ends in an odd number of backslashes (so a quote after it is escaped)."""
    n = len(raw) - len(raw.rstrip("\\"))
    return n % 2 == 1


# ---------------------------------------------------------------------------------------------------------
# "auto": the model's own call formats


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_constant)


def _decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """One strict JSON value (no NaN or Infinity) at `pos`, and where it ends; ValueError otherwise."""
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _loads(text: str) -> Any:
    """All of `text` as strict JSON; ValueError otherwise."""
    text = text.strip()
    value, end = _decode(text)
    if end != len(text):
        raise ValueError("extra data")
    return value


def _dumps(value: Any) -> str:
    """Compact JSON, non-ASCII kept unless the text holds lone surrogates (which UTF-8 cannot carry)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, separators=(",", ":"))
    return text


def _call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments JSON) of a JSON call object `{"name": ..., "arguments": {...}}`, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if args is None:
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = _loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return obj["name"], _dumps(args)
    except ValueError:  # an integer too long to print
        return None


def _read_call(text: str, pos: int) -> tuple[tuple[str, str], int] | None:
    """The JSON call object at `pos` as (name, arguments JSON), and where it ends; None if there is none."""
    try:
        obj, end = _decode(text, pos)
    except ValueError:
        return None
    call = _call(obj)
    return None if call is None else (call, end)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the start of `marker` (but not all of it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


Calls = list[tuple[str, str]]


class ToolParser:
    """Reads the calls a model wrote in its own format (tool_choice "auto").

    `parse(text) -> (content, calls)`: content is the text outside the calls (None if only whitespace);
    text that is not a well-formed call stays content, and with no call the content is the text as it
    is. Streaming: `feed(accumulated_text) -> (content_delta, tool_call_deltas)` for each longer text,
    then `finish()` for the rest. Content streams until a call's start marker appears (a partial marker
    at the end, and trailing whitespace, wait until what follows decides); each call is sent, header and
    then its whole arguments (as `ToolCallStream` shapes them), once it is complete and well formed, so
    nothing sent is ever taken back. The deltas add up to what `parse` returns for the whole text. A
    parser keeps the state of one stream: use a new one per request (`parser_for` makes one).

    A family implements `_start(text) -> (start, hold)`: where call text begins (None if nowhere yet) and
    how many trailing characters to hold back meanwhile; and `_calls(tail, final) -> (calls, leftover)`:
    the calls in `tail` (the text from `start`) and the non-call text left in it. When not `final` it
    returns only calls that are complete, each of which `final` returns too, in the same order.
    """

    #: characters that end a call: the parser looks for new calls only when one arrives
    closers = ""

    def __init__(self):
        self.calls: list[ToolCall] = []
        self._text = ""
        self._content = ""

    # family hooks
    def _start(self, text: str) -> tuple[int | None, int]:
        raise NotImplementedError

    def _calls(self, tail: str, final: bool) -> tuple[Calls, str]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        content, calls = self._parse(text)
        return content, [ToolCall(new_call_id(), name, args) for name, args in calls]

    def _parse(self, text: str) -> tuple[str | None, Calls]:
        start, _ = self._start(text)
        calls, leftover = self._calls(text[start:], final=True) if start is not None else ([], "")
        if not calls:
            return (text if text.strip() else None), []
        prefix = text[:start]
        content = (prefix + leftover).rstrip() if prefix.strip() else leftover.strip()
        return (content if content.strip() else None), calls

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content delta, new `delta.tool_calls` entries), given the whole output so far."""
        new = text[len(self._text) :]
        self._text = text
        start, hold = self._start(text)
        candidate = text[: len(text) - hold] if start is None else text[:start]
        deltas: list[dict] = []
        if start is not None and any(c in new for c in self.closers):
            calls, _ = self._calls(text[start:], final=False)
            deltas = self._emit(calls)
        return self._content_delta(candidate.rstrip() if candidate.strip() else ""), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The rest of the stream, once the output is complete."""
        content, calls = self._parse(self._text)
        return self._content_delta(content or ""), self._emit(calls)

    def _content_delta(self, visible: str) -> str:
        if not visible.startswith(self._content):  # cannot happen by construction; never take text back
            return ""
        delta, self._content = visible[len(self._content) :], visible
        return delta

    def _emit(self, calls: Calls) -> list[dict]:
        out = []
        for name, args in calls[len(self.calls) :]:
            call = ToolCall(new_call_id(), name, args)
            self.calls.append(call)
            out.append(_header(len(self.calls) - 1, call))
            out.append(_fragment(len(self.calls) - 1, args))
        return out


class HermesParser(ToolParser):
    """Hermes and Qwen 2.5/3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number,
    anywhere in the text. A last block the output ends inside still counts if its JSON is complete."""

    START, END = "<tool_call>", "</tool_call>"
    closers = ">"

    def _start(self, text):
        i = text.find(self.START)
        return (i, 0) if i >= 0 else (None, _partial_suffix(text, self.START))

    def _calls(self, tail, final):
        calls: Calls = []
        leftover = []
        pos = 0
        while True:
            i = tail.find(self.START, pos)
            if i < 0:
                leftover.append(tail[pos:])
                break
            leftover.append(tail[pos:i])
            body_start = i + len(self.START)
            j = tail.find(self.END, body_start)
            if j < 0 and not final:
                break
            body = tail[body_start:] if j < 0 else tail[body_start:j]
            end = len(tail) if j < 0 else j + len(self.END)
            try:
                call = _call(_loads(body))
            except ValueError:
                call = None
            if call is None:
                leftover.append(tail[i:end])
            else:
                calls.append(call)
            pos = end
        return calls, "".join(s for s in leftover if s.strip())


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (or "arguments"),
    optionally after `<|python_tag|>`, several separated by `;`. Output that starts otherwise is content."""

    TAG = "<|python_tag|>"
    closers = "}"

    def _start(self, text):
        stripped = text.lstrip()
        if stripped.startswith(self.TAG) or stripped.startswith("{"):
            return len(text) - len(stripped), 0
        if self.TAG.startswith(stripped):  # nothing yet, or the tag arriving
            return None, len(text)
        return None, 0

    def _calls(self, tail, final):
        if tail.startswith(self.TAG):
            tail = tail[len(self.TAG) :]
        calls: Calls = []
        pos = _skip_ws(tail, 0)
        while pos < len(tail):
            read = _read_call(tail, pos)
            if read is None:
                break
            calls.append(read[0])
            pos = _skip_ws(tail, read[1])
            if pos < len(tail) and tail[pos] == ";":
                pos = _skip_ws(tail, pos + 1)
            elif pos < len(tail):
                break
        return calls, tail[pos:]


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}` (or one object), or
    the v11 tokenizer's `[TOOL_CALLS]name[ARGS]{...}`, repeated. Content may come before. The server must
    keep special tokens in the text for the marker to be seen."""

    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    closers = "}"
    _V11_NAME = re.compile(r"\s*([a-zA-Z0-9_-]{1,64})\[ARGS\]")

    def _start(self, text):
        i = text.find(self.START)
        return (i, 0) if i >= 0 else (None, _partial_suffix(text, self.START))

    def _calls(self, tail, final):
        calls: Calls = []
        pos = 0
        while tail.startswith(self.START, pos):
            after = pos + len(self.START)
            end, ok = self._group(tail, after, calls)
            if not ok:
                if end != after:  # calls before the break: content resumes there, else at the marker
                    pos = end
                break
            pos = _skip_ws(tail, end)
        return calls, tail[pos:]

    def _group(self, tail: str, pos: int, calls: Calls) -> tuple[int, bool]:
        """Reads the calls after one marker into `calls`: (where reading stopped, whether the group was whole).
        A group that breaks off leaves the calls before the break in `calls` and stops at the break."""
        start = pos
        pos = _skip_ws(tail, pos)
        m = self._V11_NAME.match(tail, start)
        if m:
            try:
                args, end = _decode(tail, _skip_ws(tail, m.end()))
            except ValueError:
                return start, False
            call = _call({"name": m.group(1), "arguments": args})
            if call is None:
                return start, False
            calls.append(call)
            return end, True
        if tail.startswith("{", pos):
            read = _read_call(tail, pos)
            if read is None:
                return start, False
            calls.append(read[0])
            return read[1], True
        if not tail.startswith("[", pos):
            return start, False
        pos = _skip_ws(tail, pos + 1)
        before = len(calls)
        while True:
            read = _read_call(tail, pos)
            if read is None:
                break
            calls.append(read[0])
            pos = _skip_ws(tail, read[1])
            if tail.startswith(",", pos):
                pos = _skip_ws(tail, pos + 1)
            elif tail.startswith("]", pos):
                return pos + 1, True
            else:
                break
        # the array broke off: keep its whole calls, leave the rest (from the marker on, if none) as content
        return (pos if len(calls) > before else start), False


class PythonicParser(ToolParser):
    """Pythonic calls (vLLM's for Gemma 3 and Llama 4): the output is a Python list of calls with keyword
    arguments, `[get_weather(city="Paris", unit="c"), other(x=1)]`, optionally in a ``` fence. It is read
    with `ast` (never evaluated) and only literals are accepted (also JSON's true/false/null); anything
    else is content. Output that does not start like a list of calls is content from the first character
    that shows it."""

    closers = "]"
    _FENCE = re.compile(r"```[\w-]*[ \t]*\n\s*")
    _FENCE_OPENING = re.compile(r"`{0,3}|```[\w-]*[ \t]*")  # a fence still being written
    _CALL_LIST = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*(?:\(.*)?)?", re.DOTALL)  # how a list of calls begins

    def _start(self, text):
        stripped = text.lstrip()
        off = len(text) - len(stripped)
        m = self._FENCE.match(stripped)
        if m is None and self._FENCE_OPENING.fullmatch(stripped):
            return None, len(text)
        body = stripped[m.end() :] if m else stripped
        if not body:
            return None, len(text)
        if self._CALL_LIST.fullmatch(body):
            return off, 0
        return None, 0

    def __init__(self):
        super().__init__()
        self._scan: tuple[str, int, int, int] = ("", -1, 0, 0)  # (text scanned, list start, where, depth there)

    def _calls(self, tail, final):
        m = self._FENCE.match(tail)
        body_start = m.end() if m else 0
        j = self._list_end(tail, body_start)
        if j is None or j < 0:
            return [], tail
        try:
            tree = ast.parse(tail[body_start : j + 1], mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return [], tail
        calls = _pythonic_calls(tree.body)
        if not calls:
            return [], tail
        rest = tail[j + 1 :]
        if m:
            rest = re.sub(r"^\s*```", "", rest)
        return calls, rest

    _PLAIN = re.compile(r"[^\"'#\[\](){}]*")
    _STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
    _TRIPLE = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'(?:[^\\]|\\.)*?\'\'\'', re.DOTALL)
    _COMMENT = re.compile(r"#[^\n]*\n")

    def _list_end(self, tail: str, start: int) -> int | None:
        """The index of the `]` closing the list that opens at `start` (Python strings and comments skipped),
        -1 if a bracket of another kind closes it, None if it has not closed yet. Streaming resumes where the
        last call stopped, so a long output is scanned once."""
        scanned, scanned_start, pos, depth = self._scan
        if not (scanned_start == start and tail.startswith(scanned)):
            if not tail.startswith("[", start):
                return -1
            pos, depth = start + 1, 1
        n = len(tail)
        while True:
            pos = self._PLAIN.match(tail, pos).end()
            if pos >= n:
                break
            ch = tail[pos]
            if ch in "[({":
                depth += 1
                pos += 1
                continue
            if ch in "])}":
                depth -= 1
                pos += 1
                if depth == 0:
                    return pos - 1 if ch == "]" else -1
                continue
            if ch == "#":
                found = self._COMMENT.match(tail, pos)
            elif tail.startswith(ch * 3, pos):
                found = self._TRIPLE.match(tail, pos)
            else:
                found = self._STRING.match(tail, pos)
                if found and found.end() == n and found.end() - pos == 2:  # "" may yet be """
                    found = None
            if found is None:  # a string or comment still open
                break
            pos = found.end()
        self._scan = (tail[:pos], start, pos, depth)
        return None


def _pythonic_calls(node: ast.AST) -> Calls:
    """The calls of a list of keyword-argument calls with literal values, or [] if `node` is anything else."""
    if not isinstance(node, ast.List) or not node.elts:
        return []
    calls: Calls = []
    try:
        for call in node.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
                return []
            args = {}
            for kw in call.keywords:
                if kw.arg is None:  # **kwargs
                    return []
                args[kw.arg] = _literal(kw.value)
            calls.append((call.func.id, _dumps(args)))
    except (ValueError, TypeError, RecursionError):
        return []
    return calls


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """The JSON value of a Python literal; ValueError for anything else (names, calls, f-strings, ...)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, str, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise ValueError(f"{value!r} is not a JSON value")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before something not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("dict keys must be strings")
            out[key] = _literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"{type(node).__name__} is not a literal")


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}

_BY_MODEL_TYPE = {
    "gemma": "pythonic",
    "gemma2": "pythonic",
    "gemma3": "pythonic",
    "gemma3_text": "pythonic",
    "llama4": "pythonic",
    "llama4_text": "pythonic",
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
}


def parser_name(model_type: str) -> str:
    """The `PARSERS` entry for a Hugging Face `model_type` (hermes for types it does not know)."""
    return _BY_MODEL_TYPE.get(model_type, "hermes")


def parser_for(model_type: str) -> ToolParser:
    """A new parser for a Hugging Face `model_type` (hermes for types it does not know)."""
    return PARSERS[parser_name(model_type)]()


def tools_system_prompt(tools: list[Tool]) -> str:
    """System-prompt text that teaches the pythonic call format, for models whose chat template ignores
    `tools` (Gemma 3). The caller puts it before (or in) the request's own system message."""
    listing = [
        {"name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters}
        for t in tools
    ]
    return (
        "You can call functions. To call one or more, reply with only a Python list of calls and nothing "
        "else, like this:\n"
        "[function_name(argument_name=value, other_argument=value), other_function(argument_name=value)]\n"
        "Use keyword arguments with literal values only (quoted strings, numbers, True, False, None, lists, "
        "dicts): no variables and no markdown. If no function fits, answer in plain text; if an argument a "
        "function requires is missing, ask for it.\n"
        "The functions, in JSON:\n" + json.dumps(listing, ensure_ascii=False)
    )


# ---------------------------------------------------------------------------------------------------------
# Chat history


def _arguments(value: Any, where: str) -> dict:
    """A history call's arguments as a dict (HF templates want a mapping); 400 if not a JSON object."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a JSON string", param=where)
    if not value.strip():
        return {}
    try:
        parsed = _loads(value)
    except ValueError as e:
        raise InvalidRequestError(f"{where} is not valid JSON: {e}", param=where) from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, got {type(parsed).__name__}", param=where)
    return parsed


def _text(content: Any, where: str) -> str:
    """A tool result's content as text: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.{k} must be a text part", param=f"{where}.{k}")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{where} must be a string or a list of text parts", param=where)


def history_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat history as HF chat templates expect it. Assistant `tool_calls` become
    `[{"id", "type": "function", "function": {"name", "arguments": <dict>}}]` (content "" when None);
    `role: "tool"` messages keep `tool_call_id` and `content` (as text), and gain the function's `name`
    where an earlier call has that id. Other messages are copied as they are. Accepts its own output."""
    if not isinstance(messages, list):
        raise InvalidRequestError("messages must be a list", param="messages")
    out: list[dict] = []
    names: dict[str, str] = {}
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidRequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            normal = []
            for j, call in enumerate(calls):
                cw = f"{where}.tool_calls.{j}"
                if not isinstance(call, dict):
                    raise InvalidRequestError(f"{cw} must be an object", param=cw)
                if call.get("type", "function") != "function":
                    raise InvalidRequestError(f"{cw}.type must be 'function'", param=f"{cw}.type")
                fn = call.get("function")
                if not isinstance(fn, dict):
                    raise InvalidRequestError(f"{cw}.function must be an object", param=f"{cw}.function")
                name = fn.get("name")
                if not isinstance(name, str) or not name:
                    raise InvalidRequestError(
                        f"{cw}.function.name must be a non-empty string", param=f"{cw}.function.name"
                    )
                arguments = _arguments(fn.get("arguments"), f"{cw}.function.arguments")
                entry: dict = {"type": "function", "function": {"name": name, "arguments": arguments}}
                if isinstance(call.get("id"), str):
                    entry["id"] = call["id"]
                    names[call["id"]] = name
                normal.append(entry)
            content = msg.get("content")
            out.append({**msg, "content": "" if content is None else content, "tool_calls": normal})
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(
                    f"{where}.tool_call_id must be the id of the call this message answers",
                    param=f"{where}.tool_call_id",
                )
            content = _text(msg.get("content"), f"{where}.content")
            tool_msg = {"role": "tool", "tool_call_id": call_id, "content": content}
            name = msg.get("name") if isinstance(msg.get("name"), str) else names.get(call_id)
            if name:
                tool_msg["name"] = name
            out.append(tool_msg)
        else:
            out.append(dict(msg))
    return out


def _python(value: Any) -> str:
    """A JSON value as a Python literal (the pythonic call format)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(str(k), ensure_ascii=False)}: {_python(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def pythonic_calls_text(calls: list[dict]) -> str:
    """Normalised history calls (`{"function": {"name", "arguments": dict}}`) as a pythonic list of calls."""
    parts = []
    for call in calls:
        fn = call["function"]
        args = ", ".join(f"{k}={_python(v)}" for k, v in fn["arguments"].items())
        parts.append(f"{fn['name']}({args})")
    return "[" + ", ".join(parts) + "]"


def flatten_tool_history(messages: list[dict]) -> list[dict]:
    """History for templates with no tool roles (Gemma): assistant tool calls become assistant text in the
    pythonic format (after the message's own content), and tool results become a user turn
    `Tool result (<call id>): <content>`, results in a row joined into one turn so roles still alternate."""
    out: list[dict] = []
    from_tools = False  # whether out[-1] is a user turn made of tool results
    for msg in history_messages(messages):
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            text = pythonic_calls_text(msg["tool_calls"])
            content = msg.get("content")
            if isinstance(content, str) and content.strip():
                text = content.rstrip() + "\n" + text
            out.append({"role": "assistant", "content": text})
            from_tools = False
        elif msg.get("role") == "tool":
            line = f"Tool result ({msg['tool_call_id']}): {msg['content']}"
            if from_tools:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + line}
            else:
                out.append({"role": "user", "content": line})
            from_tools = True
        else:
            out.append(msg)
            from_tools = False
    return out
