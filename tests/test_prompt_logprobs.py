"""Prompt logprobs (SamplingParams.prompt_logprobs, what completions' `echo` + `logprobs` and
vLLM's `prompt_logprobs` return): equal to log_softmax of transformers' logits over the whole
prompt, whole or chunked prefill, batched with other requests, never from a prefix-cache hit
that skipped the positions, bounded in rows per step, resumed requests not scored twice."""

import pytest
import torch

from services.engine import scheduler
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .hf_oracle import V3_YARN, load_hf, make_hf_checkpoint, random_prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("plp") / "v3", rope_parameters=V3_YARN)
    return path, load_hf(path)


@torch.no_grad()
def _expected(hf, prompt: list[int]) -> torch.Tensor:
    """[P-1] logprob of each prompt token after the first under transformers' full forward."""
    lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def _check(completion, hf, prompt, n):
    got = completion.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    want = _expected(hf, prompt)
    torch.testing.assert_close(torch.tensor([e.token_logprob for e in got[1:]]), want, atol=1e-4, rtol=1e-4)
    for e in got[1:]:
        assert len(e.top) == n and e.rank >= 1
        assert (e.rank == 1) == (e.top[0][1] <= e.token_logprob + 1e-6) if n else True


@pytest.mark.parametrize("chunk", [512, 40])
def test_prompt_logprobs_match_transformers(checkpoint, chunk):
    path, hf = checkpoint
    engine = LocalEngine(EngineConfig(model=str(path), max_num_batched_tokens=chunk, max_num_seqs=4))
    prompts = random_prompts(320, seed=chunk, lengths=[2, 37, 150])
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=n) for n in (0, 2, 5)]
    plain = SamplingParams(max_tokens=3, temperature=0.0)  # batched alongside, asks for none
    outs = engine.generate([*prompts, prompts[1]], [*params, plain])
    for completion, prompt, p in zip(outs, prompts, params, strict=False):
        _check(completion, hf, prompt, p.prompt_logprobs)
    assert outs[3].prompt_logprobs is None
    assert outs[3].token_ids == outs[1].token_ids  # (the scored request generates the same tokens)


def test_prefix_cache_hit_still_scores_every_position(checkpoint):
    path, hf = checkpoint
    engine = LocalEngine(EngineConfig(model=str(path), max_num_batched_tokens=512))
    prompt = random_prompts(320, seed=7, lengths=[200])[0]
    engine.generate([prompt], SamplingParams(max_tokens=1))  # registers the prefix
    first_hits = engine.scheduler.prefix_hit_tokens
    (completion,) = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert engine.scheduler.prefix_hit_tokens == first_hits  # no hit taken for it
    _check(completion, hf, prompt, 1)
    engine.generate([prompt], SamplingParams(max_tokens=1))  # and the cache still serves others
    assert engine.scheduler.prefix_hit_tokens > first_hits


def test_rows_per_step_are_bounded(checkpoint, monkeypatch):
    """A long prompt asking for prompt logprobs prefills PROMPT_LOGPROBS_CHUNK tokens per step
    (each of its rows makes a [vocab] logits row), other requests unaffected."""
    path, hf = checkpoint
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK", 32)
    engine = LocalEngine(EngineConfig(model=str(path), max_num_batched_tokens=512))
    prompt = random_prompts(320, seed=3, lengths=[100])[0]
    engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    chunks = []
    while engine.has_unfinished():
        result = engine.step()
        chunks.append(result.num_tokens)
        assert result.logits is None or result.logits.shape[0] <= 1  # (the sampled rows only)
    assert chunks == [32, 32, 32, 4]


def test_preempted_request_is_not_scored_twice(checkpoint):
    """Preemption recomputes the prompt; the positions already scored are not scored again."""
    path, hf = checkpoint
    engine = LocalEngine(EngineConfig(model=str(path), max_num_batched_tokens=64))
    prompt = random_prompts(320, seed=5, lengths=[150])[0]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    engine.step()  # the first 64 positions
    seq = engine.scheduler._by_id[rid]
    assert len(seq.prompt_logprobs) == 65
    engine.scheduler._preempt(seq)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.request_id == rid]
    first = next(o for o in outs if o.prompt_logprobs is not None)
    assert sum(o.prompt_logprobs is not None for o in outs) == 1
    torch.testing.assert_close(torch.tensor([e.token_logprob for e in first.prompt_logprobs[1:]]),
                               _expected(hf, prompt), atol=1e-4, rtol=1e-4)  # fmt: skip


def test_bad_values_are_refused():
    for bad in (-1, 21, 2.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()


def test_prompt_rows_are_bounded_per_step_over_all_requests(checkpoint, monkeypatch):
    """Several requests asking for prompt logprobs share one step's PROMPT_LOGPROBS_CHUNK rows."""
    path, hf = checkpoint
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK", 40)
    engine = LocalEngine(EngineConfig(model=str(path), max_num_batched_tokens=512))
    rows, schedule = [], engine.scheduler.schedule

    def recording():
        chunks = schedule()
        rows.append(sum(len(c.prompt_rows) for c in chunks))
        return chunks

    engine.scheduler.schedule = recording
    prompts = random_prompts(320, seed=11, lengths=[100, 90, 30])
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert max(rows) == 40 and sum(rows) == 99 + 89 + 29
    for c, p in zip(outs, prompts, strict=True):
        _check(c, hf, p, 0)
