"""Tool calls streamed as they decode: the function name first, then argument fragments.

Pure: no Ray, no HTTP. `required_progress(text)` and `markup_progress(text)` read the calls in a
choice's text so far (a forced call's JSON, or DeepSeek's markup after `<｜tool▁calls▁begin｜>`) as
`CallProgress` items: each call's name once it is known and the part of its arguments that can no
longer change (a prefix of the arguments the whole text will give). While a choice streams,
`RequiredScanner` and `chat_format.MarkupScanner` give the same readings incrementally.
`CallStream` turns successive readings into OpenAI's streamed `tool_calls` deltas: a call's first
delta has its index, id, type and name (arguments ""), later ones only argument fragments. The
accumulated arguments of a call equal the whole text's, since every reading is a prefix of the
final one (`finish` sends the rest).

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
    """How many trailing characters of `text` could begin `marker` (held back while streaming): the
    longest proper prefix of `marker` that `text` ends with (only its last len(marker) - 1 are read)."""
    at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while at >= 0 and not marker.startswith(text[at:]):
        at = text.find(marker[0], at + 1)
    return len(text) - at if at >= 0 else 0


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


_STRING_SPECIAL = re.compile(r'["\\]')  # what ends a run of ordinary characters in a JSON string
_CONTAINER_SPECIAL = re.compile(r'["{}\[\]]')  # ... in a container, outside its strings
_LITERAL_END = re.compile(r"[,}\] \t\n\r]")  # what ends a number or a literal


class RequiredScanner:
    """`required_progress`, incrementally: `feed` reads only the new text, each character once
    (runs of ordinary characters a regex search at a time), so parsing a stream costs time linear
    in its length, not quadratic. After each feed, `calls()` equals `required_progress` of all the
    text fed so far (where that does not raise); arguments are kept as fragments, and
    `take_changes` hands over what changed since it was last called. `scanned` counts the
    characters read (each delta's work is bounded by the delta)."""

    def __init__(self):
        self._calls: list[_ScannedCall] = []
        self._state = "start"
        self._key: list[str] = []  # the member key being read (raw JSON text)
        self._current_key: str | None = None
        self._kind = ""  # the value being read: "string", "container", "literal"
        self._escape = False  # (in a string: the last character was a backslash)
        self._in_string = False  # (in a container: inside one of its strings)
        self._depth = 0
        self._name: list[str] = []  # a "name" value's raw text so far
        self._changed: dict[int, list[str]] = {}  # call -> argument fragments since take_changes
        self._reset: set[int] = set()  # calls whose arguments restarted (a repeated "parameters")
        self.scanned = 0

    def calls(self) -> list[CallProgress]:
        return [CallProgress(c.name, "".join(c.fragments), c.done) for c in self._calls]

    def __len__(self) -> int:
        return len(self._calls)

    def name(self, i: int) -> str | None:
        return self._calls[i].name

    def arguments(self, i: int) -> str:
        """Call i's arguments so far (joined once, kept joined)."""
        fragments = self._calls[i].fragments
        if len(fragments) > 1:
            fragments[:] = ["".join(fragments)]
        return fragments[0] if fragments else ""

    def take_changes(self) -> tuple[dict[int, list[str]], set[int]]:
        """(call -> argument fragments added, calls whose arguments restarted) since the last call."""
        changed, reset = self._changed, self._reset
        self._changed, self._reset = {}, set()
        return changed, reset

    def feed(self, text: str) -> None:
        self.scanned += len(text)
        i, n = 0, len(text)
        while i < n and self._state != "stuck":
            i = self._step(text, i, n)

    def _args(self, fragment: str) -> None:
        if fragment:
            index = len(self._calls) - 1
            self._calls[index].fragments.append(fragment)
            self._changed.setdefault(index, []).append(fragment)

    def _value_part(self, fragment: str) -> None:
        if self._current_key == "parameters":
            self._args(fragment)
        elif self._current_key == "name":
            self._name.append(fragment)

    def _value_done(self) -> None:
        if self._current_key == "name":
            try:
                self._calls[-1].name = json.loads("".join(self._name))
            except ValueError:  # (required_progress would raise: this reading stops here)
                self._state = "stuck"
                return
        self._state = "member"

    def _step(self, text: str, i: int, n: int) -> int:  # noqa: C901 (one state machine)
        state, c = self._state, text[i]
        if state in ("start", "item", "member", "colon", "value_start", "after_object") and c in _WS:
            return i + 1
        if state == "start":
            self._state = "item" if c == "[" else "stuck"
            return i + 1
        if state == "after_object":
            if c == ",":
                self._state = "item"
                return i + 1
            state = self._state = "item"
        if state == "item":
            if c != "{":
                self._state = "stuck"
                return i
            self._calls.append(_ScannedCall())
            self._state = "member"
            return i + 1
        if state == "member":
            if c == "}":
                call = self._calls[-1]
                call.done = call.name is not None and call.seen_args
                self._state = "after_object"
            elif c == '"':
                self._key, self._escape, self._state = ['"'], False, "key"
            elif c != ",":
                self._state = "stuck"
            return i + 1
        if state == "key":
            j = self._string_run(text, i, n, self._key.append)
            if j < 0:
                return n
            try:
                self._current_key = json.loads("".join(self._key))
            except ValueError:
                self._state = "stuck"
                return j
            self._state = "colon"
            return j
        if state == "colon":
            self._state = "value_start" if c == ":" else "stuck"
            if c == ":" and self._current_key == "parameters":  # (an empty prefix already counts)
                call = self._calls[-1]
                call.seen_args = True
                if call.fragments:  # a repeated "parameters": its arguments start again
                    call.fragments.clear()
                    self._reset.add(len(self._calls) - 1)
                    self._changed.pop(len(self._calls) - 1, None)
            return i + 1
        if state == "value_start":
            self._name = []
            self._escape = self._in_string = False
            self._kind = "string" if c == '"' else "container" if c in "{[" else "literal"
            self._depth = 0
            self._state = "value"
            if self._kind == "string":
                self._value_part(c)
                return i + 1
            return i  # (a container's opening bracket is counted by the container scan)
        if state == "value":
            if self._kind == "string":
                j = self._string_run(text, i, n, self._value_part)
                if j < 0:
                    return n
                self._value_done()
                return j
            if self._kind == "container":
                return self._container_run(text, i, n)
            m = _LITERAL_END.search(text, i)
            end = n if m is None else m.start()
            self._value_part(text[i:end])
            if m is not None:
                self._value_done()  # (the delimiter is read again, as a member's)
            return end
        raise AssertionError(state)

    def _string_run(self, text: str, i: int, n: int, sink) -> int:
        """Read a JSON string's characters from text[i] into `sink` (its closing quote too): the
        index after it, or -1 if the text ends first."""
        while i < n:
            if self._escape:
                sink(text[i])
                self._escape = False
                i += 1
                continue
            m = _STRING_SPECIAL.search(text, i)
            if m is None:
                sink(text[i:])
                return -1
            j = m.start()
            sink(text[i : j + 1])
            if text[j] == '"':
                return j + 1
            self._escape = True
            i = j + 1
        return -1

    def _container_run(self, text: str, i: int, n: int) -> int:
        start = i
        while i < n:
            if self._in_string:
                if self._escape:
                    self._escape, i = False, i + 1
                    continue
                m = _STRING_SPECIAL.search(text, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                if text[j] == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                i = j + 1
                continue
            m = _CONTAINER_SPECIAL.search(text, i)
            if m is None:
                i = n
                break
            j, c = m.start(), text[m.start()]
            i = j + 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._value_part(text[start:i])
                    self._value_done()
                    return i
        self._value_part(text[start:i])
        return i


@dataclass
class _ScannedCall:
    name: str | None = None
    fragments: list[str] = field(default_factory=list)
    seen_args: bool = False
    done: bool = False


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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallStream:
    """What has been sent of each call: turns readings into deltas."""

    ids: list[str] = field(default_factory=list)  # per call announced, its id
    _sent: list[list[str]] = field(default_factory=list)  # per call announced, the argument fragments sent
    _diverged: set[int] = field(default_factory=set)  # calls whose arguments restarted (not streamed on)

    def sent(self, i: int) -> str:
        """The arguments sent of call i (joined once, kept joined)."""
        fragments = self._sent[i]
        if len(fragments) > 1:
            fragments[:] = ["".join(fragments)]
        return fragments[0] if fragments else ""

    def _announce(self, out: list[dict], name: str) -> int:
        i = len(self.ids)
        self.ids.append(new_call_id())
        self._sent.append([])
        out.append({"index": i, "id": self.ids[i], "type": "function",
                    "function": {"name": name, "arguments": ""}})  # fmt: skip
        return i

    def _send(self, out: list[dict], i: int, more: str) -> None:
        self._sent[i].append(more)
        if out and out[-1]["index"] == i and "id" in out[-1]:
            out[-1]["function"]["arguments"] += more
        else:
            out.append({"index": i, "function": {"arguments": more}})

    def deltas(self, calls: list[CallProgress]) -> list[dict]:
        """Deltas that bring the client up to `calls` (names first, then argument fragments)."""
        out: list[dict] = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                if call.name is None:
                    break
                self._announce(out, call.name)
            sent = self.sent(i)
            more = call.arguments[len(sent) :] if call.arguments.startswith(sent) else ""
            if more:
                self._send(out, i, more)
        return out

    def scanned_deltas(self, scanner: RequiredScanner, limit: int) -> list[dict]:
        """The deltas for what `scanner` read since the last call (of its first `limit` calls), in
        the order `deltas` would give them; the work is bounded by what changed, not by the text
        so far. (A call whose "parameters" came again, which no schema-constrained output does,
        streams no more arguments: `finish` sends what the whole text gives.)"""
        changed, reset = scanner.take_changes()
        self._diverged |= {i for i in reset if i < len(self.ids)}
        out: list[dict] = []
        for i in sorted(changed):
            if i < len(self.ids) and i < limit and i not in self._diverged:
                self._send(out, i, "".join(changed[i]))
        while len(self.ids) < min(len(scanner), limit):
            name = scanner.name(len(self.ids))
            if name is None:
                break
            i = self._announce(out, name)
            arguments = scanner.arguments(i)
            if arguments:
                self._send(out, i, arguments)
        return out

    def markup_deltas(
        self, calls: list, changed: dict[int, list[str]], done: set[int], limit: int
    ) -> list[dict]:
        """The deltas for what a `chat_format.MarkupScanner` read since the last call (`calls`: its
        calls; `changed`, `done`: its `take_changes()`), of its first `limit` calls: the same as
        `deltas(markup_progress(all the text)[:limit])` gives; the work is bounded by what changed.
        An open call's new fragments extend what was sent (its arguments only grow); a completed
        call sends the rest of its final arguments if they extend what was sent."""
        new = range(len(self.ids), min(len(calls), limit))
        out: list[dict] = []
        for i in sorted(set(changed) | done | set(new)):
            if i >= limit:
                continue
            call = calls[i]
            if i == len(self.ids):
                self._announce(out, call.name)
                more = call.arguments()
            elif i in done:
                sent, final = self.sent(i), call.arguments()
                more = final[len(sent) :] if final.startswith(sent) else ""
            else:
                more = "".join(changed[i])
            if more:
                self._send(out, i, more)
        return out

    def named_deltas(self, name: str, text: str) -> list[dict]:
        """A named call's deltas for its next `text` (the arguments, as they come)."""
        out: list[dict] = []
        if not self.ids:
            self._announce(out, name)
        if text:
            self._send(out, 0, text)
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
