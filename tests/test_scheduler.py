"""The scheduler alone: admission, chunking, preemption and block accounting (no model)."""

import random

import pytest

from services.engine.block_allocator import BlockAllocator
from services.engine.sampling import SamplingParams
from services.engine.scheduler import QueueFullError, RequestError, Scheduler, SchedulerConfig, Sequence
from services.model.kv_cache import BLOCK_SIZE


def _seq(n: int, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(list(range(2, 2 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


def _run(sched: Scheduler, token: int = 7, steps: int = 10_000) -> int:
    """Run schedule/update with a fake model that always samples `token`."""
    for n in range(steps):
        chunks = sched.schedule()
        if not chunks:
            return n
        want = [c for c in chunks if c.wants_logits]
        sched.update(chunks, [token] * len(want), [None] * len(want))
    raise AssertionError("did not finish")


def test_allocator_rejects_double_free_and_overdraw():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert a.num_free == 1
    with pytest.raises(MemoryError):
        a.allocate(2)
    a.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(blocks[:1])


def test_chunked_prefill_respects_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), num_blocks=16)
    sched.add(_seq(100))
    sizes = []
    while True:
        chunks = sched.schedule()
        sizes.append([c.num_tokens for c in chunks])
        want = [c for c in chunks if c.wants_logits]
        sched.update(chunks, [7] * len(want), [None] * len(want))
        if want:
            break
    assert sizes == [[32], [32], [32], [4]]


def test_decodes_come_first_and_budget_is_shared():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), num_blocks=16)
    sched.add(_seq(4))
    _ = sched.schedule()
    sched.update(_, [7], [None])
    sched.add(_seq(40))
    chunks = sched.schedule()
    assert [c.num_tokens for c in chunks] == [1, 15]


def test_admission_waits_for_blocks_and_preemption_recomputes():
    # 4 blocks of 64: two 100-token prompts need 2 blocks each; decoding past 128 needs a third
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512), num_blocks=4)
    a, b, c = _seq(100, max_tokens=60), _seq(100, max_tokens=60), _seq(10, max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    first = sched.schedule()
    assert [ch.seq for ch in first] == [a, b]  # c waits: no free block
    sched.update(first, [7, 7], [None, None])
    _run(sched)
    assert sched.num_preemptions >= 1
    for s in (a, b, c):
        assert s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens
    assert sched.num_free_blocks == 4


def test_no_block_leaks_under_random_aborts_and_stops():
    rng = random.Random(0)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=96, max_model_len=512),
        num_blocks=12,
        eos_token_ids=(1,),
    )
    live: list[Sequence] = []
    for _ in range(400):
        if rng.random() < 0.3:
            s = _seq(rng.randint(1, 150), max_tokens=rng.randint(1, 90), stop_token_ids=[5])
            sched.add(s)
            live.append(s)
        if live and rng.random() < 0.1:
            sched.finish_id(rng.choice(live).request_id, "abort")
        chunks = sched.schedule()
        want = [c for c in chunks if c.wants_logits]
        sched.update(chunks, [rng.choice([1, 5, 9, 9, 9, 9]) for _ in want], [None] * len(want))
    _run(sched)
    assert not sched.has_work()
    assert sched.num_free_blocks == 12
    assert {s.finish_reason for s in live} <= {"stop", "length", "abort"}


def test_bad_requests_and_full_queue():
    sched = Scheduler(SchedulerConfig(max_model_len=128, max_waiting=2), num_blocks=8)
    with pytest.raises(RequestError, match="exceeds the context"):
        sched.add(_seq(100, max_tokens=40))
    with pytest.raises(RequestError, match="empty"):
        sched.add(Sequence([], SamplingParams()))
    sched.add(_seq(3))
    sched.add(_seq(3))
    with pytest.raises(QueueFullError):
        sched.add(_seq(3))
    small = Scheduler(SchedulerConfig(max_model_len=4096), num_blocks=2)
    with pytest.raises(RequestError, match="KV cache"):
        small.add(_seq(3 * BLOCK_SIZE))


def test_abort_of_unknown_or_finished_request_is_harmless():
    sched = Scheduler(SchedulerConfig(), num_blocks=4)
    assert sched.finish_id("nope", "abort") is None
    s = _seq(3, max_tokens=1)
    sched.add(s)
    _run(sched)
    assert sched.finish_id(s.request_id, "abort") is None and s.finish_reason == "length"


def test_max_model_len_up_to_the_models_own_when_the_cache_holds_it():
    """max_model_len may be the model's own (163,840 with YaRN) when the cache holds one sequence
    that long; beyond the model's, or more than the cache holds, the engine refuses to start,
    naming the numbers (a long prompt then gets a 400, never an out-of-memory)."""
    from services.engine.engine import EngineConfig
    from services.model.config import ModelConfig
    from services.presets import PRESETS

    cfg = ModelConfig.from_hf(PRESETS["small"])
    own = cfg.max_position_embeddings
    assert EngineConfig(model="-", max_model_len=own, kv_cache_gib=1.0).kv_blocks(cfg, own) * 64 >= own
    with pytest.raises(ValueError, match="beyond the model's own"):
        EngineConfig(model="-", max_model_len=own + 1).scheduler_config(cfg)
    with pytest.raises(ValueError, match=r"kv_cache_gib 0.25 holds \d+ tokens"):
        EngineConfig(model="-", max_model_len=own, kv_cache_gib=0.25).kv_blocks(cfg, own)
    assert EngineConfig(model="-", max_model_len=own, kv_cache_gib=0.25, kv_cache_dtype="fp8").kv_blocks(
        cfg, own
    )
    sched = Scheduler(SchedulerConfig(max_model_len=own), num_blocks=4)
    with pytest.raises(RequestError, match="needs 320 tokens of KV cache; it holds 256"):
        sched.add(Sequence(list(range(300)), SamplingParams(max_tokens=10)))
