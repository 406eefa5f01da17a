"""OpenAI's Responses API (`POST /v1/responses`) over the chat machinery.

Pure: no Ray, no HTTP. A `ResponsesRequest` becomes a `ChatCompletionRequest` (`to_chat`: `input`
text or items, `instructions` as the system turn, flat `tools`, `text.format`); the choice's
text is split by the same `ChatParser` and comes back as output items: `reasoning`, a `message`
with `output_text`, `function_call`s (`response_object`). Streamed, `ResponseEvents` turns the
parser's deltas into the API's events (response.created ... response.completed), tool-call
arguments included as they decode. State kept between requests (`previous_response_id`,
`store: true`, background runs) is not built: refused by name.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .protocol import APIError, ChatCompletionRequest, ChatMessage, now

UNSUPPORTED = {  # field -> why it is refused
    "previous_response_id": "previous_response_id needs stored responses, which this server does not keep",
    "conversation": "conversations need stored state, which this server does not keep",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not implement is refused, by name

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None  # (vLLM's extension, as in chat)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    truncation: str | None = None
    include: list[str] | None = None

    def check_unsupported(self) -> None:
        for name, why in UNSUPPORTED.items():
            if getattr(self, name) not in (None, False):
                raise APIError(400, why, param=name)
        if self.store:
            raise APIError(400, "store: true is not supported (responses are not kept); send store: false",
                           param="store")  # fmt: skip
        if self.truncation not in (None, "disabled"):
            raise APIError(400, "truncation 'auto' is not supported", param="truncation")

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (one choice)."""
        self.check_unsupported()
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        messages += input_messages(self.input)
        if not messages:
            raise APIError(400, "input is empty", param="input")
        fields = dict(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, stream=self.stream, seed=self.seed, tools=chat_tools(self.tools),
            tool_choice=chat_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format(self.text),
        )  # fmt: skip
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as e:
            err = e.errors()[0]
            raise APIError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}", param="input") from None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be text or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}: only input_text / output_text parts are supported", param="input")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: a text part needs text", param="input")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` as chat turns: text is one user turn; items are messages, function calls (runs of
    them one assistant turn with tool_calls) and their outputs (tool turns); reasoning items are
    dropped (the model does not see its earlier reasoning again)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400, f"{where}.role must be user, system, developer or assistant", param="input"
                )
            out.append(ChatMessage(role=role, content=_text(item.get("content"), where)))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise APIError(
                    400, f"{where}: a function_call needs call_id, name and arguments", param="input"
                )
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1].tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise APIError(
                    400, f"{where}: a function_call_output needs call_id and output (text)", param="input"
                )
            out.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=output))
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ({"type": "function", "function": {...}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


# ---- the response object ------------------------------------------------------------------------
def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def _reasoning_item(item_id: str, text: str) -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def output_items(message: dict, finish_reason: str | None = None) -> list[dict]:
    """A chat message (`ChatParser.message`) as Responses output items (cut short by the token
    limit: "incomplete" ones)."""
    status = "incomplete" if finish_reason == "length" else "completed"
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"], status))
    return items


def response_object(req: ResponsesRequest, response_id: str, created: int, output: list[dict],
                    finish_reason: str | None, usage: dict | None, status: str | None = None) -> dict:  # fmt: skip
    """The `response` object: `usage` is chat's ({prompt,completion}_tokens, cached tokens)."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": req.model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls, "text": req.text or {"format": {"type": "text"}},
        "previous_response_id": None, "store": False, "truncation": "disabled", "metadata": req.metadata or {},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }  # fmt: skip


# ---- streaming ------------------------------------------------------------------------------------
class ResponseEvents:
    """The Responses API's stream events from a chat parser's deltas: an output item opens when
    its kind of text first arrives (reasoning, the message's text, each function call), its
    deltas follow, and everything open is closed at `finish`."""

    def __init__(self, req: ResponsesRequest, response_id: str):
        self.req, self.id, self.created = req, response_id, now()
        self._seq = itertools.count()
        self.output: list[dict] = []  # the items so far (their text accumulating)
        self._open: dict[str, int] = {}  # "reasoning" / "message" / "call:<index>" -> output index

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(self._seq), **fields}

    def start(self) -> list[dict]:
        head = response_object(self.req, self.id, self.created, [], None, None, status="in_progress")
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
        ]

    def _add(self, key: str, item: dict) -> list[dict]:
        self._open[key] = len(self.output)
        self.output.append(item)
        # (as OpenAI: a message or reasoning item is announced empty, its parts and text follow;
        # the event gets its own copy, the item goes on filling)
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else dict(item)
        events = [self._event("response.output_item.added", output_index=self._open[key], item=shown)]
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._open[key],
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))  # fmt: skip
        return events

    def feed(self, delta: dict) -> list[dict]:
        """Events for one parser delta ({"reasoning_content", "content", "tool_calls"})."""
        events = []
        if delta.get("reasoning_content"):
            if "reasoning" not in self._open:
                events += self._add("reasoning", _reasoning_item(new_id("rs"), ""))
            at = self._open["reasoning"]
            self.output[at]["content"][0]["text"] += delta["reasoning_content"]
            events.append(self._event("response.reasoning_text.delta", item_id=self.output[at]["id"], output_index=at,
                                      content_index=0, delta=delta["reasoning_content"]))  # fmt: skip
        if delta.get("content"):
            if "message" not in self._open:
                events += self._add("message", _message_item(new_id("msg"), "", "in_progress"))
            at = self._open["message"]
            self.output[at]["content"][0]["text"] += delta["content"]
            events.append(self._event("response.output_text.delta", item_id=self.output[at]["id"], output_index=at,
                                      content_index=0, delta=delta["content"], logprobs=[]))  # fmt: skip
        for call in delta.get("tool_calls") or []:
            key = f"call:{call['index']}"
            if key not in self._open:
                fn = call["function"]
                events += self._add(key, _call_item(new_id("fc"), call["id"], fn["name"], "", "in_progress"))
            at = self._open[key]
            more = call["function"].get("arguments") or ""
            if more:
                self.output[at]["arguments"] += more
                events.append(self._event("response.function_call_arguments.delta", item_id=self.output[at]["id"],
                                          output_index=at, delta=more))  # fmt: skip
        return events

    def finish(self, finish_reason: str | None, usage: dict) -> list[dict]:
        """Close every open item, then response.completed (or .incomplete: items too)."""
        events, done = [], "incomplete" if finish_reason == "length" else "completed"
        for at, item in enumerate(self.output):
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=at,
                                          content_index=0, text=part["text"], logprobs=[]))  # fmt: skip
                events.append(self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                          content_index=0, part=part))  # fmt: skip
            elif item["type"] == "function_call":
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=at, arguments=item["arguments"], name=item["name"]))  # fmt: skip
            elif item["type"] == "reasoning":
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                          content_index=0, text=item["content"][0]["text"]))  # fmt: skip
            if "status" in item:
                item["status"] = done
            events.append(self._event("response.output_item.done", output_index=at, item=item))
        body = response_object(self.req, self.id, self.created, self.output, finish_reason, usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=body)]

    def failed(self, message: str) -> dict:
        body = response_object(self.req, self.id, self.created, self.output, None, None, status="failed")
        body["error"] = {"code": "server_error", "message": message}
        return self._event("response.failed", response=body)


def sse(event: dict) -> str:
    """One Server-Sent Event with its `event:` name, as OpenAI sends the Responses stream."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
