"""The router's HTTP surface in process, without Ray: the FastAPI app of services/router/app.py
served by starlette's TestClient, on a real RouterCore (real tokenizer, protocol checks, affinity
and worker choice). What would go to an attention worker goes to `Gate`, which generates nothing:
it records that a request got past every check of the router and refuses it (429). So these
tests check what the router answers on its own (validation, limits, error shapes), never
generation; that is tests/test_api.py's, on a real cluster."""

from __future__ import annotations

import asyncio
import json
import os
import re
import types
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from services.engine.outputs import Refusal, RequestOutput
from services.presets import write_tokenizer
from services.router import app as router_app
from services.router.affinity import PrefixAffinity
from services.router.core import RouterConfig

from .fakes import RemoteCall

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GATE = "gate: the request passed the router's checks"
VOCAB = 1024


class Gate:
    """Stands where an attention worker's actor handle would: records each request that reaches
    it and refuses it with a 429 (`GATE`), or streams `answer` (RequestOutputs) instead."""

    def __init__(self):
        self.requests: list[tuple[list[int], dict]] = []
        self.answer: list[RequestOutput] = []
        self.generate = RemoteCall(self._generate)
        self.abort = RemoteCall(lambda *_: None)
        self.keepalive = RemoteCall(lambda *_: None)

    async def _generate(self, prompt, params, request_id, resumed, owner):
        self.requests.append((list(prompt), dict(params)))
        for item in self.answer or [Refusal(429, GATE)]:
            future = asyncio.get_running_loop().create_future()
            future.set_result(item)
            yield future


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """(TestClient, Gate, model_dir) for a router on a tokenizer-only model directory."""
    model_dir = tmp_path_factory.mktemp("router")
    write_tokenizer(model_dir, VOCAB)
    gate = Gate()
    mp = pytest.MonkeyPatch()
    mp.setattr(router_app.ray, "get_actor", lambda name, namespace=None: gate)
    cls = router_app.Router.func_or_class.__mro__[1]  # (the class under Serve's ingress wrapper)
    instance = cls.__new__(cls)
    instance.__init__(RouterConfig(str(model_dir), "tiny,tiny-alias", ["moe-attn-0"], api_key=API_KEY,
                                   max_prompt_chars=10_000, max_model_len=1 << 16))  # fmt: skip
    mp.setattr(
        router_app.serve, "get_replica_context", lambda: types.SimpleNamespace(servable_object=instance)
    )
    with TestClient(router_app.app, raise_server_exceptions=False) as client:
        yield client, gate, str(model_dir)
    mp.undo()


def post(router, path: str, body: bytes | dict):
    client = router[0]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=data, headers={**AUTH, "Content-Type": "application/json"})


def assert_openai_4xx(r, *statuses: int) -> dict:
    assert 400 <= r.status_code < 500 and (not statuses or r.status_code in statuses), (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"] and err["code"], err
    return err


CHAT = [{"role": "user", "content": "hi"}]


# ---- findings of #52, one each ---------------------------------------------------------------
def test_a_5000_digit_integer_anywhere_is_a_400(router):
    huge = b"1" * 5000
    bodies = {
        "/v1/completions": b'{"model": "tiny", "prompt": "hi", "n": ' + huge + b"}",
        "/v1/chat/completions": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        b'"max_tokens": -' + huge + b"}",
        "/v1/responses": b'{"model": "tiny", "input": "hi", "metadata": {"a": ' + huge + b"}}",
        "/tokenize": b'{"prompt": "hi", "x": [[' + huge + b"]]}",
        "/detokenize": b'{"tokens": [' + huge + b"]}",
    }
    for path, body in bodies.items():
        err = assert_openai_4xx(post(router, path, body), 400)
        assert "digits" in err["message"], (path, err)


@pytest.mark.parametrize("bad", [2**63, 2**64, -(2**63) - 1, 2**31, -1])
def test_token_ids_beyond_the_int_range_are_a_400_on_the_affinity_path_too(router, bad):
    _, gate, _ = router
    before = len(gate.requests)
    for prompt in ([bad] + [5] * 64, [5] * 64 + [bad] + [5] * 64, [[5] * 70, [bad] * 70]):
        err = assert_openai_4xx(
            post(router, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1}), 400
        )
        assert err["param"] == "prompt", err
    for extra, param in (
        ({"stop_token_ids": [bad]}, "stop_token_ids"),
        ({"logit_bias": {str(bad): 1}}, "logit_bias"),
    ):
        err = assert_openai_4xx(
            post(router, "/v1/completions", {"model": "tiny", "prompt": "x", **extra}), 400
        )
        assert err["param"] == param, err
    assert len(gate.requests) == before  # (none got as far as a worker)


