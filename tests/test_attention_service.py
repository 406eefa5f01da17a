"""The attention worker's engine thread and streaming (no Ray: the actor is a thin shell)."""

import asyncio
import random
import time

import pytest

from services.attention.worker import AttentionService, AttentionWorkerConfig
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.scheduler import QueueFullError, RequestError

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 384) for _ in range(rng.randint(1, 120))] for _ in range(n)]


@pytest.fixture
def service(tiny_model):
    engine = LocalEngine(
        EngineConfig(model=str(tiny_model), max_num_seqs=8, max_num_batched_tokens=64, max_waiting=4)
    )
    svc = AttentionService(AttentionWorkerConfig(engine=engine.engine_cfg), engine)
    yield svc
    svc.close()


async def _collect(svc, prompt, params, rid, delay=0.0):
    await asyncio.sleep(delay)
    tokens = []
    async for out in svc.generate(prompt, params, rid):
        tokens += out.token_ids
        last = out
    return tokens, last.finish_reason


def test_concurrent_streams_equal_running_alone(service, tiny_model):
    prompts = _prompts(6)
    alone = LocalEngine(EngineConfig(model=str(tiny_model))).generate(prompts, GREEDY)

    async def main():
        return await asyncio.gather(
            *[_collect(service, p, GREEDY, f"r{i}", delay=0.01 * i) for i, p in enumerate(prompts)]
        )

    results = asyncio.run(main())
    assert [r[0] for r in results] == [a.token_ids for a in alone]
    assert all(r[1] == "length" for r in results)


def test_consumer_going_away_aborts_and_frees_blocks(service):
    async def main():
        gen = service.generate(
            _prompts(1)[0], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), "x"
        )
        async for _ in gen:
            break
        await gen.aclose()
        e, deadline = service.engine, time.monotonic() + 30
        while True:  # the abort reaches the engine thread at its next step boundary
            state = await service.between_steps(
                lambda: (e.has_unfinished(), e.scheduler.num_free_blocks, e.cache.num_blocks)
            )
            if not state[0] or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.02)

    busy, free, total = asyncio.run(main())
    assert not busy and free == total


def test_refused_requests_raise_to_the_caller(service):
    async def main():
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await service.submit([0, 10**6], GREEDY, "bad")
        with pytest.raises(ValueError, match="top_p"):
            await service.submit([0, 5], SamplingParams(top_p=0.0), "bad2")
        # the bounded waiting queue (4) refuses requests before 8 running + 4 waiting are exceeded
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        accepted = 0
        with pytest.raises(QueueFullError):
            for i in range(13):
                await service.submit([0, 5, i + 4], long, f"q{i}")
                accepted += 1
        for i in range(accepted):
            service.abort(f"q{i}")
        return accepted

    assert 4 <= asyncio.run(main()) <= 12


class _FlakyExperts:
    """Wraps a backend; fails the first `n` dispatches (like a dead expert worker)."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def dispatch(self, msg):
        if self.n > 0:
            self.n -= 1
            raise ConnectionError("expert worker unavailable")
        return self.inner.dispatch(msg)

    def combine(self, msg):
        return self.inner.combine(msg)


def test_failing_steps_are_retried_then_fail_requests_with_an_error(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    ref = engine.generate([[0, 5, 6]], GREEDY)[0].token_ids
    engine.experts = _FlakyExperts(engine.experts, 3)
    svc = AttentionService(AttentionWorkerConfig(engine=engine.engine_cfg, step_retry_s=30), engine)
    try:
        tokens, reason = asyncio.run(_collect(svc, [0, 5, 6], GREEDY, "a"))
        assert tokens == ref and reason == "length" and svc.times.failed_steps == 3
        engine.experts.n = 10**9
        svc.cfg.step_retry_s = 0.2

        async def failed():
            outs = [o async for o in svc.generate([0, 5, 6], GREEDY, "b")]
            return outs[-1]

        last = asyncio.run(failed())
        assert last.finish_reason == "error" and "unavailable" in last.error
        assert engine.scheduler.num_free_blocks == engine.cache.num_blocks
    finally:
        svc.close()


class _DownFor:
    """Wraps a backend; every dispatch fails until `seconds` after the first one."""

    def __init__(self, inner, seconds):
        self.inner, self.seconds, self.since = inner, seconds, None

    def dispatch(self, msg):
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since < self.seconds:
            raise ConnectionError("expert worker unavailable")
        return self.inner.dispatch(msg)

    def combine(self, msg):
        return self.inner.combine(msg)


def test_a_failed_step_fails_only_the_requests_in_it(tiny_model):
    cfg = EngineConfig(model=str(tiny_model), max_num_seqs=1, max_num_batched_tokens=64)
    engine = LocalEngine(cfg)
    ref = engine.generate([[0, 9, 8]], GREEDY)[0].token_ids
    engine.experts = _DownFor(engine.experts, 1.5)
    svc = AttentionService(
        AttentionWorkerConfig(engine=cfg, step_retry_s=1.0, step_retry_wait_s=0.01), engine
    )
    try:

        async def both():
            first = asyncio.ensure_future(_collect(svc, [0, 5, 6], GREEDY, "in-step"))
            deadline = time.monotonic() + 30
            while engine.experts.since is None:  # "in-step" is in a (failing) step; then "waiting"
                assert time.monotonic() < deadline  # queues behind it: max_num_seqs=1
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(_collect(svc, [0, 9, 8], GREEDY, "waiting"))
            return await first, await second

        (_, first_reason), (tokens, reason) = asyncio.run(both())
        assert first_reason == "error"  # it was in the failing step for longer than step_retry_s
        assert tokens == ref and reason == "length"  # it was not: it runs once the experts are back
    finally:
        svc.close()
