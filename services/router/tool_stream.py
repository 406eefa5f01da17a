"""Tool calls streamed as they decode: the function name first, then argument fragments.

Pure: no Ray, no HTTP. `progress(mode, text)` reads the calls in a choice's text so far (a forced
call's JSON, or DeepSeek's markup after `<｜tool▁calls▁begin｜>`) as `CallProgress` items: each
call's name once it is known and the part of its arguments that can no longer change (a prefix
of the arguments the whole text will give). `CallStream` turns successive readings into OpenAI's
streamed `tool_calls` deltas: a call's first delta has its index, id, type and name (arguments
""), later ones only argument fragments. The accumulated arguments of a call equal the whole
text's, since every reading is a prefix of the final one (`finish` sends the rest).

The three forms (`chat_format.ChatParser` holds the text back from content and feeds it here):
- named: the text is the function's arguments, whole;
- required: a JSON array of {"name", "parameters"}; the arguments are the raw text of each
  "parameters" value (as the model wrote it: no re-serialisation);
- auto: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (V3.1) or
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>` (V3),
  the arguments stripped of surrounding whitespace; partial end markers are held back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_SEP) + r"(.*?)" + re.escape(CALL_END), re.S
)
_V3_ARGS = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.S)
V3_FENCE_END = "\n```"
_V3_HEAD = re.compile(r"([^\n]+)\n(```(?:json)?\n)?")
_WS = " \t\n\r"


@dataclass
class CallProgress:
    name: str | None  # None until the whole name is known
    arguments: str  # a prefix of the final arguments (all of them once `done`)
    done: bool = False


def held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---- required: a JSON array of {"name", "parameters"} ------------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at text[i], or None if the text ends first."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: up to a delimiter (the text's end may still extend it)
    while j < len(text) and text[j] not in ",}] \t\n\r":
        j += 1
    return j if j < len(text) else None


def required_progress(text: str) -> list[CallProgress]:
    """The calls of a (partial) JSON array of {"name": ..., "parameters": {...}} objects."""
    calls: list[CallProgress] = []
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] != "{":
            return calls
        call = CallProgress(None, "")
        calls.append(call)
        i += 1
        seen_args = False
        while True:
            i = _skip_ws(text, i)
            if i >= len(text):
                return calls
            if text[i] == "}":
                call.done = call.name is not None and seen_args
                i += 1
                break
            if text[i] == ",":
                i += 1
                continue
            key_end = _value_end(text, i)
            if key_end is None or text[i] != '"':
                return calls
            key = json.loads(text[i:key_end])
            i = _skip_ws(text, key_end)
            if i >= len(text) or text[i] != ":":
                return calls
            start = _skip_ws(text, i + 1)
            end = _value_end(text, start)
            if key == "parameters":
                seen_args = True
                call.arguments = text[start:] if end is None else text[start:end]
            elif key == "name" and end is not None:
                call.name = json.loads(text[start:end])
            if end is None:
                return calls
            i = end
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1


# ---- auto: DeepSeek's markup ---------------------------------------------------------------------
def _safe(raw: str, end_marker: str) -> str:
    """Arguments so far that the final (stripped, cut at the end marker) arguments start with."""
    raw = raw.lstrip(_WS)
    cut = raw.rfind(end_marker) if end_marker == V3_FENCE_END else -1
    raw = raw[:cut] if cut >= 0 else raw[: len(raw) - held(raw, end_marker)]
    return raw.rstrip(_WS)


def tool_call(name: str, arguments: str, index: int) -> dict:
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def parse_deepseek_calls(text: str) -> list[dict]:
    """DeepSeek's tool-call markup (V3 or V3.1 variant), whole -> OpenAI tool calls (with `index`)."""
    calls = []
    for kind, rest in _CALL.findall(text):
        v3 = _V3_ARGS.fullmatch(rest)
        name, args = (v3.group(1), v3.group(2)) if v3 and kind.strip() == "function" else (kind, rest)
        calls.append(tool_call(name.strip(), args.strip(), len(calls)))
    return calls


def markup_progress(text: str) -> list[CallProgress]:
    """The calls in DeepSeek's tool-call markup so far (`text` from the calls' begin marker)."""
    calls: list[CallProgress] = []
    at = 0
    while (begin := text.find(CALL_BEGIN, at)) >= 0:
        end = text.find(CALL_END, begin)
        if end >= 0:
            whole = parse_deepseek_calls(text[begin : end + len(CALL_END)])
            if whole:
                calls.append(
                    CallProgress(whole[0]["function"]["name"], whole[0]["function"]["arguments"], True)
                )
            at = end + len(CALL_END)
            continue
        rest = text[begin + len(CALL_BEGIN) :]
        sep = rest.find(CALL_SEP)
        if sep < 0:
            break
        kind, body = rest[:sep], rest[sep + len(CALL_SEP) :]
        if kind.strip() != "function":  # V3.1: the name is the kind
            calls.append(CallProgress(kind.strip(), _safe(body, CALL_END)))
            break
        head = _V3_HEAD.match(body)
        if head is not None:  # V3: the name line, then the arguments' fence
            args = _safe(body[head.end() :], V3_FENCE_END) if head.group(2) else ""
            calls.append(CallProgress(head.group(1).strip(), args))
        break
    return calls


def progress(mode: str, text: str, name: str | None = None) -> list[CallProgress]:
    """Calls so far of a choice whose tool mode is `mode` ("named": the function `name`)."""
    if mode == "named":
        return [CallProgress(name, text)]
    if mode == "required":
        return required_progress(text)
    return markup_progress(text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallStream:
    """What has been sent of each call: turns readings into deltas."""

    ids: list[str] = field(default_factory=list)  # per call announced, its id
    sent: list[str] = field(default_factory=list)  # per call announced, the arguments sent

    def deltas(self, calls: list[CallProgress]) -> list[dict]:
        """Deltas that bring the client up to `calls` (names first, then argument fragments)."""
        out = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id())
                self.sent.append("")
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})  # fmt: skip
            more = call.arguments[len(self.sent[i]) :] if call.arguments.startswith(self.sent[i]) else ""
            if more:
                self.sent[i] += more
                if out and out[-1]["index"] == i and "id" in out[-1]:
                    out[-1]["function"]["arguments"] += more
                else:
                    out.append({"index": i, "function": {"arguments": more}})
        return out

    @property
    def started(self) -> bool:
        return bool(self.ids)


def merge(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas accumulated into whole calls (as a client does)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]
