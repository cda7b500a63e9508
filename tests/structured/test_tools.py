"""inferd.structured.tools: OpenAI tool calling on plain strings (no model, no engine, no server)."""

from __future__ import annotations

import json
import keyword
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd.errors import InvalidRequestError
from inferd.structured.tools import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Tool,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    ToolParser,
    calls_from_constrained,
    constraint_schema,
    flatten_tool_history,
    history_messages,
    new_call_id,
    parse_tools,
    parser_for,
    pythonic_calls_text,
    resolve_tool_choice,
    tools_system_prompt,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_PARAMS = WEATHER["function"]["parameters"]
ARGS = "messages.2.tool_calls.0.function.arguments"
TIME = {"type": "function", "function": {"name": "get_time"}}


def tools():
    return parse_tools([WEATHER, TIME])


# ---------------------------------------------------------------------------------------------------------
# parse_tools


def test_parse_tools_reads_openai_tools_with_defaults():
    weather, time = tools()
    assert weather == Tool("get_weather", "Current weather in a city", WEATHER["function"]["parameters"])
    assert time == Tool("get_time", None, {"type": "object", "properties": {}})
    assert parse_tools(None) == [] and parse_tools([]) == []
    strict = {"type": "function", "function": {"name": "a-b_9", "strict": True, "parameters": {}}}
    assert parse_tools([strict]) == [Tool("a-b_9", None, {})]


def fn(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "value, param, words",
    [
        ({"type": "function"}, "tools", "must be a list"),
        (["x"], "tools.0", "must be an object"),
        ([{"type": "code", "function": {"name": "f"}}], "tools.0.type", "must be 'function', got 'code'"),
        ([{"function": {"name": "f"}}], "tools.0.type", "must be 'function'"),
        ([{"type": "function", "function": "f"}], "tools.0.function", "must be an object"),
        ([fn()], "tools.0.function.name", "got None"),
        ([fn(name="")], "tools.0.function.name", "1 to 64"),
        ([fn(name="has space")], "tools.0.function.name", "'has space'"),
        ([fn(name="x" * 65)], "tools.0.function.name", "1 to 64"),
        ([fn(name="f"), fn(name="g"), fn(name="f")], "tools.2.function.name", "'f' is not unique"),
        ([fn(name="f", description=3)], "tools.0.function.description", "must be a string"),
        ([fn(name="f", parameters=[])], "tools.0.function.parameters", "must be a JSON schema"),
        ([fn(name="f", parameters={"type": "string"})], "tools.0.function.parameters", "type 'object'"),
        ([fn(name="f", strict="yes")], "tools.0.function.strict", "must be a boolean"),
    ],
)
def test_parse_tools_errors_name_the_field(value, param, words):
    with pytest.raises(InvalidRequestError) as e:
        parse_tools(value)
    assert e.value.param == param
    assert words in str(e.value) and param in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# resolve_tool_choice


def test_tool_choice_defaults_follow_openai():
    ts = tools()
    assert resolve_tool_choice([], None, None) == ToolChoice("none")
    assert resolve_tool_choice(ts, None, None) == ToolChoice("auto")
    assert resolve_tool_choice(ts, "none", None) == ToolChoice("none")
    assert resolve_tool_choice([], "none", None) == ToolChoice("none")
    assert resolve_tool_choice([], "auto", None) == ToolChoice("none")
    assert resolve_tool_choice(ts, "auto", False) == ToolChoice("auto", parallel=False)
    assert resolve_tool_choice(ts, "required", None) == ToolChoice("required", parallel=True)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_tool_choice(ts, named, None) == ToolChoice("named", "get_time")


