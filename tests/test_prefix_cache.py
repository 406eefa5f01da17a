"""Automatic prefix caching over the paged latent cache: the allocator, the scheduler under
random schedules (no leak, no shared block ever written, hits hold the right tokens), the
engine's outputs with caching on and off, and prefix-affinity routing."""

import random

import pytest
import torch

from services.engine.block_allocator import BlockAllocator, block_hash
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.scheduler import RequestError, Scheduler, SchedulerConfig, SeqStatus, Sequence
from services.model.kv_cache import BLOCK_SIZE
from services.router.affinity import PrefixAffinity

from .hf_oracle import run_requests


def test_allocator_shares_caches_and_evicts_least_recently_freed():
    a = BlockAllocator(4)
    x, y = a.allocate(2)
    a.register(x, 11)
    a.register(y, 22)
    assert a.lookup([11, 22, 33]) == [x, y] and a.refs(x) == 2  # shared
    a.free([x, y])
    a.free([x, y])  # both unreferenced now: cached, still allocatable
    assert a.num_free == 4 and a.num_cached == 2
    assert a.lookup([11]) == [x] and a.num_free == 3
    a.free([x])  # x freed last: y is the least recently freed
    fresh = a.allocate(3)  # two free blocks, then evicts y
    assert y in fresh and x not in fresh and a.lookup([22]) == [] and a.lookup([11]) == [x]
    with pytest.raises(ValueError, match="freed twice"):
        a.free([x, x])
    off = BlockAllocator(2, caching=False)
    b = off.allocate(1)
    off.register(b[0], 5)
    assert off.lookup([5]) == [] and off.num_cached == 0


def test_a_cached_copy_without_state_gives_way_to_one_with_it():
    """DeepSeek-V4: a cached block whose state block was taken back is replaced, in the prefix
    cache, by a recomputed copy that has its state (else the prefix would never hit again)."""
    a = BlockAllocator(4, num_state_blocks=2)
    (x,) = a.allocate(1)
    a.hold_state([x])
    a.register(x, 11)
    a.release_state([x])
    a.free([x])  # cached, its state idle
    assert a.state(x) >= 0 and a.num_free_states == 2
    y, z = a.allocate(2)
    a.hold_state([y, z])  # the second takes x's idle state back
    assert a.state(x) == -1 and a.lookup([11]) == [x]
    a.free([x])
    a.register(y, 11)  # y recomputed x's tokens and holds its state: it takes the hash
    a.release_state([y])  # (idle now, kept: y is registered)
    assert a.lookup([11]) == [y] and a.num_cached == 1 and a.block_states[x] == -1 and a.state(y) >= 0
    a.free([y, y])
    assert a.num_free == 3 and a.lookup([11]) == [y]  # x went back to the free list, z is held
    v3 = BlockAllocator(2)  # without state blocks nothing changes: the first copy stays
    p, q = v3.allocate(2)
    v3.register(p, 5)
    v3.register(q, 5)
    assert v3.lookup([5]) == [p]


