"""LocalEngine behaviour: continuous batching, paging, preemption, sampling, stops, CLI."""

import json
import random
import subprocess
import sys

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.scheduler import RequestError

from .hf_oracle import generate_with_logits

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LocalEngine(EngineConfig(model=str(tiny_model), max_num_seqs=8, max_num_batched_tokens=64))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 384) for _ in range(rng.randint(1, 150))] for _ in range(n)]


def _alone(engine, prompts, params=GREEDY):
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def test_batched_staggered_requests_equal_running_alone(engine):
    prompts = _prompts(6)
    alone = _alone(engine, prompts)
    ids, results = [], {}
    for i, p in enumerate(prompts):  # a new request arrives every 3 steps
        ids.append(engine.add_request(p, GREEDY))
        for _ in range(3 if i < len(prompts) - 1 else 0):
            for out in engine.step().outputs:
                results.setdefault(out.request_id, []).extend(out.token_ids)
    while engine.has_unfinished():
        for out in engine.step().outputs:
            results.setdefault(out.request_id, []).extend(out.token_ids)
    assert [results[r] for r in ids] == alone
    assert engine.scheduler.num_free_blocks == engine.cache.num_blocks


def test_page_assignment_does_not_change_outputs(tiny_model):
    prompts = _prompts(4, seed=1)
    ref = LocalEngine(EngineConfig(model=str(tiny_model))).generate(prompts, GREEDY)
    shuffled = LocalEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=40))
    random.Random(3).shuffle(shuffled.scheduler.allocator._free)  # scatter blocks over the cache
    out = shuffled.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_preemption_under_a_small_cache_keeps_outputs(tiny_model):
    # five 60-token prompts fit one block each; decoding past 64 tokens needs a second block each
    prompts = [[0] + [(7 * i + j) % 380 + 4 for j in range(59)] for i in range(5)]
    ref = LocalEngine(EngineConfig(model=str(tiny_model))).generate(prompts, GREEDY)
    tight = LocalEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=6, max_model_len=256))
    out = tight.generate(prompts, GREEDY)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert tight.scheduler.num_free_blocks == 6


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompt = _prompts(1, seed=5)[0]
    alone = engine.generate([prompt], p)[0].token_ids
    mixed = engine.generate([*_prompts(3, seed=6), prompt], [GREEDY, GREEDY, GREEDY, p])[3].token_ids
    assert alone == mixed
    other = engine.generate([prompt], SamplingParams(**{**p.__dict__, "seed": 99}))[0].token_ids
    assert other != alone


def test_top_k_one_is_greedy_and_logprobs_are_consistent(engine):
    prompt = _prompts(1, seed=7)[0]
    greedy = engine.generate([prompt], GREEDY)[0]
    topk1 = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=1.0, top_k=1, ignore_eos=True)
    )[0]
    assert topk1.token_ids == greedy.token_ids
    lp = engine.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0]
    for tok, entry in zip(lp.token_ids, lp.logprobs, strict=True):
        assert entry.top[0][0] == tok and entry.token_logprob == pytest.approx(entry.top[0][1])
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        assert entry.token_logprob <= 0


def test_top_p_and_top_k_restrict_the_support():
    from services.engine.sampling import sample

    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    for seed in range(30):
        p = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        assert sample(logits, [p], [p.make_generator()])[0][0] in (0, 1)
        p = SamplingParams(temperature=1.0, top_p=0.5, seed=seed)
        assert sample(logits, [p], [p.make_generator()])[0][0] == 0


def test_abort_frees_blocks_and_reports(engine):
    rid = engine.add_request(
        _prompts(1, seed=8)[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    )
    for _ in range(5):
        engine.step()
    assert engine.abort(rid).finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.scheduler.num_free_blocks == engine.cache.num_blocks
    assert engine.abort(rid) is None


def test_eos_and_stop_strings(engine, tiny_model):
    prompt = _prompts(1, seed=9)[0]
    free = engine.generate([prompt], GREEDY)[0]
    stop_tok = free.token_ids[5]
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_tok])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]

    tok = engine.tokenizer
    text = tok.decode(free.token_ids)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[needle], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(needle)]


def test_invalid_requests_are_refused(engine):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([0, 99999], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([0, 5], SamplingParams(temperature=-1))
    with pytest.raises(RequestError, match="context"):
        engine.add_request([0, 5], SamplingParams(max_tokens=10**6))
    assert not engine.has_unfinished()


def test_cli_generate_json(tiny_model, engine):
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "generate",
        "--model",
        str(tiny_model),
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--prompt-token-ids",
        "0,5,6,7",
        "--prompt-token-ids",
        "0,9",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    rows = [json.loads(line) for line in out]
    expect = engine.generate(
        [[0, 5, 6, 7], [0, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    assert [r["token_ids"] for r in rows] == [e.token_ids for e in expect]
    assert all(r["text"] == "" for r in rows)
    bad = subprocess.run(cmd[:-4] + ["--prompt-token-ids", "0,x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr


@pytest.mark.parametrize("option", [{"micro_batches": 2}, {"micro_batches": 3}])
def test_ping_pong_keeps_greedy_outputs(tiny_model, option):
    prompts = _prompts(5, seed=11)
    ref_engine = LocalEngine(EngineConfig(model=str(tiny_model), max_num_batched_tokens=96))
    ref, ref_logits = generate_with_logits(ref_engine, prompts, GREEDY)
    engine = LocalEngine(EngineConfig(model=str(tiny_model), max_num_batched_tokens=96, **option))
    out, logits = generate_with_logits(engine, prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max() <= 1e-4
