"""The static-buffer decode step behind the CUDA graphs (services/model/decode_graphs.py), run
eagerly on CPU (capture=False): padding, scratch block, expert load and outputs as the eager
engine's. The capture itself runs in tests/test_cuda.py (GPU only)."""

import pytest
import torch

from services.model.decode_graphs import buckets_up_to
from services.model.engine import EngineConfig, LocalEngine
from services.model.sampling import SamplingParams


def test_buckets_cover_every_batch_size():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(6) == [1, 2, 4, 6]
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets_up_to(200)[-5:] == [96, 128, 160, 192, 200]


def run_steps(engine, prompts, params):
    """Add the prompts two steps apart (so decode steps of several sizes occur); every step's
    (request ids, logits, expert load), and the outputs."""
    pending, steps, tokens = list(prompts), [], {}
    while pending or engine.has_unfinished():
        if pending and len(steps) % 2 == 0:
            rid = engine.add_request(pending.pop(0), params)
            tokens[rid] = []
        result = engine.step()
        steps.append((result.logits_ids, result.logits, result.expert_load))
        for out in result.outputs:
            tokens[out.request_id] += out.token_ids
    return steps, tokens


@pytest.mark.parametrize("micro_batches", [1, 2])  # (2: decode steps are not split with graphs)
def test_static_decode_steps_match_the_eager_engine(tiny_model, monkeypatch, micro_batches):
    prompts = [[0, 5, 6, 7], list(range(3, 70)), [0] + [9] * 20, [1, 2, 3]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(model=str(tiny_model), max_num_seqs=6, micro_batches=micro_batches)
    eager_steps, eager_tokens = run_steps(LocalEngine(cfg), prompts, params)

    engine = LocalEngine(cfg)
    free_before = engine.scheduler.allocator.num_blocks
    assert engine.enable_decode_graphs(capture=False)
    graphs = engine.graphs
    assert engine.scheduler.allocator.num_blocks == free_before - 1  # the scratch block is reserved
    sizes = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch: sizes.append(len(batch.query_lens)) or run(batch))
    steps, tokens = run_steps(engine, prompts, params)

    assert {1, 2, 3} <= set(sizes)  # decode steps of 1..4 sequences, padded to buckets 1, 2, 4 (and 6)
    assert list(tokens.values()) == list(eager_tokens.values())
    assert len(steps) == len(eager_steps)
    for (ids, logits, load), (eager_ids, eager_logits, eager_load) in zip(steps, eager_steps, strict=True):
        assert len(ids) == len(eager_ids)
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(load, eager_load)  # the padding rows' routed choices are not counted


def test_the_scratch_block_takes_the_padding_and_nothing_else(tiny_model):
    engine = LocalEngine(EngineConfig(model=str(tiny_model), max_num_seqs=4))
    assert engine.enable_decode_graphs(capture=False)
    scratch = engine.graphs.scratch_block
    assert not engine.cache.kv[:, scratch].any()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[0, 5, 6], [7, 8, 9, 10], [4, 4]], params)  # decodes of 3: bucket 4, one padding row
    assert engine.cache.kv[:, scratch, 0].any()  # the padding row wrote its cache row there
    allocator = engine.scheduler.allocator
    assert scratch not in allocator.allocate(allocator.num_free)  # and no sequence ever gets it