def _content_check(sched: Scheduler, chunks, written: dict[int, dict[int, int]]) -> None:
    """Play the model's cache writes for `chunks`: every written row must land in a block that
    its sequence alone holds and nobody registered; record what each row holds."""
    alloc = sched.allocator
    for c in chunks:
        seq = c.seq
        for p in range(c.start, c.start + c.num_tokens):
            block = seq.block_ids[p // BLOCK_SIZE]
            assert alloc.refs(block) == 1 and not alloc.is_registered(block), "write into a shared block"
            written.setdefault(block, {})[p % BLOCK_SIZE] = seq.token_slice(p, p + 1)[0]


def _state_check(sched: Scheduler, chunks, states: dict[int, dict[int, tuple[int, int]]]) -> None:
    """DeepSeek-V4: every chunk finds its lookback rows (from `state_start`) in the state blocks
    attached to its blocks, still holding those blocks' tokens, and writes its own rows into
    them; `states` records (block, token) per state block row."""
    alloc = sched.allocator
    for c in chunks:
        seq = c.seq
        for p in range(sched.state_start(c.start), c.start + c.num_tokens):
            block = seq.block_ids[p // BLOCK_SIZE]
            state = alloc.state(block)
            assert state >= 0, f"position {p}: block {block} has no state block"
            row = (block, seq.token_slice(p, p + 1)[0])
            if p < c.start:
                assert states[state][p % BLOCK_SIZE] == row, "a state row was lost or overwritten"
            else:
                states.setdefault(state, {})[p % BLOCK_SIZE] = row


def _hit_check(seq: Sequence, written: dict[int, dict[int, int]]) -> None:
    """The rows of every block a sequence reuses hold exactly its own tokens."""
    for i in range(seq.num_computed // BLOCK_SIZE if seq.num_cached_tokens else 0):
        rows = written[seq.block_ids[i]]
        assert [rows[j] for j in range(BLOCK_SIZE)] == seq.token_slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)


def _accounting(sched: Scheduler) -> None:
    alloc = sched.allocator
    held: dict[int, int] = {}
    for seq in sched.running:
        for b in seq.block_ids:
            held[b] = held.get(b, 0) + 1
    assert held == alloc._refs  # every reference is a running sequence's
    assert len(alloc._free) + len(alloc._cached) + len(alloc._refs) == alloc.num_blocks
    assert not set(alloc._free) & set(alloc._cached)
    held_states: dict[int, int] = {}
    for seq in sched.running:
        for i in seq.state_blocks:
            held_states[seq.block_ids[i]] = held_states.get(seq.block_ids[i], 0) + 1
    assert held_states == alloc._state_refs  # every state reference is a running sequence's
    assert set(alloc._idle_states) == set(alloc._state_of) - set(alloc._state_refs)
    assert set(alloc._idle_states) <= set(alloc._hash_of)  # only cached prefixes keep idle states
    pool = set(alloc._state_of.values()) | set(alloc._free_states)  # no state block in two places
    assert (
        len(pool)
        == len(alloc._state_of) + len(alloc._free_states)
        == alloc.num_free_states + len(held_states)
    )


def _v4_state_start(end: int) -> int:
    """ModelConfig.v4_state_start of a sliding window of 8, CSA every 4 and HCA every 24 tokens."""
    return max(0, min(end - 7, (end // 4 - 1) * 4, end // 24 * 24))


@pytest.mark.parametrize("v4", [False, True], ids=["v3", "v4-state-blocks"])
@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_never_leak_or_corrupt_a_block(seed, v4):
    """Random requests sharing prefixes, aborts and preemptions; with DeepSeek-V4's state blocks
    (a pool of 2 to 12, 2 being one sequence's need) also: no state row lost while read."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 300) for _ in range(rng.choice([64, 100, 130, 200]))] for _ in range(3)]
    v4_args = (_v4_state_start, rng.choice([2, 3, 5, 12])) if v4 else ()
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=rng.choice([48, 96, 256])),
                      rng.choice([12, 20, 40]), (), True, *v4_args)  # fmt: skip
    written: dict[int, dict[int, int]] = {}
    states: dict[int, dict[int, tuple[int, int]]] = {}
    live: list[Sequence] = []
    hits = 0
    for step in range(400):
        if rng.random() < 0.3 and len(sched.waiting) < 8:  # a request sharing some prefix
            p = rng.choice(prefixes)
            prompt = p[: rng.randint(1, len(p))] + [rng.randrange(4, 300) for _ in range(rng.randint(0, 40))]
            seq = Sequence(prompt, SamplingParams(max_tokens=rng.randint(1, 70), ignore_eos=True))
            sched.add(seq)  # (at most 310 tokens: 5 blocks, always room; an error here is a bug)
            live.append(seq)
        if step % 50 == 0:  # one that can never fit is refused by name, and changes nothing
            too_long = Sequence(
                list(range(4, 4 + BLOCK_SIZE)),
                SamplingParams(max_tokens=sched.allocator.num_blocks * BLOCK_SIZE),
            )
            waiting = list(sched.waiting)
            with pytest.raises(RequestError, match="KV cache") as refused:
                sched.add(too_long)
            assert refused.value.param == "max_tokens" and list(sched.waiting) == waiting
            assert sched.finish_id(too_long.request_id, "abort") is None  # (never registered)
        if live and rng.random() < 0.05:  # an abort
            sched.finish_id(rng.choice(live).request_id, "abort")
        chunks = sched.schedule()
        for c in chunks:
            if c.start == c.seq.num_computed and c.seq.num_cached_tokens:
                _hit_check(c.seq, written)
        hits += sum(1 for c in chunks if c.seq.num_cached_tokens)
        _content_check(sched, chunks, written)
        if v4:
            _state_check(sched, chunks, states)
        want = [c for c in chunks if c.wants_logits]
        sched.update(chunks, [rng.randrange(4, 300) for _ in want], [None] * len(want))
        _accounting(sched)
        live = [s for s in live if s.status is not SeqStatus.FINISHED]
    for seq in list(sched.running) + list(sched.waiting):
        sched.finish(seq, "abort")
    _accounting(sched)
    assert sched.allocator.num_free == sched.allocator.num_blocks  # nothing leaked
    assert sched.allocator.num_free_states == (v4_args[1] if v4 else 0)
    if not v4 or v4_args[1] >= 5:  # (a pool of two takes every idle state back: no hit is usable)
        assert hits > 0 and sched.prefix_hit_tokens > 0


def _prompts(base):
    a = base[:200]
    return {
        "A": a,
        "B (prefix of A, hit ends mid-block)": a[:150],
        "C (A and more)": a + base[200:240],
        "D (A again)": list(a),
        "E (one block exactly)": a[:64],
        "F (other)": base[300:420],
    }


@pytest.mark.parametrize("max_batched", [2048, 64])  # whole and chunked prefill
def test_greedy_outputs_are_identical_with_caching_on_and_off(tiny_model, max_batched):
    g = torch.Generator().manual_seed(3)
    prompts = _prompts([0] + torch.randint(4, 384, (500,), generator=g).tolist())
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (False, True):
        engine = LocalEngine(EngineConfig(model=str(tiny_model), max_num_batched_tokens=max_batched,
                                          prefix_caching=caching))  # fmt: skip
        first, first_logits, _ = run_requests(engine, [prompts["A"]], params)  # A fills the cache
        rest, rest_logits, _ = run_requests(engine, list(prompts.values())[1:], params)
        results[caching] = (first + rest, first_logits + rest_logits, engine.stats()["prefix_cache"])
    (off, off_logits, _), (on, on_logits, stats) = results[False], results[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    for a, b in zip(on_logits, off_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert stats["hit_tokens"] == 128 + 192 + 192  # B: 2 blocks; C, D: 3 (never the last token's)


def test_cached_tokens_are_reported_per_request(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    prompt = [0] + list(range(4, 204))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = engine.add_request(prompt, params)
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step().outputs}
        if first in outs:
            assert outs[first].num_cached_tokens == 0
    second = engine.add_request(prompt, params)
    outs = {o.request_id: o for o in engine.step().outputs}
    assert outs[second].num_cached_tokens == 192


def test_cache_salts_isolate_prefixes(tiny_model):
    """vLLM's cache_salt: requests with different salts (or one salted, one not) never share a
    block, so `cached_tokens` tells nothing across them; the same salt hits as before. Outputs
    do not depend on the salt."""
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    prompt = [0] + list(range(4, 204))

    def run(salt):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                        cache_salt=salt))  # fmt: skip
        cached, tokens = None, []
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.request_id == rid:
                    cached = o.num_cached_tokens if cached is None else cached
                    tokens += o.token_ids
        return cached, tokens

    first = run("tenant-a")
    assert first[0] == 0
    assert run("tenant-b")[0] == 0 and run(None)[0] == 0  # another salt, no salt: nothing shared
    assert run("tenant-a") == (192, first[1])  # the same salt: 3 full blocks, the same tokens
    assert run(None)[0] == 192 and run("tenant-b")[0] == 192  # each its own
    aff = PrefixAffinity()
    aff.record(prompt, "w", cache_salt="tenant-a")
    assert aff.choose(prompt, {"w": 0, "v": 0}, cache_salt="tenant-a") == "w"
    # another salt is another prefix: not b's record, where its own first block hashes
    assert aff.choose(prompt, {"w": 0, "v": 0}, cache_salt="tenant-b") == PrefixAffinity().choose(
        prompt, {"w": 0, "v": 0}, cache_salt="tenant-b"
    )


def test_affinity_follows_the_prefix_unless_that_worker_is_too_busy():
    aff = PrefixAffinity(max_imbalance_tokens=100)
    shared = list(range(200))
    first = aff.choose(shared + [1], {"a": 0, "b": 0})  # nothing known yet: where its first block hashes
    other_replica = PrefixAffinity(max_imbalance_tokens=100)
    assert first in ("a", "b") and other_replica.choose(shared[:64] + [9] * 70, {"a": 0, "b": 0}) == first
    aff.record(shared + [1], "b")
    assert aff.choose(shared + [2, 3], {"a": 0, "b": 50}) == "b"  # shares 3 full blocks with b
    assert aff.choose(shared + [2, 3], {"a": 0, "b": 500}) == "a"  # b is too busy
    assert aff.choose(shared[:63], {"a": 0, "b": 0}) is None  # no full block: the least busy
    spread = {PrefixAffinity().choose([7 + i] * 100, {"a": 0, "b": 0, "c": 0}) for i in range(30)}
    assert spread == {"a", "b", "c"}  # (unseen prefixes spread over the workers)
    h = PrefixAffinity.hashes(shared, 8)
    assert len(h) == 3 and h[0] == block_hash(None, shared[:64])


def test_eviction_takes_a_prefix_from_its_tail(tiny_model):
    """Freed blocks are cached last-block-first: evicting one keeps the head of the prefix usable."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512), num_blocks=5)
    prompt = list(range(4, 4 + 4 * BLOCK_SIZE + 1))  # 4 full blocks + 1 token
    first = Sequence(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add(first)
    while sched.has_work():
        chunks = sched.schedule()
        sched.update(
            chunks, [9] * sum(c.wants_logits for c in chunks), [None] * sum(c.wants_logits for c in chunks)
        )
    sched.allocator.free(sched.allocator.allocate(2))  # the free block, then one cached block: evicts one
    again = Sequence(list(prompt), SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 3 * BLOCK_SIZE  # blocks 0-2 still there, block 3 went


def test_out_of_vocabulary_stop_tokens_are_refused(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.add_request([0, 5], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]))
