"""Tool calling for one chat request: what the prompt tells the model about tools, what the grammar enforces,
and how a choice's text becomes OpenAI's assistant message, whole or streamed.

The rules themselves are pure functions in `inferd.structured.tools`; this module puts them together for one
request (`ToolPlan`) and one streamed choice (`ChoiceStream`). The server renders and reads chats with it, and
the gateway renders with it too (`ToolPlan.conversation`), so its token counts and prefix keys stay the
engine's for requests with tools:
- "none": the text is content (tools are left out of the prompt, as OpenAI's model does not see them either).
- "auto": the model writes calls in its own format and a parser reads them back: the model family's format
  where the chat template renders `tools` (Qwen's `<tool_call>`, Llama 3's JSON, Mistral's `[TOOL_CALLS]`),
  or the pythonic format taught in a system prompt where the template ignores them (Gemma 3).
- "required" and a named function: the output follows a JSON schema (`constraint_schema`), so the calls
  always parse and their arguments always validate; the text never reaches the client as content.

`finish_reason` is "tool_calls" when an "auto" or "required" output stopped after making calls, as OpenAI
and vLLM report it; a named function keeps "stop", as OpenAI's API does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.structured import tools as tc
from inferd.structured.spec import Constraint

_SPECIAL_MARKERS = ("mistral", "llama3_json")

#: `--tool-call-parser` values: "auto" picks by chat template and model type (`ToolPlan` above)
TOOL_PARSERS = ("auto", *sorted(tc.PARSERS))


def template_knows_tools(tokenizer) -> bool:
    """Whether the model's chat template renders `tools` (and so tool calls and results in history)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders the chat
        template = template.get("default")
    return isinstance(template, str) and "tools" in template


@dataclass(frozen=True)
class ToolPlan:
    """One chat request's tools, what it allows, and how the model's text is read back."""

    tools: list[tc.Tool]
    choice: tc.ToolChoice
    in_template: bool  # the chat template renders the tools; otherwise a system prompt teaches them
    parser: str  # the "auto" parser's name (tc.PARSERS)

    @property
    def mode(self) -> str:
        return self.choice.mode

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the "auto" parser reads markers the tokenizer holds as special tokens (Mistral's
        `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`), which the output must then keep, as vLLM's parsers ask."""
        return self.mode == "auto" and self.parser in _SPECIAL_MARKERS

    def constraint(self) -> Constraint | None:
        """The grammar for "required" and a named function; None where the model is free."""
        schema = tc.constraint_schema(self.tools, self.choice)
        return None if schema is None else Constraint.json(schema, param="tools")

    def conversation(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """The history as the template should see it, and the template's extra arguments (`tools`)."""
        if self.in_template:
            history = tc.history_messages(messages)
            listed = self.tools if self.mode != "none" else []
            kwargs = {"tools": [_tool_json(t) for t in listed]} if listed else {}
            return history, kwargs
        history = tc.flatten_tool_history(messages)
        if self.mode == "none":
            return history, {}
        prompt = tc.tools_system_prompt(self.tools)
        if history and history[0].get("role") == "system" and isinstance(history[0].get("content"), str):
            return [{**history[0], "content": prompt + "\n\n" + history[0]["content"]}, *history[1:]], {}
        return [{"role": "system", "content": prompt}, *history], {}

    def message(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of a whole output."""
        if self.mode == "none":
            return text, [], finish_reason
        if self.mode == "auto":
            content, calls = tc.PARSERS[self.parser]().parse(text)
        else:
            content, calls = None, tc.calls_from_constrained(text, self.choice)
        return content, [c.to_openai() for c in calls], self.finish_reason(finish_reason, bool(calls))

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


def _tool_json(tool: tc.Tool) -> dict:
    fn: dict = {"name": tool.name, "parameters": tool.parameters}
    if tool.description:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


@dataclass
class ChoiceStream:
    """One streamed choice: each piece of new text in, (content delta, `delta.tool_calls` entries) out."""

    plan: ToolPlan
    text: str = ""
    called: bool = False
    _reader: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.plan.mode == "auto":
            self._reader = tc.PARSERS[self.plan.parser]()
        elif self.plan.mode in ("named", "required"):
            self._reader = tc.ToolCallStream(self.plan.choice)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self._reader is None:
            return delta, []
        if isinstance(self._reader, tc.ToolCallStream):
            return self._note("", self._reader.feed(self.text))
        return self._note(*self._reader.feed(self.text))

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the choice has finished (a call a parser could only close at the end)."""
        if isinstance(self._reader, tc.ToolParser):
            return self._note(*self._reader.finish())
        return "", []

    def _note(self, content: str, calls: list[dict]) -> tuple[str, list[dict]]:
        self.called = self.called or bool(calls)
        return content, calls


def tool_plan(
    tools: list[dict] | None,
    tool_choice,
    parallel_tool_calls: bool | None,
    tokenizer,
    model_type: str,
    parser: str = "auto",
) -> ToolPlan:
    """The plan for a request's `tools`, `tool_choice` and `parallel_tool_calls` (400s name the field)."""
    parsed = tc.parse_tools(tools)
    choice = tc.resolve_tool_choice(parsed, tool_choice, parallel_tool_calls)
    in_template = template_knows_tools(tokenizer)
    if parser == "auto":
        # a template that ignores tools gets the pythonic format from our system prompt, whatever the family
        parser = tc.parser_name(model_type) if in_template else "pythonic"
    return ToolPlan(parsed, choice, in_template, parser)
