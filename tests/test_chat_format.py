"""DeepSeek's chat output format: tools -> schemas, reasoning / content / tool-call splitting,
whole and streamed (pure: no cluster)."""

import json

import pytest

from services.router.chat_format import (
    CALL_BEGIN,
    CALL_END,
    CALL_SEP,
    CALLS_BEGIN,
    CALLS_END,
    ChatParser,
    ToolChoice,
    ToolsError,
    output_schema,
    parse_deepseek_calls,
    response_schema,
)
from services.router.tool_stream import merge, required_progress

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_modes():
    assert ToolChoice.parse(None, None).mode == "none"
    assert ToolChoice.parse([WEATHER], None).mode == "auto"
    assert ToolChoice.parse([WEATHER], "none").template_tools() is None
    named = ToolChoice.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.schema() == {"type": "object"}  # no parameters: any object
    required = ToolChoice.parse([WEATHER, TIME], "required").schema()
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert required["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function"}], None, "tools"),
        ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
        ([{"type": "function", "function": {"name": "x", "parameters": []}}], None, "tools"),
        (None, "required", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_are_refused_by_field(tools, choice, param):
    with pytest.raises(ToolsError) as e:
        ToolChoice.parse(tools, choice)
    assert e.value.param == param


def test_response_format_schemas():
    assert response_schema(None) is None and response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_object"}) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == schema
    for bad in (
        {"type": "json_schema"},
        {"type": "yaml"},
        {"type": "json_schema", "json_schema": {"schema": 1}},
    ):
        with pytest.raises(ToolsError):
            response_schema(bad)
    with pytest.raises(ToolsError):  # a forced call and a response format at once
        output_schema({"type": "json_object"}, ToolChoice.parse([WEATHER], "required"))
    assert output_schema({"type": "json_object"}, ToolChoice.parse([WEATHER], "auto")) == {"type": "object"}


def test_parse_deepseek_calls_both_variants():
    v3 = (f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{CALL_END}\n"
          f"{CALL_BEGIN}function{CALL_SEP}get_time\n```json\n{{}}\n```{CALL_END}{CALLS_END}")  # fmt: skip
    calls = parse_deepseek_calls(v3)
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "get_time", "{}"),
    ]
    v31 = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}'
    assert parse_deepseek_calls(v31)[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def _stream(parser: ChatParser, text: str, cut: int, reason: str = "stop"):
    """Feed `text` in pieces of `cut` characters; the merged deltas and the finish reason."""
    merged: dict = {}
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)] or [""]
    for i, piece in enumerate(pieces):
        deltas = [parser.feed(piece)]
        if i == len(pieces) - 1:
            last, reason = parser.finish(reason)
            deltas.append(last)
        for d in deltas:
            for k, v in d.items():
                merged[k] = merged.get(k, "" if k != "tool_calls" else []) + v
    if "tool_calls" in merged:
        merged["tool_calls"] = merge(merged["tool_calls"])
    return merged, reason


