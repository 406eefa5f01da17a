"""DeepSeek's chat output format: `<think>` reasoning, tool calls, and what tools constrain.

Pure: no Ray, no HTTP. The router turns a chat request's `tools` / `tool_choice` /
`response_format` into one JSON schema for the engine's grammar (`output_schema`), then splits
each choice's generated text into `reasoning_content`, `content` and `tool_calls`, whole or delta
by delta as it streams (`ChatParser`; `auto` tools' markup is read as it comes by `MarkupScanner`,
each delta once).

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
    _WS,
    CALL_BEGIN,
    CALL_END,
    CALL_SEP,
    CALLS_BEGIN,
    CALLS_END,
    V3_FENCE_END,
    CallProgress,
    CallStream,
    held,
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


# ---- auto: DeepSeek's markup, read incrementally -------------------------------------------------
class _Arguments:
    """`_safe`, incrementally: one call's arguments as its raw text (after V3.1's separator or V3's
    opening fence) comes in pieces. `feed(text)` -> what `_safe(all the text so far, end_marker)`
    now gives beyond what it gave before (it only grows). Held: leading whitespace (dropped), a
    trailing proper prefix of the end marker, trailing whitespace, and with V3's fence (cut at its
    last occurrence) the text from the last fence on."""

    def __init__(self, end_marker: str):
        self._marker = end_marker
        self._started = False  # (a non-blank character has come: leading whitespace is dropped)
        self._hold = ""  # a trailing proper prefix of the marker
        self._blank: list[str] = []  # trailing whitespace of the certain text
        self._after: list[str] | None = None  # (V3, once a fence has come) the text from the last one
        self._tail = ""  # ... and its last len(marker) - 1 characters

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip(_WS)
            if not text:
                return ""
            self._started = True
        if self._after is not None:
            return self._after_fence(text)
        text = self._hold + text
        cut = text.rfind(self._marker) if self._marker == V3_FENCE_END else -1
        if cut < 0:
            keep = held(text, self._marker)
            self._hold = text[len(text) - keep :]
            return self._certain(text[: len(text) - keep])
        self._hold, self._after, self._tail = "", [text[cut:]], text[1 - len(self._marker) :]
        return self._certain(text[:cut])

    def _after_fence(self, text: str) -> str:
        window = self._tail + text  # (a later fence ends in `text`)
        cut = window.rfind(self._marker)
        self._tail = window[1 - len(self._marker) :]
        if cut < 0:
            self._after.append(text)
            return ""
        after = "".join(self._after) + text  # (joined only when a fence comes; what precedes it leaves)
        cut += len(after) - len(window)
        self._after = [after[cut:]]
        return self._certain(after[:cut])

    def _certain(self, text: str) -> str:
        """`text`: the next raw text known to lie before the cut -> what the arguments gain (its
        trailing whitespace is held until something else follows)."""
        body = text.rstrip(_WS)
        if not body:
            self._blank.append(text)
            return ""
        out = "".join(self._blank) + body
        self._blank = [text[len(body) :]]
        return out


@dataclass
class _MarkupCall:
    name: str
    fragments: list[str] = field(default_factory=list)  # its arguments (all of them once `done`)
    done: bool = False

    def arguments(self) -> str:
        """The arguments so far (joined once, kept joined)."""
        if len(self.fragments) > 1:
            self.fragments[:] = ["".join(self.fragments)]
        return self.fragments[0] if self.fragments else ""


_LOOK = max(len(CALL_BEGIN), len(CALL_END), len(CALL_SEP)) - 1  # (a marker may begin this far back)


class MarkupScanner:
    """`markup_progress`, incrementally (auto tools: DeepSeek's markup). `feed(text)` takes the
    calls' text piece by piece (from `<｜tool▁calls▁begin｜>` on) and reads each piece once, with
    the last few characters before it (where a marker may begin): parsing a stream costs time
    linear in its length. After each feed, `calls` (name, argument fragments, done) equals
    `markup_progress` of all the text fed so far; `take_changes` hands over what changed since it
    was last called; `text()` is all of it (for the whole parse at finish).

    A call's states: "head" (after `<｜tool▁call▁begin｜>`, up to `<｜tool▁sep｜>`), then V3.1's
    "args", or V3's "name" (to the line's end), "fence" (```json), "args"; "idle" where V3's head
    does not match. Any `<｜tool▁call▁end｜>` completes the call: its text is parsed whole
    (`parse_deepseek_calls`), then "between" calls, waiting for the next begin marker."""

    def __init__(self):
        self.calls: list[_MarkupCall] = []
        self.scanned = 0  # characters fed
        self._text: list[str] = []
        self._look = ""  # the last _LOOK characters fed
        self._state, self._since = "between", 0  # the state and where (a position in the text) it began
        self._body = 0  # where the current call's text after its begin marker starts
        self._segment: list[str] = []  # ... that text, up to this feed's
        self._open = False  # the current call is in `calls` (its name is known)
        self._fence = ""  # V3's opening fence so far
        self._args: _Arguments | None = None
        self._changed: dict[int, list[str]] = {}  # call -> argument fragments since take_changes
        self._done: set[int] = set()  # calls completed since take_changes

    def text(self) -> str:
        """All the text fed (joined once, kept joined)."""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def take_changes(self) -> tuple[dict[int, list[str]], set[int]]:
        """(call -> argument fragments added, calls completed) since the last call."""
        changed, done = self._changed, self._done
        self._changed, self._done = {}, set()
        return changed, done

    def feed(self, text: str) -> None:
        """Read the calls' next `text`: `calls` and the changes grow to match all the text so far."""
        window, base = self._look + text, self.scanned - len(self._look)  # window[k]: position base + k
        self.scanned += len(text)
        self._text.append(text)
        i = 0
        while True:
            if self._state == "between":
                begin = window.find(CALL_BEGIN, max(i, self._since - base))
                if begin < 0:
                    break
                i = begin + len(CALL_BEGIN)
                self._body, self._segment, self._open, self._fence, self._args = base + i, [], False, "", None
                self._state, self._since = "head", base + i
                continue
            body = max(self._body - base, len(self._look))  # (the call's text in this feed's)
            end = window.find(CALL_END, max(i, self._body - base))
            if end < 0:
                self._segment.append(window[body:])
                self._step(window, base)
                break
            i = end + len(CALL_END)
            self._complete(CALL_BEGIN + "".join(self._segment) + window[body:i])
            self._state, self._since = "between", base + i
        self._look = window[-_LOOK:]

    def _step(self, window: str, base: int) -> None:
        """Read the current call's new text (window[len(self._look):], no end marker in it)."""
        while True:
            start = max(self._since - base, len(self._look))
            if self._state == "head":
                sep = window.find(CALL_SEP, max(self._since - base, 0))
                if sep < 0:
                    return
                kind = self._text_to(base + sep)
                self._since = base + sep + len(CALL_SEP)
                if kind.strip() == "function":
                    self._state = "name"
                else:  # V3.1: the name is the kind
                    self._call(kind.strip(), CALL_END)
            elif self._state == "name":
                end = window.find("\n", start)
                if end < 0:
                    return
                line = self._text_to(base + end)[self._since - self._body :]
                self._state, self._since = ("fence" if line else "idle"), base + end + 1
                if line:
                    self._call(line.strip(), None)
            elif self._state == "fence":
                self._fence += window[start : start + 8 - len(self._fence)]
                if self._fence.startswith(("```json\n", "```\n")):
                    self._since += 8 if self._fence.startswith("```json\n") else 4
                    self._args, self._state = _Arguments(V3_FENCE_END), "args"
                elif not "```json\n".startswith(self._fence) and not "```\n".startswith(self._fence):
                    self._state = "idle"
                else:
                    return
            elif self._state == "args":
                more = self._args.feed(window[start:])
                if more:
                    self.calls[-1].fragments.append(more)
                    self._changed.setdefault(len(self.calls) - 1, []).append(more)
                return
            else:  # idle: V3's head did not match; the arguments stay "" until the end marker
                return

    def _text_to(self, at: int) -> str:
        """The current call's text from its begin marker's end to position `at` (joined once)."""
        self._segment[:] = ["".join(self._segment)]
        return self._segment[0][: at - self._body]

    def _call(self, name: str, end_marker: str | None) -> None:
        self.calls.append(_MarkupCall(name))
        self._open = True
        if end_marker is not None:
            self._args, self._state = _Arguments(end_marker), "args"

    def _complete(self, whole: str) -> None:
        """The current call's whole text (begin marker to end marker) has come: its final reading."""
        parsed = parse_deepseek_calls(whole)
        if not parsed:  # (no separator: not a call; only a call with one was opened)
            return
        if not self._open:
            self.calls.append(_MarkupCall(""))
        call = self.calls[-1]
        call.name, call.fragments[:], call.done = parsed[0]["function"]["name"], [], True
        if parsed[0]["function"]["arguments"]:
            call.fragments.append(parsed[0]["function"]["arguments"])
        self._done.add(len(self.calls) - 1)
        self._changed.pop(len(self.calls) - 1, None)


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
    _pending: str = ""  # text not yet classified (a possible prefix of a marker)
    _started: bool = False
    _in_calls: bool = False
    _stream: CallStream = field(default_factory=CallStream)  # what the client has of the calls
    # a forced call's text as it came (joined at finish) and its incremental reading (required):
    # each delta's work is bounded by the delta, not by the text so far
    _forced: list[str] = field(default_factory=list)
    _scanner: tool_stream.RequiredScanner = field(default_factory=tool_stream.RequiredScanner)
    # auto: the calls' text from `<｜tool▁calls▁begin｜>` on, read as it comes (and kept for finish)
    _markup: MarkupScanner = field(default_factory=MarkupScanner)

    def feed(self, text: str) -> dict:
        """The delta fields ({"reasoning_content", "content"}) to send for the new `text`."""
        if self._forced:  # (a forced call's text has started: all the rest is its)
            return self._with_forced(text, {})
        if self._in_calls:  # (auto tools' markup has started: likewise)
            return self._with_markup(text, {})
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
                keep = held(buf, THINK_END)
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
        markup = ""
        if self.tools.mode == "auto":
            begin = buf.find(CALLS_BEGIN)
            if begin >= 0:
                self._in_calls, self._pending = True, ""
                buf, markup = buf[:begin], buf[begin:]
            else:
                keep = held(buf, CALLS_BEGIN)
                buf, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        else:
            self._pending = ""
        if buf:
            delta["content"] = buf
        if self._in_calls:
            self._with_markup(markup, delta)
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

    def _with_markup(self, text: str, delta: dict) -> dict:
        """`delta` with the tool-call deltas of the markup's next `text` (auto tools)."""
        self._markup.feed(text)
        limit = len(self._markup.calls) if self.tools.parallel else 1
        calls = self._stream.markup_deltas(self._markup.calls, *self._markup.take_changes(), limit)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last delta (held-back text, or what is left of the tool calls) and the choice's
        finish reason."""
        rest, self._pending = "".join(self._forced) + self._markup.text() + self._pending, ""
        self._forced, self._markup = [], MarkupScanner()
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
