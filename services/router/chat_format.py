"""DeepSeek's chat output format: `<think>` reasoning, tool calls, and what tools constrain.

Pure: no Ray, no HTTP. The router turns a chat request's `tools` / `tool_choice` /
`response_format` into one JSON schema for the engine's grammar (`output_schema`), then splits
each choice's generated text into `reasoning_content`, `content` and `tool_calls`, whole or delta
by delta as it streams (`ChatParser`).

Tool calls, as vLLM does:
- `auto`: the model writes DeepSeek's own markup, parsed afterwards. Both variants are read:
  V3's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`
  and V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`, inside
  `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`.
- `required`: the output is constrained to a JSON array of {"name", "parameters"} objects, one
  of the tools each (at least one call).
- a named function: the output is constrained to that function's parameters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from . import tool_stream
from .tool_stream import (  # noqa: F401  (the markup's markers and parser: re-exported)
    CALL_BEGIN,
    CALL_END,
    CALL_SEP,
    CALLS_BEGIN,
    CALLS_END,
    CallProgress,
    CallStream,
    parse_deepseek_calls,
    tool_call,
)

THINK_BEGIN, THINK_END = "<think>", "</think>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ToolsError(ValueError):
    """An invalid tools / tool_choice / response_format combination (message, request field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools allow: mode none / auto / required / named (`name` set)."""

    mode: str = "none"
    tools: tuple[dict, ...] = ()  # each {"name", "description"?, "parameters"?}
    name: str | None = None
    parallel: bool = True  # several calls in one turn (OpenAI's parallel_tool_calls)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @classmethod
    def parse(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool = True) -> ToolChoice:
        """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` -> ToolChoice; raises ToolsError."""
        functions = []
        for i, tool in enumerate(tools or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
                raise ToolsError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ToolsError("tools", f"tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ . -")
            if not isinstance(params, dict):
                raise ToolsError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
            functions.append({"name": name, "description": fn.get("description") or "", "parameters": params})
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ToolsError("tools", "tool function names must be unique")
        if tool_choice is None:
            return cls("auto" if functions else "none", tuple(functions), parallel=parallel)
        if tool_choice in ("none", "auto", "required"):
            if tool_choice != "none" and not functions:
                raise ToolsError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
            return cls(tool_choice, tuple(functions), parallel=parallel)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if (
            not isinstance(tool_choice, dict)
            or tool_choice.get("type") != "function"
            or not isinstance(name, str)
        ):
            raise ToolsError(
                "tool_choice",
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            )
        if name not in names:
            raise ToolsError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        return cls("named", tuple(functions), name, parallel)

    def schema(self) -> dict | None:
        """The JSON schema a forced tool call decodes under (None unless forced)."""
        if self.mode == "named":
            return next(f["parameters"] for f in self.tools if f["name"] == self.name)
        if self.mode == "required":
            # each tool's parameters under $defs/<name>, its own "#..." references re-rooted there
            call = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      "parameters": {"$ref": f"#/$defs/{f['name']}"}},
                     "required": ["name", "parameters"], "additionalProperties": False} for f in self.tools]  # fmt: skip
            defs = {f["name"]: _rerooted(f["parameters"], f"#/$defs/{f['name']}") for f in self.tools}
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": call}, "$defs": defs}
            return calls if self.parallel else {**calls, "maxItems": 1}
        return None

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (None when the model is not to see them)."""
        if self.mode == "none":
            return None
        return [{"type": "function", "function": f} for f in self.tools]


def _rerooted(schema: Any, root: str) -> Any:
    """A copy of `schema` with its local `$ref`s ("#", "#/...") pointing below `root`."""
    if isinstance(schema, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rerooted(v, root))
                for k, v in schema.items()}  # fmt: skip
    if isinstance(schema, list):
        return [_rerooted(v, root) for v in schema]
    return schema


def response_schema(response_format: dict[str, Any] | None) -> dict | None:
    """OpenAI's `response_format` -> the JSON schema the output must follow (None for text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ToolsError(
                "response_format", "response_format json_schema needs json_schema.schema (an object)"
            )
        return schema
    raise ToolsError("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema'")


def output_schema(response_format: dict[str, Any] | None, tools: ToolChoice) -> dict | None:
    """The one schema a chat request decodes under: a forced tool call's or response_format's."""
    schema = response_schema(response_format)
    if schema is not None and tools.forced:
        raise ToolsError("response_format", "response_format cannot be combined with a forced tool_choice")
    return tools.schema() if tools.forced else schema


_held = tool_stream.held


@dataclass
class ChatParser:
    """Splits one choice's text into reasoning, content and tool calls as it arrives.

    `in_reasoning`: the prompt opened a `<think>` block (R1 / V3.1 thinking templates); the
    output also enters one when it starts with `<think>`. Text up to `</think>` is reasoning.
    Then: content, except that a forced tool call's text, and with `auto` tools the text from
    `<｜tool▁calls▁begin｜>` on, are tool calls: streamed as `tool_calls` deltas as they decode
    (the name first, then argument fragments: tool_stream.py), completed at `finish`.
    """

    tools: ToolChoice = field(default_factory=ToolChoice)
    in_reasoning: bool = False
    _pending: str = ""  # text not yet classified (a possible marker prefix, or the calls so far)
    _started: bool = False
    _in_calls: bool = False
    _stream: CallStream = field(default_factory=CallStream)  # what the client has of the calls
    # a forced call's text as it came (joined at finish) and its incremental reading (required):
    # each delta's work is bounded by the delta, not by the text so far
    _forced: list[str] = field(default_factory=list)
    _scanner: tool_stream.RequiredScanner = field(default_factory=tool_stream.RequiredScanner)

    def feed(self, text: str) -> dict:
        """The delta fields ({"reasoning_content", "content"}) to send for the new `text`."""
        if self._forced:  # (a forced call's text has started: all the rest is its)
            return self._with_forced(text, {})
        buf, delta = self._pending + text, {}
        if not self._started:
            if THINK_BEGIN.startswith(buf) and buf != THINK_BEGIN:
                self._pending = buf  # maybe the start of <think>
                return delta
            self._started = True
            if buf.startswith(THINK_BEGIN):
                buf, self.in_reasoning = buf[len(THINK_BEGIN) :], True
        if self.in_reasoning:
            end = buf.find(THINK_END)
            if end < 0:
                keep = _held(buf, THINK_END)
                self._pending = buf[len(buf) - keep :]
                if buf[: len(buf) - keep]:
                    delta["reasoning_content"] = buf[: len(buf) - keep]
                return delta
            if buf[:end]:
                delta["reasoning_content"] = buf[:end]
            buf, self.in_reasoning = buf[end + len(THINK_END) :], False
        if self.tools.forced:
            self._pending = ""
            return self._with_forced(buf, delta)
        if self._in_calls:
            self._pending = buf
            return self._with_calls(delta)
        if self.tools.mode == "auto":
            begin = buf.find(CALLS_BEGIN)
            if begin >= 0:
                self._in_calls, self._pending = True, buf[begin:]
                buf = buf[:begin]
            else:
                keep = _held(buf, CALLS_BEGIN)
                buf, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        else:
            self._pending = ""
        if buf:
            delta["content"] = buf
        if self._in_calls:
            self._with_calls(delta)
        return delta

    def _with_forced(self, text: str, delta: dict) -> dict:
        """`delta` with the tool-call deltas of a forced call's next `text`."""
        self._forced.append(text)
        if self.tools.mode == "named":
            calls = self._stream.named_deltas(self.tools.name, text)
        else:
            self._scanner.feed(text)
            calls = self._stream.scanned_deltas(
                self._scanner, len(self._scanner) if self.tools.parallel else 1
            )
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _with_calls(self, delta: dict) -> dict:
        """`delta` with the tool-call deltas the calls' text so far allows."""
        calls = tool_stream.progress(self.tools.mode, self._pending, self.tools.name)
        calls = self._stream.deltas(calls if self.tools.parallel else calls[:1])
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last delta (held-back text, or what is left of the tool calls) and the choice's
        finish reason."""
        rest, self._pending = "".join(self._forced) + self._pending, ""
        self._forced = []
        if self.in_reasoning:
            return ({"reasoning_content": rest} if rest else {}), finish_reason
        calls = self._calls(rest) if (self.tools.forced or self._in_calls) else None
        if calls is None or (not calls and not self._stream.started):
            # no calls, or nothing parseable and nothing sent (a truncated output): the text as it is
            return ({"content": rest} if rest else {}), finish_reason
        if not calls:  # truncated after some of it was streamed: the client has what there was
            return {}, finish_reason
        reason = finish_reason if self.tools.mode == "named" or finish_reason != "stop" else "tool_calls"
        last = self._stream.deltas(
            [CallProgress(c["function"]["name"], c["function"]["arguments"], True) for c in calls]
        )
        after = rest.split(CALLS_END, 1)[1] if self._in_calls and CALLS_END in rest else ""
        return ({"tool_calls": last} if last else {}) | ({"content": after} if after else {}), reason

    def _calls(self, text: str) -> list[dict]:
        """The whole text's calls (empty where it does not parse)."""
        if self.tools.mode == "named":
            return [tool_call(self.tools.name, text, 0)]
        if self.tools.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return []
            if not isinstance(items, list):
                return []
            # each call's arguments: the raw text of its "parameters" (what was streamed)
            return [
                tool_call(c.name, c.arguments, i) for i, c in enumerate(tool_stream.required_progress(text))
            ]
        calls = parse_deepseek_calls(text)
        return calls if self.tools.parallel else calls[:1]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole choice's message ({"role", "content", "reasoning_content"?, "tool_calls"?}) and
        its finish reason."""
        parts: dict[str, Any] = {}
        last, reason = self.finish_after(text, finish_reason)
        for d in last:
            for k, v in d.items():
                parts[k] = parts.get(k, "" if k != "tool_calls" else []) + v
        message = {"role": "assistant", "content": parts.get("content") or None}
        if "reasoning_content" in parts:
            message["reasoning_content"] = parts["reasoning_content"]
        if "tool_calls" in parts:  # (the same deltas a stream sends, accumulated)
            message["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in tool_stream.merge(parts["tool_calls"])
            ]
        elif message["content"] is None:
            message["content"] = ""
        return message, reason

    def finish_after(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """feed(text) then finish(): the deltas, in order, and the finish reason."""
        first = self.feed(text)
        last, reason = self.finish(finish_reason)
        return [first, last], reason
