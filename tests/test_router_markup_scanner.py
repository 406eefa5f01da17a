"""`auto` tool calls (DeepSeek's markup) stream in time linear in the output: `MarkupScanner` reads
each delta once, where the parser used to re-read the markup from its start on every delta.

The expected outcomes below are literals: what the previous (re-reading) implementation gave for
these outputs, streamed or whole. Split anywhere, the incremental reading gives the same; and
delta by delta it equals re-reading the whole text so far (`markup_progress`)."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.router import chat_format, tool_stream
from services.router.chat_format import ChatParser, MarkupScanner, ToolChoice
from services.router.tool_stream import CALL_BEGIN as CB
from services.router.tool_stream import CALL_END as CE
from services.router.tool_stream import CALL_SEP as SEP
from services.router.tool_stream import CALLS_BEGIN as CSB
from services.router.tool_stream import CALLS_END as CSE
from services.router.tool_stream import CallStream, markup_progress, merge

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]

# name -> (output, parallel_tool_calls, prompt opened <think>, finish reason), and what it reads as:
# (content, reasoning_content, [(call name, arguments)], finish reason)
WELL_FORMED = {
    "v3_one_call": (f'Let me check.{CSB}{CB}function{SEP}get_weather\n```json\n{{"city": "Rome", "note": "a ``` b"}}\n```{CE}{CSE}', True, False, "stop"),
    "v3_two_calls_then_text": (f'{CSB}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}\n{CB}function{SEP} get_time \n```\n{{}}\n```  \n{CE}{CSE} Done.', True, False, "stop"),
    "v31_two_calls": (f'Sure.{CSB}{CB}get_weather{SEP} {{"city": "Oslo, ```x", "pad": "  "}}\n{CE}{CB}get_time{SEP}{{}}{CE}{CSE}', True, False, "stop"),
    "whitespace_in_arguments": (f'{CSB}{CB}get_weather{SEP} \n\t {{"a":   1,\n   "b": "  "}}  \t \n{CE}{CB}function{SEP}get_time\n```json\n  {{ }}  \n\n```{CE}{CSE}', True, False, "stop"),
    "not_parallel": (f'{CSB}{CB}get_time{SEP}{{"tz": "UTC"}}{CE}{CB}get_weather{SEP}{{"city": "Rome"}}{CE}{CSE}', False, False, "stop"),
    "reasoning_then_call": (f"thinking <｜tool about </thin it</think>Ok.{CSB}{CB}get_time{SEP}{{}}{CE}{CSE}", True, True, "stop"),
    "think_tag_then_call": (f'<think>hmm</think>{CSB}{CB}function{SEP}get_time\n```json\n{{"tz": "UTC"}}\n```{CE}{CSE}', True, False, "stop"),
    "marker_prefixes_in_content": (f'a <｜tool b <｜tool▁calls c <{CSB}{CB}get_time{SEP}{{"x": "<｜tool▁call"}}{CE}{CSE}', True, False, "stop"),
    "call_after_calls_end": (f'{CSB}{CB}get_time{SEP}{{}}{CE}{CSE} then {CB}get_weather{SEP}{{"city": "X"}}{CE}', True, False, "stop"),
}  # fmt: skip
MALFORMED = {
    "length_mid_arguments": (f'{CSB}{CB}get_weather{SEP}{{"city": "Li', True, False, "length"),
    "length_after_a_call": (f'{CSB}{CB}get_time{SEP}{{}}{CE}{CB}function{SEP}get_weather\n```json\n{{"city": ', True, False, "length"),
    "unterminated_without_fence": (f'{CSB}{CB}function{SEP}get_weather\n```json\n{{"a": 1}}<｜tool▁ca', True, False, "stop"),
    "unterminated_in_fence": (f"{CSB}{CB}function{SEP}get_weather\n```js", True, False, "stop"),
    "begin_marker_only": (f"Hi{CSB}", True, False, "stop"),
    "unterminated_head": (f"Hi{CSB}{CB}get_wea", True, False, "length"),
    "no_separator": (f"{CSB}{CB}get_weather{CE}{CSE}tail", True, False, "stop"),
    "v3_empty_name_line": (f"{CSB}{CB}function{SEP}\n```json\n{{}}\n```{CE}{CSE}", True, False, "stop"),
    "unterminated_reasoning": (f"<think>still {CSB} thinking", True, False, "length"),
}  # fmt: skip
EXPECTED = {
    "v3_one_call": ("Let me check.", "", [("get_weather", '{"city": "Rome", "note": "a ``` b"}')], "tool_calls"),
    "v3_two_calls_then_text": (" Done.", "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], "tool_calls"),
    "v31_two_calls": ("Sure.", "", [("get_weather", '{"city": "Oslo, ```x", "pad": "  "}'), ("get_time", "{}")], "tool_calls"),
    "whitespace_in_arguments": ("", "", [("get_weather", '{"a":   1,\n   "b": "  "}'), ("get_time", "{ }")], "tool_calls"),
    "not_parallel": ("", "", [("get_time", '{"tz": "UTC"}')], "tool_calls"),
    "reasoning_then_call": ("Ok.", "thinking <｜tool about </thin it", [("get_time", "{}")], "tool_calls"),
    "think_tag_then_call": ("", "hmm", [("get_time", '{"tz": "UTC"}')], "tool_calls"),
    "marker_prefixes_in_content": ("a <｜tool b <｜tool▁calls c <", "", [("get_time", '{"x": "<｜tool▁call"}')], "tool_calls"),
    "call_after_calls_end": (" then <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"X\"}<｜tool▁call▁end｜>", "",
                             [("get_time", "{}"), ("get_weather", '{"city": "X"}')], "tool_calls"),
    # malformed: a truncated call keeps what was streamed of it (its arguments so far; the stream's
    # finish reason); one never named, or no call at all, is content as written
    "length_mid_arguments": ("", "", [("get_weather", '{"city": "Li')], "length"),
    "length_after_a_call": ("", "", [("get_time", "{}"), ("get_weather", '{"city":')], "length"),
    "unterminated_without_fence": ("", "", [("get_weather", '{"a": 1}<｜tool▁ca')], "stop"),  # (V3 holds back only "\n```")
    "unterminated_in_fence": ("", "", [("get_weather", "")], "stop"),
    "begin_marker_only": ("Hi<｜tool▁calls▁begin｜>", "", [], "stop"),
    "unterminated_head": ("Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wea", "", [], "length"),
    "no_separator": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁call▁end｜><｜tool▁calls▁end｜>tail", "", [], "stop"),
    "v3_empty_name_line": ("", "", [("function", "```json\n{}\n```")], "tool_calls"),
    "unterminated_reasoning": ("", "still <｜tool▁calls▁begin｜> thinking", [], "length"),
}  # fmt: skip


def _outcome(deltas: list[dict], reason: str | None) -> tuple:
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = merge([c for d in deltas for c in d.get("tool_calls", [])])
    return content, reasoning, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], reason


def _streamed(case: tuple, pieces: list[str]) -> tuple:
    text, parallel, in_reasoning, reason = case
    parser = ChatParser(ToolChoice.parse(TOOLS, "auto", parallel), in_reasoning)
    deltas = [parser.feed(piece) for piece in pieces]
    last, reason = parser.finish(reason)
    return _outcome(deltas + [last], reason)


def _whole(case: tuple) -> tuple:
    text, parallel, in_reasoning, reason = case
    parser = ChatParser(ToolChoice.parse(TOOLS, "auto", parallel), in_reasoning)
    message, reason = parser.message(text, reason)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message["content"] or "", message.get("reasoning_content", ""), calls, reason


def _splits(text: str, seed: int) -> list[list[str]]:
    """1-character deltas, every split in two, and random chunkings (some empty deltas)."""
    rng, out = random.Random(seed), [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(30):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 12)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize("name", [*WELL_FORMED, *MALFORMED])
def test_every_split_reads_as_the_whole_and_as_before(name):
    case = WELL_FORMED.get(name) or MALFORMED[name]
    assert _whole(case) == EXPECTED[name]
    for pieces in _splits(case[0], seed=len(name)):
        assert _streamed(case, pieces) == EXPECTED[name], pieces


def test_a_v3_call_whose_fence_is_malformed_reads_as_before():
    """Named when its name line is done, but completed as V3.1 (the kind "function" is the name):
    streamed, the client keeps the first name; whole, it gets the second (as before)."""
    case = (f"{CSB}{CB}function{SEP}get_weather\n```jsonx\n{{}}\n```{CE}{CSE}", True, False, "stop")
    arguments = "get_weather\n```jsonx\n{}\n```"
    assert _whole(case) == _streamed(case, [case[0]]) == ("", "", [("function", arguments)], "tool_calls")
    assert _streamed(case, list(case[0])) == ("", "", [("get_weather", arguments)], "tool_calls")


# ---- delta by delta, the incremental reading equals re-reading the whole text -----------------
FRAGMENTS = [CB, CE, SEP, CSE, CB[:1], CB[:7], CB[:12], CE[:9], CE[:16], SEP[:6], "function", " function ", "get_weather",
             "\n", "\n```", "```json\n", "```\n", "```", "`", "\n``", " ", "\t\n ", "{}", '{"a": 1}', "x", "｜>"]  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    parallel=st.booleans(),
)
def test_incremental_reading_and_deltas_equal_the_whole_texts(parts, cuts, parallel):
    text = CSB + "".join(parts)
    scanner, ours, reference = MarkupScanner(), CallStream(), CallStream()
    at, k = 0, 0
    while at < len(text):
        piece = text[at : at + cuts[k % len(cuts)]] if k % 4 != 3 else ""  # (empty deltas too)
        at, k = at + len(piece), k + 1
        scanner.feed(piece)
        whole = markup_progress(text[:at])
        assert [(c.name, c.arguments(), c.done) for c in scanner.calls] == [
            (c.name, c.arguments, c.done) for c in whole
        ], (text, at)
        got = ours.markup_deltas(
            scanner.calls, *scanner.take_changes(), len(scanner.calls) if parallel else 1
        )
        expected = reference.deltas(whole if parallel else whole[:1])
        assert [{k: v for k, v in d.items() if k != "id"} for d in got] == [
            {k: v for k, v in d.items() if k != "id"} for d in expected
        ], (text, at)
    assert scanner.text() == text and scanner.scanned == len(text)


# ---- linear work --------------------------------------------------------------------------------
def _long_markup(chars: int) -> tuple[str, str]:
    arguments = json.dumps({"city": "Lima", "notes": "sunny, `mild` <｜tool \\n " * (chars // 24)})
    return f"Checking.{CSB}{CB}function{SEP}get_weather\n```json\n{arguments}\n```{CE}{CSE}", arguments


def test_a_long_calls_stream_never_rereads_the_markup(monkeypatch):
    text, arguments = _long_markup(50_000)
    text = text.replace(CSE, f"{CB}get_time{SEP}{{}}{CE}{CSE}")
    read = {"whole": 0, "parsed": 0}
    parse = chat_format.parse_deepseek_calls

    def counted_parse(t: str):
        read["parsed"] += len(t)
        return parse(t)

    def whole_reading(t: str):
        read["whole"] += 1
        return markup_progress(t)

    monkeypatch.setattr(chat_format, "parse_deepseek_calls", counted_parse)
    monkeypatch.setattr(tool_stream, "markup_progress", whole_reading)
    parser = ChatParser(ToolChoice.parse(TOOLS, "auto"))
    deltas = [parser.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert parser._pending == "" and read["whole"] == 0
    assert read["parsed"] <= len(text)  # (each call's own text, once, when it completes)
    last, reason = parser.finish("stop")
    assert read["parsed"] <= 2 * len(text)  # (finish reads the whole text once)
    assert _outcome(deltas + [last], reason) == (
        "Checking.", "", [("get_weather", arguments), ("get_time", "{}")], "tool_calls"
    )  # fmt: skip
    assert len([d for d in deltas if d.get("tool_calls")]) > len(arguments) // 4  # (it streamed)


def _stream_seconds(text: str) -> float:
    """The least of two times to stream `text` in 1-character deltas."""
    best = float("inf")
    for _ in range(2):
        parser = ChatParser(ToolChoice.parse(TOOLS, "auto"))
        start = time.perf_counter()
        for c in text:
            parser.feed(c)
        parser.finish("stop")
        best = min(best, time.perf_counter() - start)
    return best


def test_a_long_argument_streams_in_linear_time():
    """200k characters of arguments in 1-character deltas take about 10x the time of 20k (the
    re-reading parser took about 100x: 0.2 s and 23 s)."""
    small, big = _long_markup(20_000)[0], _long_markup(200_000)[0]
    ratio = _stream_seconds(big) / _stream_seconds(small)
    assert ratio < 30, f"10x the text took {ratio:.0f}x the time"
