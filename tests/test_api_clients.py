"""Clients people already run, against a real local cluster: lm-evaluation-harness's
`local-completions` (loglikelihood and generate_until tasks from a local task file), prompt
logprobs through completions `echo` + `logprobs` and vLLM's `prompt_logprobs`, the tokenizer
endpoints its remote tokenizer reads."""

import json
import math

import httpx
import jsonschema
import openai
import pytest

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer

from .clusters import tiny_cluster
from .test_api import SCHEMAS, TOOLS

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tiny_model):
    with tiny_cluster(tiny_model, expert_workers=1, balancer_period_s=0, max_num_seqs=16) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(tiny_model):
    return LocalEngine(EngineConfig(model=str(tiny_model)))


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer.from_dir(tiny_model)


def _prompt_logprobs(local, ids, n=1):
    return local.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=n))[0].prompt_logprobs


def test_echo_with_logprobs_returns_the_prompts_logprobs(client, local, tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_bos=False)
    want = _prompt_logprobs(local, ids)
    r = client.completions.create(
        model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = r.choices
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lps = choice.logprobs
    assert len(lps.tokens) == len(ids) and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    for got, expected, top in zip(lps.token_logprobs[1:], want[1:], lps.top_logprobs[1:], strict=True):
        assert math.isclose(got, expected.token_logprob, abs_tol=1e-4)
        assert max(top.values()) >= got - 1e-6  # (the best token is among the top)
    assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)

    # with a completion after it: the prompt's entries, then the generated tokens'
    r = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lps = r.choices[0].logprobs
    assert len(lps.tokens) == len(ids) + 3 and r.usage.completion_tokens == 3
    assert all(math.isclose(g, e.token_logprob, abs_tol=1e-4)
               for g, e in zip(lps.token_logprobs[1 : len(ids)], want[1:], strict=True))  # fmt: skip
    assert r.choices[0].text.startswith(tok.decode(ids))

    # streamed: the same entries, the prompt's on the first chunk
    chunks = list(client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lps.token_logprobs
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_vllm_prompt_logprobs_field(client, local, tok):
    ids = tok.encode("Hello there, general", add_bos=False)
    want = _prompt_logprobs(local, ids, n=2)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for entry, token, expected in zip(got[1:], ids[1:], want[1:], strict=True):
        assert math.isclose(entry[str(token)]["logprob"], expected.token_logprob, abs_tol=1e-4)
        assert entry[str(token)]["rank"] == expected.rank and len(entry) in (2, 3)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 2


def test_max_tokens_zero_needs_echo(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)


def test_tokenizer_endpoints_as_lm_eval_calls_them(cluster, tok):
    info = httpx.get(f"{cluster.url}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"]
    ids = httpx.post(f"{cluster.url}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode("test", add_bos=False)
    assert httpx.post(f"{cluster.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "test"


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_accumulate_to_the_whole_call(client, tool_choice):
    """The official client's stream: each call's name arrives first, then argument fragments; put
    together they are the non-streamed response's calls (same seed)."""
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
               tool_choice=tool_choice, max_tokens=120, seed=4)  # fmt: skip
    whole = client.chat.completions.create(**ask).choices[0]
    calls: dict[int, dict] = {}
    fragments = 0
    for chunk in client.chat.completions.create(**ask, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if d.index not in calls:
                assert d.id and d.function.name  # (the name comes first)
                calls[d.index] = {
                    "id": d.id,
                    "name": d.function.name,
                    "arguments": d.function.arguments or "",
                }
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
                fragments += 1
    assert fragments >= 2  # (the arguments came in pieces, as they decoded)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish"]


def _task_files(tmp_path) -> str:
    """Two tasks over local JSONL files: 24 three-way multiple choice items (loglikelihood) and
    8 short generations (generate_until)."""
    mc = [{"question": f"Q{i}: the {WORDS[i % 12]} is", "choices": [f" {WORDS[(i + k) % 12]}" for k in range(3)],
           "answer": i % 3} for i in range(24)]  # fmt: skip
    gen = [{"question": f"Say {WORDS[i]}:", "answer": f" {WORDS[i]}"} for i in range(8)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in gen))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (tmp_path / "mc.yaml").write_text(
        f"task: moe_tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    (tmp_path / "gen.yaml").write_text(
        f"task: moe_tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: answer\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return str(tmp_path)


@pytest.mark.slow
def test_lm_evaluation_harness_local_completions(cluster, local, tok, tmp_path, monkeypatch):
    """lm-evaluation-harness (from PyPI) runs both tasks against the cluster; every
    loglikelihood it reports equals the sum of LocalEngine's prompt logprobs over the continuation."""
    for name in ("HF_HOME", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(name, str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny,base_url={cluster.url}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=2,max_retries=1,tokenized_requests=True",
        tasks=["moe_tiny_mc", "moe_tiny_gen"],
        task_manager=TaskManager(include_path=_task_files(tmp_path)),
        batch_size=4,
        log_samples=True,
    )
    assert set(results["results"]) == {"moe_tiny_mc", "moe_tiny_gen"}
    mc = results["samples"]["moe_tiny_mc"]
    assert len(mc) == 24 and all(len(s["resps"]) == 3 for s in mc)
    for sample in mc:
        for (context, continuation), ((loglikelihood, _greedy),) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            whole = tok.encode(context + continuation, add_bos=False)
            ctxlen = len(tok.encode(context, add_bos=False))
            expected = sum(e.token_logprob for e in _prompt_logprobs(local, whole)[ctxlen:])
            assert math.isclose(loglikelihood, expected, abs_tol=1e-3), (context, continuation)
    gen = results["samples"]["moe_tiny_gen"]
    assert len(gen) == 8 and all(isinstance(s["resps"][0][0], str) for s in gen)


# ---- the Responses API ---------------------------------------------------------------------------
def test_responses_text_equals_chat(client):
    ask = dict(model="tiny", max_output_tokens=12, temperature=0)
    r = client.responses.create(input="Hello there", **ask)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=12, temperature=0)  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert (
        r.usage.input_tokens == chat.usage.prompt_tokens
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}]  # fmt: skip
    r = client.responses.create(input=items, instructions="Be brief.", **ask)
    chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}])  # fmt: skip
    assert r.output_text == chat.choices[0].message.content and r.instructions == "Be brief."