def test_affinity_hashes_stop_before_an_id_no_worker_holds():
    prompt = [5] * 64 + [2**63] + [5] * 100
    assert PrefixAffinity.hashes(prompt, 8) == PrefixAffinity.hashes(prompt[:65], 8)
    assert PrefixAffinity().choose(prompt, {"a": 0, "b": 0}) in ("a", "b")


def test_every_served_name_is_listed_and_answered(router):
    """--served-model-name a b (vLLM): both listed, both accepted, the first the API's own."""
    client = router[0]
    assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]] == ["tiny", "tiny-alias"]
    for name in ("tiny", "tiny-alias"):
        r = post(router, "/tokenize", {"model": name, "prompt": "hi"})
        assert r.status_code == 200, r.text
    assert_openai_4xx(post(router, "/tokenize", {"model": "other", "prompt": "hi"}), 404)


def test_openapi_docs_and_redoc_are_not_served(router):
    client = router[0]
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
        assert client.get(path).status_code == 404, path
        assert client.get(path, headers=AUTH).status_code == 404, path


def test_max_prompt_chars_bounds_chat_responses_and_tokenize(router):
    _, gate, _ = router
    long = "a" * 6000  # two of them are over max_prompt_chars (10,000); one is not
    chat = [{"role": "user", "content": long}, {"role": "assistant", "content": long}]
    cases = [
        ("/v1/chat/completions", {"model": "tiny", "messages": chat, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": long}, {"type": "text", "text": long}]}]}),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
            {"role": "user", "content": long},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": long}}]}]}),
        ("/v1/responses", {"model": "tiny", "input": long, "instructions": long}),
        ("/v1/responses", {"model": "tiny", "input": [{"role": "user", "content": long},
                                                      {"role": "user", "content": long}]}),
        ("/tokenize", {"messages": chat}),
    ]  # fmt: skip
    before = len(gate.requests)
    for path, body in cases:
        err = assert_openai_4xx(post(router, path, body), 400)
        assert "characters" in err["message"] and err["param"] == "messages", (path, err)
    assert len(gate.requests) == before
    ok = post(router, "/v1/chat/completions", {"model": "tiny", "messages": chat[:1], "max_tokens": 1})
    assert ok.status_code == 429 and ok.json()["error"]["message"] == GATE  # (under the limit: passed)


def test_server_errors_carry_no_internal_addresses(router):
    """A 503 (here: the worker's step failed, with Ray's text) answered whole, or as a stream's
    error event after its first output, names no address, node, secret or path."""
    _, gate, model_dir = router
    failed = RequestOutput(
        "r", finished=True, finish_reason="error",
        error=f"RayActorError: actor 5f3c2a9e0b1d4c7e8f9a0b1c2d3e4f5a on node ip=10.1.2.3 (10.1.2.3:8076) "
              f"worker [fd00::12]:40123 expert redis://:hunter2@redis.internal:6379/0 at {model_dir}/x.bin",
    )  # fmt: skip
    internal = ("10.1.2.3", "8076", "fd00", "hunter2", "redis.internal", "5f3c2a9e", model_dir)
    try:
        gate.answer = [failed]
        r = post(router, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("generation failed"), r.text
        gate.answer = [RequestOutput("r", [5], text="a"), failed]  # (the error after the first output)
        streams = [post(router, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}),
                   post(router, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2, "stream": True}),
                   post(router, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True})]  # fmt: skip
    finally:
        gate.answer = []
    for answer in [r, *streams]:
        assert "generation failed" in answer.text, answer.text
        for secret in internal:
            assert secret not in answer.text, (secret, answer.text)


