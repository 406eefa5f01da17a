"""The Responses API's pure parts (router/responses.py): request translation, refusals by name,
and the stream's events: items announced empty, each delta sent once, statuses at the end."""

import json

import pytest

from services.router.protocol import APIError
from services.router.responses import ResponseEvents, ResponsesRequest, output_items


def _req(**kw):
    return ResponsesRequest(model="m", input=kw.pop("input", "hi"), **kw)


def test_stream_events_announce_items_empty_and_send_each_delta_once():
    events = ResponseEvents(_req(), "resp_1")
    out = [*events.start()]
    out += events.feed({"reasoning_content": "think"})
    out += events.feed({"content": "Hello"})
    out += events.feed({"content": " you", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{"}}]})  # fmt: skip
    out += events.feed({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]})
    out += events.finish("stop", {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                  "prompt_tokens_details": {"cached_tokens": 0}})  # fmt: skip
    out = json.loads(json.dumps(out))  # (as sent: nothing changes an event after it is built)
    added = [e["item"] for e in out if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["reasoning", "message", "function_call"]
    assert added[0]["content"] == [] and added[1]["content"] == [] and added[2]["arguments"] == ""
    deltas = "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta")
    assert deltas == "Hello you"
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert out[-1]["type"] == "response.completed" and final["status"] == "completed"
    message = next(i for i in final["output"] if i["type"] == "message")
    assert message["content"][0]["text"] == "Hello you" and message["status"] == "completed"
    assert next(i for i in final["output"] if i["type"] == "function_call")["arguments"] == "{}"
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["output_tokens"] == 5


def test_cut_short_is_incomplete_everywhere():
    events = ResponseEvents(_req(), "resp_2")
    events.start()
    events.feed({"content": "Hel"})
    last = events.finish("length", {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                    "prompt_tokens_details": {"cached_tokens": 0}})  # fmt: skip
    assert last[-1]["type"] == "response.incomplete"
    assert last[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert all(i["status"] == "incomplete" for i in last[-1]["response"]["output"])
    assert output_items({"content": "x"}, "length")[0]["status"] == "incomplete"


def test_input_items_become_chat_turns():
    chat = _req(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ], tools=[{"type": "function", "name": "get", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get"}).to_chat()  # fmt: skip
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[2].tool_calls] == ["c1", "c2"]
    assert chat.tools == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get"}}


@pytest.mark.parametrize("field, value", [("previous_response_id", "r"), ("store", True), ("background", True),
                                          ("truncation", "auto")])  # fmt: skip
def test_stored_state_is_refused_by_name(field, value):
    with pytest.raises(APIError) as e:
        _req(**{field: value}).to_chat()
    assert e.value.param == field