@pytest.mark.parametrize(
    "has_tools, choice, parallel, param, words",
    [
        (False, "required", None, "tool_choice", "'required' but the request has no tools"),
        (True, "any", None, "tool_choice", "got 'any'"),
        (True, 3, None, "tool_choice", "must be a string or an object"),
        (True, {"type": "tool", "function": {"name": "get_time"}}, None, "tool_choice.type", "got 'tool'"),
        (True, {"type": "function"}, None, "tool_choice.function", "string name"),
        (True, {"type": "function", "function": {"name": 1}}, None, "tool_choice.function", "string name"),
        (True, {"type": "function", "function": {"name": "x"}}, None, "tool_choice.function.name", "not in tools"),
        (False, {"type": "function", "function": {"name": "x"}}, None, "tool_choice.function.name", "not in tools"),
        (True, "auto", "yes", "parallel_tool_calls", "must be a boolean"),
    ],
)
def test_tool_choice_errors_name_the_field(has_tools, choice, parallel, param, words):
    with pytest.raises(InvalidRequestError) as e:
        resolve_tool_choice(tools() if has_tools else [], choice, parallel)
    assert e.value.param == param and words in str(e.value)


def test_named_choice_message_says_which_function():
    with pytest.raises(InvalidRequestError, match="tool_choice names function 'x', which is not in tools"):
        resolve_tool_choice(tools(), {"type": "function", "function": {"name": "x"}}, None)


# ---------------------------------------------------------------------------------------------------------
# constraint_schema


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_no_schema_where_the_model_is_free():
    assert constraint_schema(tools(), ToolChoice("none"), True) is None
    assert constraint_schema(tools(), ToolChoice("auto"), True) is None


def test_named_schema_is_the_parameters():
    schema = constraint_schema(tools(), ToolChoice("named", "get_weather"), True)
    assert schema == WEATHER["function"]["parameters"]
    assert valid(schema, {"city": "Paris", "unit": "c"})
    assert not valid(schema, {"unit": "c"}) and not valid(schema, {"city": "Paris", "x": 1})


def test_required_schema_accepts_calls_and_nothing_else():
    schema = constraint_schema(tools(), ToolChoice("required"), True)
    jsonschema.Draft202012Validator.check_schema(schema)
    one = {"name": "get_weather", "parameters": {"city": "Paris"}}
    two = {"name": "get_time", "parameters": {}}
    assert valid(schema, [one]) and valid(schema, [one, two, one])
    assert not valid(schema, [])
    assert not valid(schema, [{"name": "get_weather", "parameters": {}}])  # city is required
    assert not valid(schema, [{"name": "nope", "parameters": {}}])
    assert not valid(schema, [{"name": "get_time"}])
    assert not valid(schema, [{**two, "extra": 1}])
    assert not valid(schema, one)
    single = constraint_schema(tools(), ToolChoice("required"), False)
    assert single["maxItems"] == 1 and valid(single, [one]) and not valid(single, [one, two])
    # parallel defaults to the choice's own
    assert constraint_schema(tools(), ToolChoice("required", parallel=False))["maxItems"] == 1


