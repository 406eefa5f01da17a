"""Grammar-constrained decoding in the engine (llguidance masks in our batched sampler)."""

import json

import jsonschema
import llguidance as llg
import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.grammar import GrammarCompiler, GrammarError, check_json_schema, json_grammar
from services.engine.sampling import SamplingParamError, SamplingParams, sample
from services.engine.scheduler import RequestError

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "days", "unit", "alerts"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LocalEngine(EngineConfig(model=str(tiny_model)))


def test_masks_allow_exactly_what_the_grammar_does(engine):
    compiler = GrammarCompiler(engine.tokenizer.to_json(), engine.cfg.vocab_size, engine.cfg.eos_token_ids)
    tok = engine.tokenizer
    m1, m2 = compiler.matcher({"type": "object"}), compiler.matcher({"type": "array"})
    mask = compiler.allowed([m1, m2])
    assert mask.shape == (2, engine.cfg.vocab_size) and mask.dtype == torch.bool
    assert mask[0].nonzero().flatten().tolist() == tok.encode("{", add_bos=False)
    assert mask[1].nonzero().flatten().tolist() == tok.encode("[", add_bos=False)
    for t in tok.encode('{"a":1}', add_bos=False):
        assert compiler.allowed([m1])[0, t] and m1.consume(t)
    assert compiler.allowed([m1])[0].nonzero().flatten().tolist() == list(
        engine.cfg.eos_token_ids
    )  # complete: only EOS
    assert m2.consume(tok.encode("]", add_bos=False)[0]) is False  # not allowed at the start


def test_invalid_schemas_are_refused():
    for bad in ({"type": "objectx"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, [1]):
        with pytest.raises(GrammarError):
            check_json_schema(bad)
    with pytest.raises(GrammarError, match="larger"):
        json_grammar({"type": "object", "description": "x" * 70_000})
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(json_schema={"type": "nope"}).validate()
    assert e.value.param == "json_schema"


def test_mask_applies_inside_the_batched_sampler():
    logits = torch.randn(3, 10)
    allowed = torch.zeros(2, 10, dtype=torch.bool)
    allowed[0, 7], allowed[1, [2, 5]] = True, True
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
    ]
    gens = [p.make_generator() for p in params]
    free = sample(logits, params, gens)[0]
    tokens, _ = sample(logits, params, gens, allowed=([0, 2], allowed))
    assert tokens[0] == 7 and tokens[1] == free[1] and tokens[2] in (2, 5)


def test_schema_outputs_are_valid_20_of_20(engine):
    """20 seeded samples (temperature 1) under a schema: every one complete and valid."""
    tok = engine.tokenizer
    prompts = [tok.encode(f"Forecast number {i} as JSON:") for i in range(20)]
    params = [SamplingParams(max_tokens=128, seed=i, json_schema=FORECAST) for i in range(20)]
    for c in engine.generate(prompts, params):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), FORECAST)


def test_json_mode_output_always_follows_the_grammar(engine):
    """JSON mode (any object): a random-weight model's strings end only when it happens to sample
    a quote, so some outputs hit max_tokens; every output must still be a prefix of valid JSON,
    and every one that stopped must parse as an object."""
    tok = engine.tokenizer
    prompts = [tok.encode(f"Any JSON {i}:") for i in range(20)]
    params = [SamplingParams(max_tokens=48, seed=i, json_schema={"type": "object"}) for i in range(20)]
    checker = llg.LLTokenizer(
        tok.to_json(), n_vocab=engine.cfg.vocab_size, eos_token=engine.cfg.eos_token_ids
    )
    stopped = 0
    for c in engine.generate(prompts, params):
        matcher = llg.LLMatcher(checker, json_grammar({"type": "object"}), log_level=0)
        assert matcher.validate_tokens(c.token_ids) == len(c.token_ids), c.text
        if c.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(c.text), dict)
    assert stopped > 0


def test_greedy_and_penalties_and_min_tokens_stay_within_the_grammar(engine):
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=128, temperature=0.0, json_schema=FORECAST, min_tokens=5,
                            repetition_penalty=1.3, logit_bias={tok.encode("}", add_bos=False)[0]: 50.0})  # fmt: skip
    c = engine.generate([tok.encode("Forecast:")], params)[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), FORECAST)


def test_a_resumed_request_continues_its_grammar(engine):
    """Failover resumes a request by prefilling its prompt + the output produced elsewhere: the
    grammar picks up after that output, and output that breaks the grammar is refused."""
    tok = engine.tokenizer
    prompt = tok.encode("Forecast:")
    params = SamplingParams(max_tokens=128, temperature=0.0, json_schema=FORECAST)
    whole = engine.generate([prompt], params)[0]
    head = whole.token_ids[:10]
    rid = engine.add_request(prompt + head, SamplingParams(max_tokens=118, temperature=0.0, json_schema=FORECAST),
                             resumed=(10, len(tok.decode(head))))  # fmt: skip
    rest = []
    while engine.has_unfinished():
        rest += [t for o in engine.step().outputs if o.request_id == rid for t in o.token_ids]
    assert head + rest == whole.token_ids
    with pytest.raises(RequestError, match="grammar"):
        engine.add_request(prompt + tok.encode("nope", add_bos=False), params, resumed=(4, 4))


def test_structured_output_needs_a_tokenizer_and_a_valid_schema(engine):
    with pytest.raises(SamplingParamError):
        engine.add_request([1, 2], SamplingParams(json_schema={"type": 5}))
    assert not engine.has_unfinished()


def test_schemas_that_fail_on_their_first_mask_are_refused(engine):
    with pytest.raises(RequestError, match="json_schema"):
        engine.add_request(engine.tokenizer.encode("x"), SamplingParams(json_schema={"$ref": "#"}))
    assert not engine.has_unfinished()


def test_tools_are_described_to_templates_that_do_not_render_them(engine):
    from services.engine.tokenizer import Tokenizer

    tok = engine.tokenizer
    plain = Tokenizer(
        tok._tok,
        tok.bos_token,
        tok.eos_token,
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}",
    )
    tools = [
        {
            "type": "function",
            "function": {"name": "get_time", "description": "Now", "parameters": {"type": "object"}},
        }
    ]
    text = plain.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert text.startswith("[system]## Tools") and "### get_time" in text and text.endswith("[user]hi")
    text = plain.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools=tools
    )
    assert text.startswith("[system]Be brief.\n\n## Tools")
    turn = [{"role": "user", "content": "t?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"}, {"role": "user", "content": "thanks"}]  # fmt: skip
    assert tok.apply_chat_template(turn).endswith("<｜tool▁outputs▁end｜><｜User｜>thanks<｜Assistant｜>")