def test_responses_stream_events(client):
    ask = dict(model="tiny", input="Tell me", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**ask)
    kinds, text, final = [], "", None
    for event in client.responses.create(**ask, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_item.done" in kinds
    assert text == whole.output_text == final.output_text
    seqs = []  # (sequence numbers count up)
    for event in client.responses.create(**ask, stream=True):
        seqs.append(event.sequence_number)
    assert seqs == list(range(len(seqs)))


def test_responses_json_schema_and_function_tools(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model="tiny", input="JSON", max_output_tokens=60, extra_body={"seed": 2},
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)

    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
        for t in TOOLS
    ]
    ask = dict(model="tiny", input="Weather?", tools=tools, tool_choice="required", max_output_tokens=120,
               extra_body={"seed": 5})  # fmt: skip
    r = client.responses.create(**ask)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    streamed: dict[int, str] = {}
    for event in client.responses.create(**ask, stream=True):
        if event.type == "response.function_call_arguments.delta":
            streamed[event.output_index] = streamed.get(event.output_index, "") + event.delta
    assert list(streamed.values()) == [c.arguments for c in calls]

    # the call's result goes back as input items
    followup = [{"role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]  # fmt: skip
    answer = dict(model="tiny", tools=tools, tool_choice="none", max_output_tokens=4)
    with_result = client.responses.create(input=followup, **answer)
    assert (
        with_result.usage.input_tokens
        > client.responses.create(input=followup[:1], **answer).usage.input_tokens
    )


@pytest.mark.parametrize(
    "extra, field",
    [({"previous_response_id": "resp_x"}, "previous_response_id"), ({"store": True}, "store"),
     ({"background": True}, "background"), ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
     ({"reasoning": {"effort": "high"}}, "reasoning")],
)  # fmt: skip
def test_responses_refuses_what_it_does_not_keep_by_name(client, extra, field):
    ask = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**ask)
    assert e.value.body["param"] == field
