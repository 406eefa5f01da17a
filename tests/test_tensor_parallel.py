"""Attention tensor parallelism with real processes and real collectives (torch.distributed,
gloo), no Ray: rank 0 runs the engine in this process, followers run in spawned processes."""

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from services.attention.tensor_parallel import TPGroup, lead, pack_batches, run_follower, unpack_batches
from services.engine.engine import Engine, EngineConfig, LocalEngine, load_engine
from services.engine.sampling import SamplingParams
from services.model.batch import StepBatch
from services.net import free_port

from .hf_oracle import generate_with_logits, run_requests

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(5)
    lengths = (3, 70, 9, 130, 1)  # chunked prefill at max_num_batched_tokens=64
    return [[0] + torch.randint(4, 384, (n,), generator=g).tolist() for n in lengths]


class _FailsFirst:
    """Wraps a backend: the first `n` combines raise (the routed experts failed)."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def dispatch(self, msg):
        return self.inner.dispatch(msg)

    def combine(self, msg):
        if self.n > 0:
            self.n -= 1
            raise ConnectionError("expert worker unavailable")
        return self.inner.combine(msg)


def _tp_run(engine_cfg: EngineConfig, tp: int, prompts, failures: int = 0, prepare=None):
    """Generate with rank 0 here and tp-1 follower processes; (outputs, logits, follower steps).
    prepare(engine): called on rank 0's engine before it runs."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(tp - 1) as pool:
        followers = [pool.apply_async(run_follower, (engine_cfg, r, tp, init_method)) for r in range(1, tp)]
        cfg, model, experts, tokenizer = load_engine(engine_cfg)
        group = TPGroup(0, tp, init_method)
        try:
            experts, on_batches, on_mtp_pass = lead(group, model, _FailsFirst(experts, failures))
            engine = Engine(cfg, model, experts, engine_cfg, tokenizer, on_batches, on_mtp_pass)
            if prepare is not None:
                prepare(engine)
            done = run_requests(engine, prompts, GREEDY, retry_failed_steps=True)
            assert experts.inner.n == 0  # every planned failure happened
            group.stop()
            steps = [f.get(timeout=120) for f in followers]
        finally:
            group.close()
    return done[0], done[1], steps


def test_step_layout_survives_the_wire():
    a = StepBatch.build([([5, 6, 7], 0, [3], True), ([9], 64, [1, 2], True)], decode_upto=3, keep_hidden=True)
    b = StepBatch.build(
        [([1, 2], 5, [7], False)], block_states=torch.arange(10, 20, dtype=torch.int32)
    )  # V4's
    assert a.state_table is None and b.state_table.tolist() == [[17]]
    for got, want in zip(unpack_batches(pack_batches([a, b]), torch.device("cpu")), [a, b], strict=True):
        assert (got.query_lens, got.decode_upto, got.keep_hidden) == (
            want.query_lens,
            want.decode_upto,
            want.keep_hidden,
        )
        for field in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table", "logits_index"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert (got.state_table is None) == (want.state_table is None)
    assert torch.equal(got.state_table, b.state_table) and b.block_table.tolist() == [[7]]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_tp2_equals_one_process(tiny_model, micro_batches):
    """Whole and chunked prefill, decode, with and without ping-pong: tokens equal, logits close."""
    engine_cfg = EngineConfig(model=str(tiny_model), max_num_batched_tokens=64, micro_batches=micro_batches,
                              num_kv_blocks=64)  # fmt: skip
    prompts = _prompts()
    want, want_logits = generate_with_logits(LocalEngine(engine_cfg), prompts, GREEDY)
    got, got_logits, steps = _tp_run(engine_cfg, 2, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert steps[0] >= GREEDY.max_tokens  # the follower ran every step
    assert not dist.is_initialized()


def test_a_step_whose_experts_fail_is_dropped_by_every_rank_and_retried(tiny_model):
    engine_cfg = EngineConfig(model=str(tiny_model), max_num_batched_tokens=64, num_kv_blocks=64)
    prompts = _prompts()[:2]
    want, _ = generate_with_logits(LocalEngine(engine_cfg), prompts, GREEDY)
    got, _, _ = _tp_run(engine_cfg, 2, prompts, failures=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tp2_deepseek_v4_equals_one_process(tmp_path, kv_cache_dtype):
    """DeepSeek-V4 (tiny-v4: sliding, CSA and HCA layers): heads and output groups split over 2
    ranks, compressors and indexer replicated; prompts long enough to compress and select; the
    cache in the model's dtype or FP8 (each rank writes the same rows; the ranks' summed outputs,
    ~1e-6 from one process's, move a few values across an e4m3 rounding step: 9e-4 in the logits)."""
    from services.presets import init_model

    path = init_model(tmp_path / "tiny-v4", "tiny-v4", seed=0)
    engine_cfg = EngineConfig(model=str(path), max_num_batched_tokens=64, num_kv_blocks=64,
                              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    prompts = _prompts()[:4]
    want, want_logits = generate_with_logits(LocalEngine(engine_cfg), prompts, GREEDY)
    got, got_logits, _ = _tp_run(engine_cfg, 2, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 if kv_cache_dtype == "auto" else 5e-3)


@pytest.mark.parametrize("preset", ["tiny", "tiny-v4"])
def test_tp2_speculating_equals_one_process_without(tmp_path, preset):
    """Speculative decoding (2 draft tokens, chained) on 2 ranks, V3 and V4: every MTP pass runs on
    both ranks (their heads split, the routed results shared); a random head of each step's drafts
    replaced by the true next tokens, so steps accept some and reject the next. Greedy tokens equal
    one process's without speculation, and the module's own drafts one speculating process's."""
    import dataclasses
    import random

    from services.presets import init_model

    path = init_model(tmp_path / preset, preset, seed=0, mtp=True, tokenizer=False)
    engine_cfg = EngineConfig(model=str(path), max_num_batched_tokens=64, num_kv_blocks=64, speculative_tokens=2,
                              speculative_disable_by_batch_size=1 << 20)  # fmt: skip
    prompts = _prompts()[:4]
    want, _ = generate_with_logits(
        LocalEngine(dataclasses.replace(engine_cfg, speculative_tokens=0)), prompts, GREEDY
    )
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, want, strict=True)}
    rng, stats, drafted = random.Random(0), {}, []

    def oracle(engine):
        rng.seed(0)
        drafted.clear()
        original = engine.spec.draft

        def draft(parts, *args):
            original(parts, *args)
            for seq in (c.seq for part in parts for c in part):
                ref = reference[tuple(seq.prompt_ids)][len(seq.output_ids) :]
                if seq.draft:
                    drafted.append((prompts.index(seq.prompt_ids), len(seq.output_ids), list(seq.draft)))
                if seq.draft and ref and rng.random() < 0.8:
                    n = rng.randint(1, len(seq.draft))
                    seq.draft = ref[:n] + seq.draft[n:]
            stats.update(engine.stats()["spec_decode"])

        engine.spec.draft = draft

    one = LocalEngine(engine_cfg)
    oracle(one)
    run_requests(one, prompts, GREEDY)
    one_process = list(drafted)
    got, _, steps = _tp_run(engine_cfg, 2, prompts, prepare=oracle)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert steps[0] < GREEDY.max_tokens  # (the follower ran fewer steps than tokens: drafts were accepted)
    assert drafted == one_process  # (the module's heads split over the ranks too)