# ---- the fuzz: every body of every endpoint, never a 5xx --------------------------------------
class Raw:
    """JSON text written as it is (what json.dumps cannot write: 5000-digit ints, invalid UTF-8)."""

    def __init__(self, data: bytes):
        self.data = data

    def __repr__(self) -> str:
        return f"Raw({self.data[:40]!r}{'...' if len(self.data) > 40 else ''})"


def dump(value) -> bytes:
    """`value` as JSON bytes (NaN/Infinity as Python writes them; lone surrogates as \\u escapes)."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, dict):
        return b"{" + b", ".join(dump(str(k)) + b": " + dump(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b", ".join(dump(v) for v in value) + b"]"
    return json.dumps(value, ensure_ascii=True).encode()


BOUNDARY_INTS = [0, 1, -1, VOCAB - 1, VOCAB, 2**15, 2**16, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1,
                 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 2**128, -(2**200)]  # fmt: skip
INTS = st.one_of(
    st.sampled_from(BOUNDARY_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([Raw(b"9" * 4301), Raw(b"-" + b"1" * 5000), Raw(b"1" * 4300)]),
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            Raw(b"1e400"),
            Raw(b"-1e400"),
            Raw(b"NaN"),
            Raw(b"Infinity"),
            Raw(b"-Infinity"),
            Raw(b"1e-400"),
            Raw(b"0." + b"0" * 5000 + b"1"),
        ]
    ),  # fmt: skip
)
STRINGS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "\udcff",
            "\ud800x",
            "\x00",
            "<｜end▁of▁sentence｜>",
            "<think>",
            "\u202e",
            "tiny",
            "a" * 20_000,
            "é" * 5000,
            "<｜tool▁calls▁begin｜>",
            "function",
            "required",
            "auto",
        ]
    ),  # fmt: skip
    st.sampled_from(
        [
            Raw(b'"\xff\xfe"'),
            Raw(b'"\xc3("'),
            Raw(b'"\xed\xa0\x80"'),
            Raw(b'"\\ud800"'),
            Raw(b'"\\udcff\\ud800"'),
            Raw(b'"unterminated'),
        ]
    ),  # fmt: skip
)
DEEP = st.sampled_from([Raw(b"[" * 5000 + b"]" * 5000), Raw(b'{"a":' * 200 + b"1" + b"}" * 200),
                        Raw(b"[" * 100)])  # fmt: skip
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRINGS, DEEP)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(STRINGS.filter(lambda s: isinstance(s, str)), inner, max_size=4),
    ),
    max_leaves=12,
)
TOKEN_LISTS = st.one_of(
    st.lists(INTS, min_size=1, max_size=4).map(
        lambda ids: ids + [5] * 64
    ),  # (a full block: affinity hashes it)
    st.lists(INTS, min_size=1, max_size=4).map(lambda ids: [5] * 64 + ids + [5] * 64),
    st.lists(st.lists(INTS, min_size=1, max_size=3), min_size=1, max_size=3),
)

BASE = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny", "messages": CHAT, "max_tokens": 1},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
}
SAMPLING = ["model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
            "stop_token_ids", "seed", "ignore_eos", "return_token_ids", "user", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "response_format",
            "cache_salt"]  # fmt: skip
FIELDS = {
    "/v1/completions": SAMPLING + ["prompt", "logprobs", "echo", "suffix", "best_of", "prompt_logprobs"],
    "/v1/chat/completions": SAMPLING + ["messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                        "add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls",
                                        "prompt_logprobs"],  # fmt: skip
    "/v1/responses": ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                      "text", "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "user", "seed",
                      "previous_response_id", "conversation", "background", "prompt", "truncation", "include"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"],
    "/detokenize": ["model", "tokens"],
}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# values shaped like each field's, with hostile leaves (besides VALUES' anything at all)
SHAPED = {
    "prompt": st.one_of(TOKEN_LISTS, STRINGS, st.lists(STRINGS, min_size=1, max_size=3)),
    "tokens": TOKEN_LISTS,
    "stop_token_ids": st.lists(INTS, max_size=3),
    "logit_bias": st.dictionaries(st.one_of(INTS.map(str), STRINGS.filter(lambda s: isinstance(s, str))),
                                  st.one_of(INTS, FLOATS), max_size=3),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "x"])},
                                               optional={"content": st.one_of(STRINGS, VALUES),
                                                         "tool_calls": VALUES, "name": STRINGS}),
                         max_size=3),
    "input": st.one_of(STRINGS, st.lists(st.dictionaries(st.sampled_from(["type", "role", "content", "call_id",
                                                                         "name", "arguments", "output"]),
                                                         st.one_of(STRINGS, VALUES), max_size=4), max_size=3)),
    "tools": st.one_of(st.just([TOOL]), VALUES),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function",
                                                                          "function": {"name": "f"}}]), VALUES),
    "response_format": st.one_of(st.just({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
                                 VALUES.map(lambda v: {"type": "json_schema", "json_schema": {"schema": v}})),
}  # fmt: skip
RAW_BODIES = st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe", b"{}", b'{"model": 1e400}',
                              b"{" + b'"a": 1, ' * 10_000 + b'"b": 2}', b"[" * 100_000])  # fmt: skip


def bodies(path: str):
    """A body for `path`: its valid base with some fields replaced by hostile values (or
    unknown fields added), or a hostile JSON document, or not JSON at all."""
    field = st.sampled_from([*FIELDS[path], "unknown_field"])
    item = field.flatmap(lambda f: st.tuples(st.just(f), st.one_of(SHAPED.get(f, VALUES), VALUES)))
    mutated = st.lists(item, min_size=1, max_size=4).map(lambda items: dump({**BASE[path], **dict(items)}))
    return st.one_of(mutated, mutated, mutated, VALUES.map(dump), RAW_BODIES)


ADDRESS = re.compile(rb"\b\d{1,3}(?:\.\d{1,3}){3}\b|\[?[0-9a-f]{0,4}(?::[0-9a-f]{0,4}){2,7}\]?:\d+", re.I)
ENDPOINTS = list(BASE)
EXAMPLES = int(os.environ.get("MOE_FUZZ_EXAMPLES", 200))  # per endpoint (~10 s for all five on 2 cores)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzzed_bodies_get_2xx_or_an_openai_4xx(router, path):
    _, gate, model_dir = router
    answers: Counter = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies(path))
    def one(body: bytes):
        r = post(router, path, body)
        answers[r.status_code] += 1
        answers["bodies"] += 1
        assert r.status_code < 500, (r.status_code, r.text[:500], body[:500])
        if r.status_code >= 400:
            err = assert_openai_4xx(r)
            if r.status_code == 429:
                assert err["message"] == GATE, err  # (only the gate refuses for a full queue here)
            text = r.content
            assert model_dir.encode() not in text, text[:300]
            assert all(m in body for m in ADDRESS.findall(text)), text[
                :300
            ]  # (addresses only the client's own)

    one()
    reached = answers[429]
    print(f"\n{path}: {answers['bodies']} bodies, answers {dict(sorted((k, v) for k, v in answers.items() if k != 'bodies'))}, "
          f"{reached} passed every check (refused by the gate)")  # fmt: skip
    assert answers["bodies"] >= EXAMPLES // 2, answers  # (hypothesis ran about what was asked)
    assert not [k for k in answers if isinstance(k, int) and k >= 500], answers