def test_required_schema_keeps_refs_working():
    params = {
        "type": "object",
        "properties": {"point": {"$ref": "#/$defs/point"}, "const": {"const": {"$ref": "#/data"}}},
        "required": ["point"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
    }
    ts = [Tool("a", None, {"type": "object"}), Tool("draw", None, params)]
    schema = constraint_schema(ts, ToolChoice("required"), True)
    point = schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["point"]
    assert point == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/point"}
    assert schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["const"] == {
        "const": {"$ref": "#/data"}
    }  # a value, not a schema: left as it is
    assert valid(schema, [{"name": "draw", "parameters": {"point": {"x": 1}}}])
    assert not valid(schema, [{"name": "draw", "parameters": {"point": {"x": "one"}}}])
    assert params["properties"]["point"] == {"$ref": "#/$defs/point"}  # the tool itself is not changed


# ---------------------------------------------------------------------------------------------------------
# calls


def test_call_ids_and_openai_shape():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    call = ToolCall("call_1", "f", '{"a":1}')
    assert call.to_openai() == {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def test_calls_from_constrained_named_is_the_text():
    text = '{"city": "Paris", "unit": "c"}'
    [call] = calls_from_constrained(" " + text + "\n", ToolChoice("named", "get_weather"))
    assert call.name == "get_weather" and call.arguments == text
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)


def test_calls_from_constrained_required_reads_each_item():
    text = '[{"name": "get_weather", "parameters": {"city": "Par}is\\"{"}}, {"name":"get_time","parameters":{}}]'
    calls = calls_from_constrained(text, ToolChoice("required"))
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": 'Par}is"{'}, {}]
    assert calls[0].arguments == '{"city": "Par}is\\"{"}'  # as generated
    assert len({c.id for c in calls}) == 2


def test_constrained_modes_only():
    for mode in ("none", "auto"):
        with pytest.raises(ValueError):
            ToolCallStream(ToolChoice(mode))


def reassemble(entries: list[dict]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per index from `delta.tool_calls` entries, checking their shape on the way."""
    calls: dict[int, list[str]] = {}
    for e in entries:
        i = e["index"]
        if i not in calls:
            assert i == len(calls), "indexes come in order"
            assert (
                e["type"] == "function"
                and e["function"]["arguments"] == ""
                and set(e)
                == {
                    "index",
                    "id",
                    "type",
                    "function",
                }
            )
            calls[i] = [e["id"], e["function"]["name"], ""]
        else:
            assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            assert e["function"]["arguments"]
            calls[i][2] += e["function"]["arguments"]
    return [tuple(c) for c in calls.values()]


def stream_constrained(choice: ToolChoice, text: str, cuts: list[int]) -> tuple[ToolCallStream, list[dict]]:
    stream = ToolCallStream(choice)
    entries = []
    for cut in [*sorted(cuts), len(text)]:
        entries += stream.feed(text[:cut])
    return stream, entries


REQUIRED_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]',
    '[{"name":"get_weather","parameters":{"city":"a}b{c"}},{"name":"get_time","parameters":{}}]',
    '[ {"name" : "f\\"g", "parameters" : {"q": "say \\"hi\\" \\\\", "n": [1, {"x": "]}"}]}} ,\n'
    ' {"name": "h", "parameters": {"e": "\\u00e9\\n\\t", "z": null, "t": true, "f": -1.5e3}} ]',
    '[{"parameters": {"a": 1}, "name": "late"}]',  # name after parameters: header waits, nothing lost
    '[{"name": "n", "parameters": 42}, {"name": "m", "parameters": "s}"}]',  # bare values
    '[{"name": "\\u0066", "extra": {"k": "}"}, "parameters": {}}]',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_stream_every_prefix(text):
    full = json.loads(text)
    stream = ToolCallStream(ToolChoice("required"))
    entries, snapshots = [], []
    for i in range(len(text) + 1):
        entries += stream.feed(text[:i])
        snapshots.append(reassemble(entries))
    got = snapshots[-1]
    for snap in snapshots:  # what was sent is never taken back: each snapshot is a prefix of the end
        assert len(snap) <= len(got)
        assert all(g[:2] == s[:2] and g[2].startswith(s[2]) for s, g in zip(snap, got, strict=False))
    assert [(n, json.loads(a)) for _, n, a in got] == [(x["name"], x["parameters"]) for x in full]
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == got
    assert [(c.name, c.arguments) for c in calls_from_constrained(text, ToolChoice("required"))] == [
        (n, a) for _, n, a in got
    ]


def test_required_stream_header_once_name_closes_and_no_overshoot():
    text = '[{"name": "get_time", "parameters": {"a": 12}}, {"name": "x'
    stream = ToolCallStream(ToolChoice("required"))
    assert stream.feed(text[: text.index("get_time") + 4]) == []  # name still open
    [header] = stream.feed(text[: text.index("get_time") + 9])
    assert header["function"] == {"name": "get_time", "arguments": ""}
    entries = stream.feed(text)
    assert reassemble([header, *entries]) == [(header["id"], "get_time", '{"a": 12}')]  # no '}' of the item


def test_required_stream_truncated_and_malformed_never_raise():
    cut = '[{"name": "f", "parameters": {"a": "unfinished'
    [call] = calls_from_constrained(cut, ToolChoice("required"))
    assert call.name == "f" and call.arguments == '{"a": "unfinished'
    for junk in ["", "hello", "[1, 2]", '[{"name": 3}]', '{"name": "f"}', '[{"name": "f" "parameters": {}}]', "]]"]:
        assert isinstance(calls_from_constrained(junk, ToolChoice("required")), list)
    assert calls_from_constrained('[{"name": "f"}]', ToolChoice("required"))[0].arguments == ""
    stream = ToolCallStream(ToolChoice("required"))
    stream.feed("[{")
    with pytest.raises(ValueError, match="whole output so far"):
        stream.feed("[")


def test_named_stream_streams_the_text():
    text = '  {"city": "Pa ris"}  \n'
    stream, entries = stream_constrained(ToolChoice("named", "get_weather"), text, list(range(len(text))))
    [(_, name, args)] = reassemble(entries)
    assert name == "get_weather" and args == text.strip() == stream.calls[0].arguments
    assert entries[0]["function"]["arguments"] == "" and entries[0]["index"] == 0
    assert ToolCallStream(ToolChoice("named", "f")).feed("") != []  # the header comes at once


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(alphabet=st.sampled_from('ab{}[]",:\\/ \n\té🙂'), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k{"\\]', max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
calls_strategy = st.lists(
    st.tuples(st.text(alphabet='fg_"\\{', min_size=1, max_size=4), st.dictionaries(st.text(max_size=3), json_values)),
    min_size=1,
    max_size=3,
)


@FAST
@given(
    calls=calls_strategy,
    sep=st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " : ")]),
    ascii=st.booleans(),
    data=st.data(),
)
def test_required_stream_reassembles_from_any_cuts(calls, sep, ascii, data):
    items = [{"name": n, "parameters": p} for n, p in calls]
    text = json.dumps(items, separators=sep, ensure_ascii=ascii)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    stream, entries = stream_constrained(ToolChoice("required"), text, cuts)
    got = reassemble(entries)
    assert [(n, json.loads(a)) for _, n, a in got] == [(n, p) for n, p in calls]
    assert [(c.name, c.arguments) for c in calls_from_constrained(text, ToolChoice("required"))] == [
        (n, a) for _, n, a in got
    ]


@FAST
@given(args=st.dictionaries(st.text(max_size=4), json_values), data=st.data())
def test_named_stream_reassembles_from_any_cuts(args, data):
    text = json.dumps(args, indent=data.draw(st.sampled_from([None, 2])))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    _, entries = stream_constrained(ToolChoice("named", "f"), text, cuts)
    [(_, name, arguments)] = reassemble(entries)
    assert name == "f" and json.loads(arguments) == args
    assert arguments == calls_from_constrained(text, ToolChoice("named", "f"))[0].arguments


# ---------------------------------------------------------------------------------------------------------
# "auto" parsers


def stream_parser(cls, text: str, cuts) -> tuple[str, list[tuple[str, str, str]], ToolParser]:
    parser = cls()
    content, entries = "", []
    for cut in [*sorted(cuts), len(text)]:
        c, d = parser.feed(text[:cut])
        content += c
        entries += d
    c, d = parser.finish()
    return content + c, reassemble(entries + d), parser


def check_stream_matches_parse(cls, text: str, cuts) -> None:
    content, calls = cls().parse(text)
    streamed_content, streamed, parser = stream_parser(cls, text, cuts)
    assert streamed_content == (content or "")
    assert [(n, a) for _, n, a in streamed] == [(c.name, c.arguments) for c in calls]
    assert [(c.id, c.name, c.arguments) for c in parser.calls] == streamed


def names_args(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


HERMES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "</Paris>"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> middle <tool_call>{"name": "g"}',
    "No tools needed: 2 < 3 and <tool is not a marker. <tool_cal",
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    "",
    "   \n",
]
LLAMA = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "f", "parameters": {"a": "}{"}}; {"name": "g", "arguments": {}}',
    ' {"name": "f", "parameters": {}} ; {"name": "g"} and then prose',
    '{"answer": 42}',
    '{"name": "f", "parameters": {"a": 1}',
    'The weather is nice. {"name": "f", "parameters": {}}',
    "<|python_tag|>print('hi')",
    "<|python",
]
MISTRAL = [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
    'Sure! [TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS] {"name": "f", "arguments": {}}',
    '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"oops": 1}] trailing',
    "[TOOL_CALLS] nothing",
    "A [TOOL_ list [TOOL_CALLS",
]
PYTHONIC = [
    '[get_weather(city="Paris", unit="c")]',
    "[get_weather(city='Paris'), get_time()]",
    '[f(a=[1, -2.5, {"k": (1, 2)}], b=None, c=True, d=true, e=null, s="x]y")] ',
    '```tool_code\n[f(x="a")]\n```',
    "```python\nprint('hello')\n```",
    "[Note] this is prose",
    "[f(x=y)]",  # a variable
    "[f(1)]",  # positional
    "[f(x=g())]",
    '[f(x=f"{y}")]',
    "[f(**kw)]",
    "[1, 2]",
    "[]",
    "[f(x=1)] and some words",
    "[f(x=1e999)]",
    "  [f(",
    "Hello [f(x=1)]",
    '[f(x="""a]\n"b)"""), g(y=\'\'\'c\'\'\')]',  # triple quotes
    "[f(x=1,  # a comment ] )\n y=2)]",
    "[f(x=\"\", y='')]",  # an empty string may yet turn out to open a triple quote
    "[f(x=1)}",
    '[f(x="\\"]")]',
]
CORPUS = [(HermesParser, t) for t in HERMES]
CORPUS += [(Llama3JsonParser, t) for t in LLAMA]
CORPUS += [(MistralParser, t) for t in MISTRAL]
CORPUS += [(PythonicParser, t) for t in PYTHONIC]


@pytest.mark.parametrize("cls, text", CORPUS)
def test_stream_char_by_char_matches_parse(cls, text):
    check_stream_matches_parse(cls, text, range(len(text)))
    check_stream_matches_parse(cls, text, [])


@FAST
@given(case=st.sampled_from(CORPUS), data=st.data())
def test_stream_any_cuts_matches_parse(case, data):
    cls, text = case
    check_stream_matches_parse(cls, text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)))


identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))
auto_calls = st.lists(st.tuples(identifiers, st.dictionaries(identifiers, json_values, max_size=3)), max_size=3)
prose = st.lists(st.sampled_from(list('ab <>[](){}\n_:"é') + ["<tool", "_call>", "[TOOL_", "CALLS]"]), max_size=8).map(
    "".join
)


def write_calls(family: str, calls) -> str:
    """Calls as each family's model writes them."""
    if family == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if family == "llama3_json":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if family == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    return pythonic_calls_text([{"function": {"name": n, "arguments": a}} for n, a in calls])


@FAST
@given(family=st.sampled_from(sorted(PARSERS)), calls=auto_calls, before=prose, data=st.data())
def test_auto_parsers_read_what_models_write(family, calls, before, data):
    cls = PARSERS[family]
    if family in ("llama3_json", "pythonic"):  # the whole output is the calls
        before = ""
    text = before + write_calls(family, calls)
    content, got = cls().parse(text)
    if calls and not ("<tool_call>" in before or "[TOOL_CALLS]" in before):  # (prose with a marker: any reading)
        assert names_args(got) == calls
        assert content == (before.rstrip() if before.strip() else None)
    check_stream_matches_parse(cls, text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)))


def test_hermes_calls_and_content():
    content, calls = HermesParser().parse(HERMES[1])
    assert content == "Let me check."
    assert names_args(calls) == [("get_weather", {"city": "</Paris>"}), ("get_time", {})]
    assert calls[0].arguments == '{"city":"</Paris>"}'  # compact JSON
    content, calls = HermesParser().parse(HERMES[2])  # arguments as a JSON string are read too
    assert names_args(calls) == [("f", {"a": 1})] and content == "<tool_call>\nnot json\n</tool_call>"
    content, calls = HermesParser().parse(HERMES[3])  # the last block may be left open
    assert names_args(calls) == [("f", {"x": 1}), ("g", {})] and content == "a  middle"
    for text in HERMES[4:6]:
        assert HermesParser().parse(text) == (text, [])
    assert HermesParser().parse("") == (None, []) and HermesParser().parse(" \n") == (None, [])