AUTO_TEXT = (f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}get_weather\n```json\n"
             f'{{"city": "Rome"}}\n```{CALL_END}{CALLS_END}')  # fmt: skip


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_streamed_split_equals_whole(cut):
    auto = ToolChoice.parse([WEATHER], "auto")
    cases = [
        (ChatParser(), "plain <thin text", {"content": "plain <thin text"}, "stop"),
        (
            ChatParser(in_reasoning=True),
            "hmm, think</think>The answer.",
            {"reasoning_content": "hmm, think", "content": "The answer."},
            "stop",
        ),  # fmt: skip
        (
            ChatParser(),
            "<think>why</think>Because.",
            {"reasoning_content": "why", "content": "Because."},
            "stop",
        ),
        (
            ChatParser(in_reasoning=True),
            "still thinking <",
            {"reasoning_content": "still thinking <"},
            "stop",
        ),
        (ChatParser(auto), "No tools: <｜tool", {"content": "No tools: <｜tool"}, "stop"),
    ]
    for parser, text, want, want_reason in cases:
        assert _stream(parser, text, cut) == (want, want_reason), (text, cut)
    merged, reason = _stream(ChatParser(auto), AUTO_TEXT, cut)
    assert reason == "tool_calls" and merged["content"] == "Let me check."
    assert [c["function"] for c in merged["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    ]


def test_forced_calls_become_tool_calls():
    required = ChatParser(ToolChoice.parse([WEATHER, TIME], "required"))
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Lima"}}, {"name": "get_time", "parameters": {}}]
    )
    message, reason = required.message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [
        ("get_weather", {"city": "Lima"}),
        ("get_time", {}),
    ]
    assert "index" not in message["tool_calls"][0]  # only streamed deltas carry an index
    named = ChatParser(ToolChoice.parse([WEATHER], {"type": "function", "function": {"name": "get_weather"}}))
    message, reason = named.message('{"city": "Kyiv"}', "stop")
    assert reason == "stop"  # as OpenAI answers a named tool_choice
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Kyiv"}'}
    truncated = ChatParser(ToolChoice.parse([WEATHER], "required"))
    message, reason = truncated.message('[{"name": "get_wea', "length")
    assert reason == "length" and message == {"role": "assistant", "content": '[{"name": "get_wea'}


def test_required_calls_keep_each_tools_definitions():
    """A tool whose parameters use $defs (pydantic / zod schemas) keeps them under `required`."""
    from services.engine.grammar import check_json_schema

    nested = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
        "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}}  # fmt: skip
    schema = ToolChoice.parse([nested, WEATHER], "required").schema()
    check_json_schema(schema)
    assert schema["$defs"]["book"]["properties"]["who"] == {"$ref": "#/$defs/book/$defs/Person"}
    single = ToolChoice.parse([nested, WEATHER], "required", parallel=False).schema()
    assert single["maxItems"] == 1


def test_malformed_tool_choice_and_trailing_text():
    with pytest.raises(ToolsError):
        ToolChoice.parse([WEATHER], {"type": "function", "function": "get_weather"})
    auto = ToolChoice.parse([WEATHER], "auto", parallel=False)
    two = AUTO_TEXT.replace(
        CALLS_END, f"{CALL_BEGIN}function{CALL_SEP}get_weather\n```json\n{{}}\n```{CALL_END}{CALLS_END}"
    )
    message, reason = ChatParser(auto).message(two + " Done.", "stop")
    assert len(message["tool_calls"]) == 1 and message["content"] == "Let me check. Done."


V31_TEXT = f'Sure.{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_SEP} {{"city": "Oslo, ```x"}}\n{CALL_END}{CALL_BEGIN}get_time{CALL_SEP}{{}}{CALL_END}{CALLS_END}'
REQUIRED_TEXT = (
    '[ {"name": "get_weather", "parameters": {"city": "Li\\"ma}"} },{"parameters":{}, "name":"get_time"}]'
)


@pytest.mark.parametrize("cut", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    "choice, text",
    [
        ("auto", AUTO_TEXT),
        ("auto", V31_TEXT),
        ("required", REQUIRED_TEXT),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Kyiv", "days": [1, 2]}'),
    ],
)
def test_tool_calls_stream_name_first_then_arguments(cut, choice, text):
    """Streamed tool calls: each call's first delta names it (id, type, name, arguments ""), the
    arguments follow in fragments while they decode, and accumulated they equal the whole message's."""
    tools = ToolChoice.parse([WEATHER, TIME], choice)
    whole, whole_reason = ChatParser(tools).message(text, "stop")
    parser, deltas, content = ChatParser(tools), [], ""
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    for i, piece in enumerate(pieces):
        out = [parser.feed(piece)]
        if i == len(pieces) - 1:
            last, reason = parser.finish("stop")
            out.append(last)
        for d in out:
            deltas += [(i, c) for c in d.get("tool_calls", [])]
            content += d.get("content", "")
    firsts = {}
    for step, d in deltas:
        if d["index"] not in firsts:
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
            firsts[d["index"]] = step
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
    streamed = merge([d for _, d in deltas])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    assert reason == whole_reason and content == (whole["content"] or "")
    if cut == 1:  # the first call was named while its arguments were still decoding
        assert firsts[0] < len(pieces) - 1 and len([d for _, d in deltas if d["index"] == 0]) > 2


def test_required_arguments_are_the_raw_parameters_text():
    calls = required_progress(REQUIRED_TEXT)
    assert [(c.name, c.arguments, c.done) for c in calls] == [
        ("get_weather", '{"city": "Li\\"ma}"}', True),
        ("get_time", "{}", True),
    ]
    partial = required_progress('[{"name": "get_weather", "parameters": {"city": "Li')
    assert [(c.name, c.arguments, c.done) for c in partial] == [("get_weather", '{"city": "Li', False)]
    assert (
        required_progress('[{"name": "get_wea') == []
        or required_progress('[{"name": "get_wea')[0].name is None
    )
