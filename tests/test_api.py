"""The OpenAI-compatible API, end to end: official `openai` client -> Ray Serve router ->
attention worker -> gRPC expert workers, on a real local Ray cluster with an embedded Redis."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .clusters import tiny_cluster
from .test_grammar import FORECAST

pytestmark = pytest.mark.cluster

API_KEY = "test-key"


@pytest.fixture(scope="module")
def cluster(tiny_model):
    with tiny_cluster(
        tiny_model,
        expert_workers=2,
        redundant_experts=4,
        max_num_seqs=32,
        max_waiting=64,
        balancer_period_s=0,
        api_key=API_KEY,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(tiny_model):
    return LocalEngine(EngineConfig(model=str(tiny_model)))


def _greedy(local, prompt_ids, n):
    return local.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]


def test_models_and_health(cluster, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{cluster.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{cluster.url}/ready").status_code == 200


def test_completion_equals_local_engine(client, local, tiny_model):
    from services.engine.tokenizer import Tokenizer

    prompt = "The quick brown fox"
    ids = Tokenizer.from_dir(tiny_model).encode(prompt)
    expect = _greedy(local, ids, 24)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    choice = r.choices[0]
    assert choice.token_ids == expect.token_ids and choice.text == expect.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 24


def test_token_id_prompt_batch_and_streaming(client, local):
    prompts = [[0, 5, 6, 7], [0, 99, 100]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    by_index = sorted(r.choices, key=lambda c: c.index)
    assert [c.token_ids for c in by_index] == [_greedy(local, p, 10).token_ids for p in prompts]
    stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == by_index[0].text
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 12
    parts = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == full.choices[0].message.content


def test_n_seed_and_logprobs(client):
    kw = dict(model="tiny", prompt=[0, 11, 12], max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    a = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    b = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    assert len(a) == 3 and [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1  # seed, seed+1, seed+2 differ
    lp = client.completions.create(model="tiny", prompt=[0, 11, 12], max_tokens=4, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    info = lp.choices[0].logprobs
    assert len(info.tokens) == 4 and len(info.top_logprobs[0]) == 2
    assert all(x <= 0 for x in info.token_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_stop_strings(client):
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    text = base.choices[0].text
    # the first two printable characters past the start (a byte-level tokenizer also writes U+FFFD)
    needle = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].isprintable()
                  and "\ufffd" not in text[i : i + 2])  # fmt: skip
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[needle],
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(needle)]


def test_prefix_cache_hits_and_n_choices_prefill_once(cluster, client):
    def hit_tokens():
        return sum(
            ray.get(a.stats.remote())["prefix_cache"]["hit_tokens"] for a in cluster.attention.values()
        )

    params = {"model": "tiny", "prompt": [0] + list(range(10, 210)), "max_tokens": 8, "temperature": 0.0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    first = client.completions.create(**params)
    again = client.completions.create(**params)
    assert again.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 192  # 3 full blocks, never the last token
    before = hit_tokens()
    four = client.completions.create(**{**params, "prompt": [0] + list(range(150, 350)), "n": 4})
    assert len({c.text for c in four.choices}) == 1  # greedy: all the same
    assert hit_tokens() - before == 3 * 192  # the first choice prefilled, the three others hit
    assert "moe_prefix_cache_hit_tokens" in httpx.get(f"{cluster.url}/metrics").text


def test_errors_are_openai_json(cluster, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="wrong", max_retries=0).models.list()
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 1.5}, {"max_tokens": 10**6}, {"n": 100}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", **bad)
        assert e.value.status_code == 400 and e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[0, 10**7], max_tokens=2)


def test_64_concurrent_streams_complete(cluster):
    async def one(i, http):
        body = {"model": "tiny", "prompt": [0, 4 + i % 50, 7], "max_tokens": 6 + i % 5, "temperature": 0,
                "stream": True, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        tokens, done = 0, False
        async with http.stream("POST", f"{cluster.url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"}) as r:  # fmt: skip
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
        return done and tokens == 6 + i % 5

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*[one(i, http) for i in range(64)])

    assert all(asyncio.run(main()))


BAD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                       st.text(max_size=20), st.lists(st.integers(-5, 10**7), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))  # fmt: skip
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
          "stream", "messages", "stop_token_ids", "echo", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_p", "min_tokens", "logit_bias", "response_format", "tools", "tool_choice",
          "top_logprobs", "prompt_logprobs", "unknown_field"]  # fmt: skip


def _assert_usage_counts_the_tokens(answer: dict, body: dict, path: str) -> None:
    """A valid non-streamed answer: its usage counts exactly the tokens its choices hold, at least
    one per choice (none only for echo with max_tokens 0: the prompt alone), within max_tokens."""
    from services.router.protocol import ChatCompletionRequest, CompletionRequest

    assert answer["object"] == ("chat.completion" if "chat" in path else "text_completion"), answer
    # the request as the router read it (its own model, on the JSON it received)
    req = (ChatCompletionRequest if "chat" in path else CompletionRequest).model_validate(
        json.loads(json.dumps(body))
    )
    generated = [len(c["token_ids"]) for c in answer["choices"]]
    usage = answer["usage"]
    assert generated and usage["completion_tokens"] == sum(generated), answer
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + sum(generated), (
        usage
    )
    if getattr(req, "echo_only", False):
        assert generated == [0] * len(generated), answer
    else:
        assert min(generated) > 0, answer
    if req.max_tokens is not None and req.max_tokens > 0:
        assert max(generated) <= req.max_tokens, answer


# (300 over the real cluster; test_router_http fuzzes every endpoint's validation in process, more widely)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.dictionaries(st.sampled_from(FIELDS), BAD_VALUES, max_size=6), BAD_VALUES),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))  # fmt: skip
def test_bad_bodies_get_4xx_openai_errors(cluster, body, path):
    if isinstance(body, dict):
        if "max_tokens" in body and isinstance(body["max_tokens"], int):
            body["max_tokens"] = min(body["max_tokens"], 4)  # keep accidentally valid requests short
        body["return_token_ids"] = True  # (not fuzzed: an accidentally valid answer shows its tokens)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{cluster.url}{path}", content=json.dumps(body), headers=headers, timeout=120)  # NaN too
    if r.status_code == 200:  # an accidentally valid request: then a valid answer
        if body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        else:
            _assert_usage_counts_the_tokens(r.json(), body, path)
        return
    # invalid: 400 naming what is wrong, or 404 for a model that is not served
    assert r.status_code in (400, 404), (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"], err
    if r.status_code == 404:
        assert isinstance(body, dict) and body.get("model") != "tiny" and err["code"] == "model_not_found", (
            err
        )


AUTH = {"Authorization": f"Bearer {API_KEY}"}

# strings a hostile (or careless) client sends inside otherwise valid requests
HOSTILE = ["\udcff", "\ud800", "\x00", "\ufffd", "😀", "\u202e", "<｜end▁of▁sentence｜>", '{"', "\\", "\n" * 50,
           "a" * 100_000, "ab" * 300_000]  # fmt: skip
HOSTILE_TEXT = st.lists(st.sampled_from(HOSTILE) | st.text(max_size=8), min_size=1, max_size=4).map("".join)


def _post(cluster, path: str, body: dict) -> httpx.Response:
    # ensure_ascii: lone surrogates travel as JSON escapes, as a client's JSON library writes them
    data = json.dumps(body, ensure_ascii=True)
    return httpx.post(f"{cluster.url}{path}", content=data, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=120)  # fmt: skip


def test_lone_surrogates_get_a_400_naming_the_field(cluster):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "\udcff ok"}], "max_tokens": 2}
    cases = [("/v1/completions", {"model": "tiny", "prompt": "\udcff ok", "max_tokens": 2}, "prompt"),
             ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["\ud800"], "max_tokens": 2}, "stop"),
             ("/v1/chat/completions", chat, "messages"),
             ("/tokenize", {"model": "tiny", "prompt": "a\udcffb"}, "prompt")]  # fmt: skip
    for path, body, param in cases:
        r = _post(cluster, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert "surrogate" in r.json()["error"]["message"]
    ok = _post(cluster, "/v1/completions", {"model": "tiny", "prompt": "\ud83d\ude00 ok", "max_tokens": 2})
    assert ok.status_code == 200  # (an escaped surrogate *pair* is one valid character)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=HOSTILE_TEXT, where=st.sampled_from(["prompt", "chat", "stop", "user", "tool", "schema_key"]))
def test_hostile_strings_in_valid_requests_never_get_a_5xx(cluster, text, where):
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "max_tokens": 2, "messages": messages}
    path = "/v1/chat/completions"
    if where == "prompt":
        body, path = {"model": "tiny", "max_tokens": 2, "prompt": text}, "/v1/completions"
    elif where == "chat":
        messages[0]["content"] = text
    elif where == "stop":
        body["stop"] = [text[:64] or "x"]
    elif where == "user":
        body["user"] = text
    elif where == "tool":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": text,
                                                           "parameters": {"type": "object"}}}]  # fmt: skip
    else:
        schema = {"type": "object", "properties": {text[:200] or "k": {"type": "integer"}}}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = _post(cluster, path, body)
    assert r.status_code < 500, (where, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert r.status_code == 400 and r.json()["error"]["message"], r.text[:300]


def test_deeply_nested_tool_schemas_get_no_5xx(cluster):
    schema: dict = {"type": "integer"}
    for depth in range(1, 400):
        schema = {"type": "object", "properties": {"k": schema}}
        if depth in (8, 40, 399):
            tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
            body = {"model": "tiny", "max_tokens": 4, "tools": tools, "tool_choice": "required",
                    "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
            r = _post(cluster, "/v1/chat/completions", body)
            assert r.status_code in (200, 400), (depth, r.status_code, r.text[:300])


def test_cache_salt_isolates_prefix_hits(client):
    params = {"model": "tiny", "prompt": [1] + list(range(100, 300)), "max_tokens": 2, "temperature": 0.0}

    def cached(salt):
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(**params, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0 and cached(None) == 0  # another tenant learns nothing
    assert cached("a") == 192 and cached("b") == 192 and cached(None) == 192  # each its own hits
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**params, extra_body={"cache_salt": ""})


def test_unimplemented_fields_are_refused_by_name(cluster):
    base = {"model": "tiny", "prompt": [0, 5], "max_tokens": 2}
    for extra, param in (({"foo": 1}, "foo"), ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"tools": [{"type": "function"}]}, "tools"), ({"suffix": "x"}, "suffix")):  # fmt: skip
        r = httpx.post(f"{cluster.url}/v1/completions", json={**base, **extra}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(
        f"{cluster.url}/v1/completions", json={**base, "response_format": {"type": "text"}}, headers=AUTH
    )
    assert ok.status_code == 200


def test_size_and_nesting_limits(cluster):
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(
        f"{cluster.url}/v1/completions", content=huge, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["message"]
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(
        f"{cluster.url}/v1/completions", content=deep, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == 400
    many = {"model": "tiny", "prompt": [[0, 5]] * 300, "max_tokens": 1}
    assert httpx.post(f"{cluster.url}/v1/completions", json=many, headers=AUTH).status_code == 400


def test_a_stream_refused_before_its_first_byte_gets_its_http_status(cluster):
    body = {"model": "tiny", "prompt": [0, 10**6], "max_tokens": 2, "stream": True}  # out of the vocabulary
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_echo_penalties_and_bias(client, local):
    prompt = [0, 7, 7, 7, 7]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    tokens = plain.choices[0].model_extra["token_ids"]
    assert tokens == _greedy(local, prompt, 16).token_ids
    echoed = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    alone = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert echoed.choices[0].text == "Hello" + alone.choices[0].text
    biased = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                       logit_bias={str(t): -100 for t in set(tokens)},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert not set(biased.choices[0].model_extra["token_ids"]) & set(tokens)
    penalised = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert penalised.choices[0].model_extra["token_ids"] != tokens


def test_tokenize_detokenize_version(cluster, tiny_model):
    from services.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    r = httpx.post(
        f"{cluster.url}/tokenize", json={"model": "tiny", "prompt": "Hello wörld"}, headers=AUTH
    ).json()
    assert (
        r["tokens"] == tok.encode("Hello wörld") and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    )
    chat = httpx.post(f"{cluster.url}/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                      headers=AUTH).json()  # fmt: skip
    assert tok.decode(chat["tokens"], skip_special_tokens=False).endswith("<｜Assistant｜>")
    back = httpx.post(
        f"{cluster.url}/detokenize", json={"model": "tiny", "tokens": r["tokens"]}, headers=AUTH
    ).json()
    assert back["prompt"] == "Hello wörld"
    assert httpx.post(f"{cluster.url}/detokenize", json={"model": "tiny", "tokens": [10**9]},
                      headers=AUTH).status_code == 400  # fmt: skip
    assert httpx.get(f"{cluster.url}/version").json()["version"]


def test_still_healthy_after_bad_input(cluster, client, local):
    raw = httpx.post(f"{cluster.url}/v1/completions", content=b"{not json",
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})  # fmt: skip
    assert raw.status_code == 400 and raw.json()["error"]["message"]
    assert httpx.get(f"{cluster.url}/health").status_code == 200
    r = client.completions.create(model="tiny", prompt=[0, 5, 6, 7], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert r.choices[0].token_ids == _greedy(local, [0, 5, 6, 7], 5).token_ids


def test_metrics_and_experts_endpoints(cluster):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    text = httpx.get(f"{cluster.url}/metrics").text
    for name in ("moe_requests_total", "moe_time_to_first_token_seconds", "moe_kv_blocks_used",
                 "moe_placement_version", "moe_requests_running"):  # fmt: skip
        assert name in text
    experts = httpx.get(f"{cluster.url}/v1/experts", headers=auth).json()
    assert experts["version"] >= 1 and len(experts["workers"]) == 2


def test_one_node_data_plane_is_shared_memory_and_shows(cluster, client, capsys):
    """transport auto on one node: every expert worker is reached through shared memory; the
    attention worker, /metrics and `moe-cluster status` say so, with the expert wait per layer."""
    from services.cli import main as cli

    client.completions.create(model="tiny", prompt=[0, 5, 6], max_tokens=4)
    stats = ray.get([a.stats.remote() for a in cluster.attention.values()])
    for s in stats:
        assert set(s["dispatch"]["transport"].values()) == {"shm"}, s["dispatch"]
        assert s["dispatch"]["shm_calls"] > 0 and s["expert_wait_per_moe_layer_s"] > 0
    assert _gauge(cluster, "moe_dispatch_shm_calls") > 0
    assert _gauge(cluster, "moe_expert_wait_per_moe_layer_seconds") > 0
    assert cli(["status", "--namespace", cluster.cfg.namespace]) == 0
    out = capsys.readouterr().out
    assert " shm" in out and "ms per MoE layer" in out, out
    assert "KV cache: " in out and "tokens (auto rows)" in out, out


def test_a_generation_whose_router_replica_is_gone_is_aborted(cluster):
    """A request whose owner (a router replica) never renews its lease is aborted within seconds
    (owner_timeout_s, 5 s), long before its 4,000 tokens: no compute for a client that is gone.
    The router replicas' own requests (every other test here) are not."""
    actor = next(iter(cluster.attention.values()))
    params = {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
    stream = actor.generate.options(num_returns="streaming").remote(
        [0, 5, 6], params, "orphan-1", (0, 0), "ghost"
    )
    t0, tokens, last = time.monotonic(), 0, None
    for ref in stream:
        last = ray.get(ref)
        tokens += len(last.token_ids)
    assert last.finished and last.finish_reason == "abort" and tokens < 4000, (last, tokens)
    assert time.monotonic() - t0 < 30


def test_a_local_runs_data_plane_is_on_loopback_and_refuses_strangers(cluster):
    import grpc

    from services.dataplane import shm
    from services.experts.client import ExpertClient

    workers = ray.get(cluster.balancer.status.remote())["workers"]
    assert workers and all(w["address"].startswith("127.0.0.1:") for w in workers), workers
    for w in workers:
        stranger = ExpertClient(w["address"])
        with pytest.raises(grpc.RpcError) as e:
            stranger.stats()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # (TLS: no handshake without the secret)
        stranger.close()
        with pytest.raises(PermissionError, match="refused"):  # (no secret: no channel)
            shm.ShmChannel.connect(w["address"])


def _gauges(cluster, *names: str) -> dict[str, float]:
    """Each named per-worker gauge of one /metrics scrape, summed over the attention workers; a
    name /metrics does not export fails (a missing gauge is not a zero)."""
    text = httpx.get(f"{cluster.url}/metrics").text
    values = {name: [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
              for name in names}  # fmt: skip
    missing = [name for name, v in values.items() if len(v) != len(cluster.attention)]
    assert not missing, f"/metrics has no {missing} for each of the {len(cluster.attention)} workers"
    return {name: sum(v) for name, v in values.items()}


def _gauge(cluster, name: str) -> float:
    return _gauges(cluster, name)[name]


def _idle(cluster, deadline_s: float) -> dict[str, float]:
    """Poll /metrics until no request runs and no KV block is held; its gauges then."""
    names = ("moe_requests_running", "moe_kv_blocks_used", "moe_engine_steps")
    deadline = time.monotonic() + deadline_s
    while (now := _gauges(cluster, *names))["moe_requests_running"] or now["moe_kv_blocks_used"]:
        assert time.monotonic() < deadline, f"still running or holding KV blocks after {deadline_s}s: {now}"
        time.sleep(0.2)
    return now


def test_client_disconnect_aborts_and_frees_the_cache(cluster):
    body = {"model": "tiny", "prompt": [0, 5, 6], "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    before = _idle(cluster, 60)  # (nothing else runs: the engine steps counted below are this request's)
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:  # fmt: skip
        lines = r.iter_lines()  # (held: dropping a half-read iterator closes the connection)
        assert next(line for line in lines if line.startswith("data: "))  # a token came
        # still connected: the gauges show it running (so their falling to zero below means something)
        streaming = _gauges(cluster, "moe_requests_running", "moe_kv_blocks_used")
        assert streaming["moe_requests_running"] == 1 and streaming["moe_kv_blocks_used"] > 0, streaming
        r.close()  # hang up
    # it ends and frees its blocks, aborted short of its 4,000 tokens (a step each)
    after = _idle(cluster, 300)
    steps = after["moe_engine_steps"] - before["moe_engine_steps"]
    assert 1 <= steps < 4000, f"{steps} engine steps: the abandoned request ran to its last token"


def test_full_queue_answers_429_with_retry_after(cluster):
    async def one(http):
        body = {"model": "tiny", "prompt": [0, 5, 6], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        return await http.post(f"{cluster.url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*[one(http) for _ in range(160)])

    responses = asyncio.run(main())
    codes = {r.status_code for r in responses}
    assert codes <= {200, 429}, codes
    refused = [r for r in responses if r.status_code == 429]
    assert refused, "32 running + 64 waiting should not absorb 160 concurrent requests"
    assert refused[0].headers["retry-after"] and refused[0].json()["error"]["type"] == "rate_limit_error"
    assert httpx.get(f"{cluster.url}/health").status_code == 200


# ---- structured outputs and tools ------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _twenty(call):
    with ThreadPoolExecutor(20) as pool:
        return list(pool.map(call, range(20)))


def test_json_schema_outputs_parse_and_validate_20_of_20(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    rs = _twenty(lambda i: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"Forecast {i}"}], response_format=fmt, seed=i,
        max_tokens=128))  # fmt: skip
    for r in rs:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), FORECAST)


def test_json_mode_streams_json(client):
    def streamed(seed: int) -> tuple[str, str]:
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                                response_format={"type": "json_object"}, seed=seed, max_tokens=64,
                                                stream=True)  # fmt: skip
        chunks = [c for c in stream if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    text, reason = streamed(0)  # (this seed closes the object at once)
    assert reason == "stop" and isinstance(json.loads(text), dict), (reason, text)
    text, reason = streamed(3)  # (this one writes a long key): the tokens the whole answer has
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                           response_format={"type": "json_object"}, seed=3, max_tokens=64)  # fmt: skip
    assert reason == whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 64
    assert text == whole.choices[0].message.content and text.startswith('{"')
    completion = client.completions.create(model="tiny", prompt="JSON:", max_tokens=128, seed=1,
                                           extra_body={"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "f", "schema": FORECAST}}})  # fmt: skip
    jsonschema.validate(json.loads(completion.choices[0].text), FORECAST)


def test_required_tool_calls_validate_20_of_20(client):
    rs = _twenty(lambda i: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"Weather or time? {i}"}], tools=TOOLS,
        tool_choice="required", seed=i, max_tokens=200))  # fmt: skip
    for r in rs:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_call_streamed_then_answered(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Time?"}],
                                            tools=TOOLS, tool_choice=named, stream=True, max_tokens=64)  # fmt: skip
    calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls if c.function.name] == ["get_time"] and calls[0].id
    arguments = "".join(c.function.arguments or "" for c in calls)  # (streamed in fragments)
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function",
         "function": {"name": "get_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"},
    ]  # fmt: skip
    # the tool's result is in the prompt (it renders as more tokens than the call alone), and the
    # answer is text: 8 tokens of it, as asked
    answer = dict(model="tiny", tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    r = client.chat.completions.create(messages=messages, **answer)
    without = client.chat.completions.create(messages=messages[:2], **answer)
    assert r.usage.prompt_tokens > without.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_bad_structured_requests_name_their_field(cluster):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for extra, param in (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ):  # fmt: skip
        r = httpx.post(f"{cluster.url}/v1/chat/completions", json={**chat, **extra}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