def test_hermes_holds_a_split_marker():
    p = HermesParser()
    assert p.feed("Hi <") == ("Hi", [])
    assert p.feed("Hi <tool_") == ("", [])
    assert p.feed("Hi <tool_x") == (" <tool_x", [])
    p = HermesParser()
    assert p.feed("Hi <tool") == ("Hi", [])
    assert p.feed('Hi <tool_call>\n{"name": "f", ') == ("", [])
    content, deltas = p.feed('Hi <tool_call>\n{"name": "f", "arguments": {}}\n</tool_')
    assert (content, deltas) == ("", [])
    content, deltas = p.feed('Hi <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert content == "" and reassemble(deltas) == [(p.calls[0].id, "f", "{}")]
    assert p.finish() == ("", [])


def test_llama3_json():
    content, calls = Llama3JsonParser().parse(LLAMA[1])
    assert content is None and names_args(calls) == [("f", {"a": "}{"}), ("g", {})]
    content, calls = Llama3JsonParser().parse(LLAMA[2])
    assert content == "and then prose" and names_args(calls) == [("f", {}), ("g", {})]
    for text in LLAMA[3:]:
        assert Llama3JsonParser().parse(text) == (text, []), text
    p = Llama3JsonParser()
    assert p.feed("<|pyth") == ("", [])
    assert p.feed("<|pytho") == ("", [])
    assert p.feed("<|python_tag|>") == ("", [])
    content, deltas = p.feed('<|python_tag|>{"name": "f", "parameters": {"q": 1}}')
    assert reassemble(deltas) == [(p.calls[0].id, "f", '{"q":1}')]
    p = Llama3JsonParser()
    assert p.feed("Hel") == ("Hel", [])  # not a call: content streams at once


def test_mistral():
    content, calls = MistralParser().parse(MISTRAL[0])
    assert content is None and names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, calls = MistralParser().parse(MISTRAL[1])
    assert content == "Sure!" and names_args(calls) == [("f", {"a": "]"})]
    assert names_args(MistralParser().parse(MISTRAL[2])[1]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert names_args(MistralParser().parse(MISTRAL[3])[1]) == [("f", {})]
    content, calls = MistralParser().parse(MISTRAL[4])  # a bad item: the calls before it, the rest content
    assert names_args(calls) == [("f", {})] and content == '{"oops": 1}] trailing'
    for text in MISTRAL[5:]:
        assert MistralParser().parse(text) == (text, [])
    p = MistralParser()
    assert p.feed("Ok [TOOL") == ("Ok", [])
    assert p.feed('Ok [TOOL_CALLS] [{"name": "f", "arguments": {}') == ("", [])
    content, deltas = p.feed('Ok [TOOL_CALLS] [{"name": "f", "arguments": {}}')  # the item closed
    assert content == "" and reassemble(deltas) == [(p.calls[0].id, "f", "{}")]


def test_mistral_streams_each_item_when_it_closes():
    p = MistralParser()
    text = '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    first = text.index("}}") + 2
    assert p.feed(text[: first - 1]) == ("", [])
    content, deltas = p.feed(text[:first])
    assert content == "" and reassemble(deltas) == [(p.calls[0].id, "f", '{"a":1}')]
    assert [d["index"] for d in p.feed(text)[1]] == [1, 1]


def test_pythonic():
    content, calls = PythonicParser().parse(PYTHONIC[1])
    assert content is None and names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    _, calls = PythonicParser().parse(PYTHONIC[2])
    assert names_args(calls) == [
        ("f", {"a": [1, -2.5, {"k": [1, 2]}], "b": None, "c": True, "d": True, "e": None, "s": "x]y"})
    ]
    assert names_args(PythonicParser().parse(PYTHONIC[3])[1]) == [("f", {"x": "a"})]
    assert PythonicParser().parse(PYTHONIC[3])[0] is None  # the fence is not content
    for text in PYTHONIC[4:13] + ["[f(x=1e999)]", "  [f(", "Hello [f(x=1)]"]:
        assert PythonicParser().parse(text) == (text, []), text
    assert names_args(PythonicParser().parse(PYTHONIC[17])[1]) == [("f", {"x": 'a]\n"b)'}), ("g", {"y": "c"})]
    assert names_args(PythonicParser().parse(PYTHONIC[18])[1]) == [("f", {"x": 1, "y": 2})]
    assert names_args(PythonicParser().parse(PYTHONIC[19])[1]) == [("f", {"x": "", "y": ""})]
    assert PythonicParser().parse(PYTHONIC[20]) == (PYTHONIC[20], [])
    assert names_args(PythonicParser().parse(PYTHONIC[21])[1]) == [("f", {"x": '"]'})]
    content, calls = PythonicParser().parse("[f(x=1)] and some words")
    assert content == "and some words" and names_args(calls) == [("f", {"x": 1})]


def test_pythonic_streams_prose_at_once_and_holds_what_may_be_calls():
    p = PythonicParser()
    assert p.feed("[") == ("", [])
    assert p.feed("[No") == ("", [])
    assert p.feed("[Note]") == ("[Note]", [])
    p = PythonicParser()
    assert p.feed("```") == ("", [])
    assert p.feed("```python\n") == ("", [])
    assert p.feed("```python\npri") == ("```python\npri", [])
    p = PythonicParser()
    assert p.feed("[get_weather(city='Paris')") == ("", [])
    content, deltas = p.feed("[get_weather(city='Paris')]")
    assert content == "" and reassemble(deltas) == [(p.calls[0].id, "get_weather", '{"city":"Paris"}')]


def test_parsers_never_raise_on_junk():
    junk = ["[f(" * 200 + "]", "{" * 5000, "<tool_call>" + "[" * 3000 + "</tool_call>", "[TOOL_CALLS]" + "[" * 3000]
    junk += ["[f(x=" + "[" * 2000 + "]" * 2000 + ")]", "\x00[f(x=1)]", "[f(x='\ud800')]", "[f(x=" + "9" * 5000 + ")]"]
    for cls in PARSERS.values():
        for text in junk:
            content, calls = cls().parse(text)
            assert isinstance(calls, list)
            check_stream_matches_parse(cls, text, [len(text) // 2])


def test_arguments_with_lone_surrogates_stay_encodable():
    _, calls = PythonicParser().parse("[f(x='\\ud800é')]")
    calls[0].arguments.encode("utf-8")
    assert json.loads(calls[0].arguments) == {"x": "\ud800é"}


@pytest.mark.parametrize(
    "model_type, cls",
    [
        ("gemma3", PythonicParser),
        ("gemma3_text", PythonicParser),
        ("gemma2", PythonicParser),
        ("gemma", PythonicParser),
        ("qwen2", HermesParser),
        ("qwen3", HermesParser),
        ("qwen2_moe", HermesParser),
        ("llama", Llama3JsonParser),
        ("mistral", MistralParser),
        ("something_new", HermesParser),
    ],
)
def test_parser_for(model_type, cls):
    a, b = parser_for(model_type), parser_for(model_type)
    assert type(a) is cls and a is not b  # a fresh one per stream


def test_tools_system_prompt_lists_the_functions_and_the_format():
    prompt = tools_system_prompt(tools())
    assert "Python list of calls" in prompt and "[function_name(" in prompt
    listing = json.loads(prompt[prompt.index("in JSON:\n") + len("in JSON:\n") :])
    assert listing == [
        {"name": "get_weather", "description": WEATHER["function"]["description"], "parameters": WEATHER_PARAMS},
        {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    ]


# ---------------------------------------------------------------------------------------------------------
# history


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": [{"type": "text", "text": "14:"}, {"type": "text", "text": "5"}],
    },
    {"role": "assistant", "content": "18C and sunny; it is 14:5."},
    {"role": "user", "content": "Thanks"},
]


def test_history_messages_for_hf_templates():
    out = history_messages(HISTORY)
    assert out[:2] == HISTORY[:2] and out[5:] == HISTORY[5:]
    assert out[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "call_1"},
            {"type": "function", "function": {"name": "get_time", "arguments": {}}, "id": "call_2"},
        ],
    }
    assert out[3] == {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny", "name": "get_weather"}
    assert out[4] == {"role": "tool", "tool_call_id": "call_2", "content": "14:5", "name": "get_time"}
    assert history_messages(out) == out  # its own output is accepted as it is
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched


def with_message(i, msg):
    return [*HISTORY[:i], msg, *HISTORY[i + 1 :]]


def bad_call(**function):
    return {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": function}]}


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ("hi", "messages", "must be a list"),
        (["hi"], "messages.0", "must be an object"),
        (with_message(2, bad_call(name="f", arguments="{nope")), ARGS, "not valid JSON"),
        (with_message(2, bad_call(name="f", arguments="[1]")), ARGS, "JSON object"),
        (with_message(2, bad_call(name="f", arguments='{"a": NaN}')), ARGS, "JSON"),
        (with_message(2, bad_call(name="f", arguments=3)), ARGS, "JSON string"),
        (with_message(2, bad_call(arguments="{}")), "messages.2.tool_calls.0.function.name", "non-empty"),
        (with_message(2, {"role": "assistant", "tool_calls": {"a": 1}}), "messages.2.tool_calls", "must be a list"),
        (with_message(2, {"role": "assistant", "tool_calls": ["x"]}), "messages.2.tool_calls.0", "must be an object"),
        (with_message(3, {"role": "tool", "content": "x"}), "messages.3.tool_call_id", "tool_call_id"),
        (with_message(3, {"role": "tool", "tool_call_id": "c", "content": 3}), "messages.3.content", "string"),
        (
            with_message(3, {"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url"}]}),
            "messages.3.content.0",
            "text part",
        ),
    ],
)
def test_history_errors_name_the_field(messages, param, words):
    with pytest.raises(InvalidRequestError) as e:
        history_messages(messages)
    assert e.value.param == param and words in str(e.value)


def test_flatten_tool_history_for_templates_without_tool_roles():
    out = flatten_tool_history(HISTORY)
    assert out == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": '[get_weather(city="Paris"), get_time()]'},
        {"role": "user", "content": "Tool result (call_1): 18C, sunny\n\nTool result (call_2): 14:5"},
        {"role": "assistant", "content": "18C and sunny; it is 14:5."},
        {"role": "user", "content": "Thanks"},
    ]
    roles = [m["role"] for m in out[1:]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]  # Gemma's template insists roles alternate


def test_flattened_calls_read_back_as_the_same_calls():
    args = {"s": 'q"uo\\te\n é', "n": -3, "f": 2.5, "b": False, "z": None, "l": [1, {"k": True}], "d": {"x": []}}
    msg = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(args)}},
        {"id": "d", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]}  # fmt: skip
    [flat] = flatten_tool_history([msg])
    assert flat["content"].startswith("Checking.\n[f(")
    content, calls = PythonicParser().parse(flat["content"].split("\n", 1)[1])
    assert content is None and names_args(calls) == [("f", args), ("g", {})]
