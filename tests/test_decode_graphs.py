"""The static-buffer decode step behind the CUDA graphs (services/engine/decode_graphs.py), run
eagerly on CPU (capture=False): padding, scratch block, expert load and outputs as the eager
engine's. The capture itself runs in tests/test_cuda.py (GPU only)."""

import os

import pytest
import torch

from services.engine.decode_graphs import buckets_up_to
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .clusters import expert_servers_in_process
from .sync_probe import HostSyncs


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


@pytest.fixture(scope="module")
def expert_servers(tiny_model):
    """Two expert servers (real gRPC, in this process) holding the tiny model's experts round robin:
    (placement, model config)."""
    with expert_servers_in_process(tiny_model) as (placement, cfg):
        yield placement, cfg


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_segmented_decode_steps_with_remote_experts_match_the_eager_engine(
    tiny_model, expert_servers, monkeypatch, micro_batches
):
    """An engine whose experts are remote (an attention worker's) runs decode steps as the pieces
    between its expert messages, over static buffers (capture=False: the pieces run live), one
    instance per micro-batch: the same tokens, logits and expert load per step as the eager engine,
    the padding rows sent to no expert worker."""
    from services.dataplane.remote_experts import RemoteExperts
    from services.engine.engine import Engine
    from services.model.checkpoint import CheckpointReader
    from services.model.model import DeepseekV3

    placement, cfg = expert_servers
    model = DeepseekV3.load(CheckpointReader.for_config(tiny_model, cfg), cfg, torch.float32)
    ecfg = EngineConfig(model=str(tiny_model), max_num_seqs=6, micro_batches=micro_batches)
    prompts = [[0, 5, 6, 7], list(range(3, 70)), [0] + [9] * 20, [1, 2, 3], [4, 8, 15, 16, 23, 42]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eager_experts, experts = RemoteExperts(cfg, placement), RemoteExperts(cfg, placement)
    rows_sent = {}  # id(backend) -> rows of each of its dispatches
    for backend in (eager_experts, experts):
        dispatch, sent = backend.dispatch, rows_sent.setdefault(id(backend), [])
        monkeypatch.setattr(
            backend, "dispatch", lambda msg, d=dispatch, s=sent: s.append(msg.x.shape[0]) or d(msg)
        )
    try:
        eager_steps, eager_tokens = run_steps(Engine(cfg, model, eager_experts, ecfg), prompts, params)

        engine = Engine(cfg, model, experts, ecfg)
        assert engine.enable_decode_graphs(capture=False)
        assert engine.graphs is None and len(engine.segment_graphs) == micro_batches
        sizes = []
        for graphs in engine.segment_graphs:
            forward = graphs.forward
            monkeypatch.setattr(
                graphs, "forward", lambda b, f=forward: sizes.append(len(b.query_lens)) or f(b)
            )
        steps, tokens = run_steps(engine, prompts, params)
    finally:
        eager_experts.close()
        experts.close()

    assert 3 in sizes or 5 in sizes  # a decode step padded to a larger bucket (4 or 6)
    assert rows_sent[id(experts)] == rows_sent[id(eager_experts)]  # the padding rows went to no worker
    assert list(tokens.values()) == list(eager_tokens.values())
    assert len(steps) == len(eager_steps)
    for (ids, logits, load), (eager_ids, eager_logits, eager_load) in zip(steps, eager_steps, strict=True):
        assert len(ids) == len(eager_ids)
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(load, eager_load)


def test_a_segmented_pass_builds_its_batch_inside_its_first_piece(tiny_model, monkeypatch):
    """The batch a pass reads (int64 copies of the static block table and lengths) is built when
    the pass starts, inside the first piece: a capture then records those copies (built before
    it, every replay would read the capture's padding from memory since reused)."""
    from services.engine.decode_graphs import SegmentedDecodeGraphs
    from services.model.messages import ExpertDispatch

    engine = LocalEngine(EngineConfig(model=str(tiny_model), max_num_seqs=4))
    cfg = engine.cfg
    graphs = SegmentedDecodeGraphs(engine.model, engine.cache.kv, cfg.num_moe_layers, cfg.n_routed_experts,
                                   engine.scheduler.allocator.reserve(), 4, 2, capture=False)  # fmt: skip
    built = []
    batch = graphs._batch
    monkeypatch.setattr(graphs, "_batch", lambda bucket: built.append(bucket) or batch(bucket))
    step = graphs._pass(4)
    assert built == []
    assert isinstance(next(step), ExpertDispatch) and built == [4]


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x[0].item(), lambda x: x.tolist(), lambda x: bool(x.any()), lambda x: x[x > 0],
        lambda x: torch.nonzero(x), lambda x: x.cpu(), lambda x: torch.bincount(x.long().clamp(min=0)),
        lambda x: torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1, 1, 1])), lambda x: torch.tensor([1, 2]),
        lambda x: int(x[1]), lambda x: x.unique(), lambda x: torch.equal(x, x), lambda x: x.numpy(),
        lambda x: torch.nn.functional.one_hot(x.long().clamp(min=0)),  # (a Python-level function)
    ],
)  # fmt: skip
def test_the_sync_probe_sees_what_synchronises(call):
    """tests/sync_probe.py itself: each call that waits for a GPU is listed..."""
    x = torch.arange(6.0) - 2
    with HostSyncs() as probe:
        call(x)
    assert probe.calls


def test_the_sync_probe_lets_device_work_pass():
    """... and work that stays on the device is not."""
    x = torch.arange(6.0) - 2
    index = torch.zeros(1, dtype=torch.long)
    with HostSyncs() as probe:
        x.sum(), x[1:3], x.index_select(0, index), torch.where(x > 0, x, 0.0), x.softmax(0), x.topk(2)
        x.repeat_interleave(2, output_size=12), torch.zeros(3).scatter_add_(0, index, x[:1]), x.argsort()
    assert probe.calls == []


@pytest.fixture
def gpu_code_path(monkeypatch):
    """The Triton kernels asked for (under the interpreter) and the C++ CPU kernels not: a decode
    step runs the torch code a GPU runs. Yields (the engine's `kernels` setting, the set of the
    Triton kernels that ran, read once the test has run its steps)."""
    from services.model.kernels import triton_linear, triton_mla, triton_moe, triton_norm

    if os.environ.get("TRITON_INTERPRET") != "1":  # (on a GPU host: tests/test_cuda.py captures)
        pytest.skip("the GPU code path on CPU tensors needs triton's interpreter")
    ran = set()
    kernels = {triton_mla: ("mla_decode", "latent_to_cache"), triton_moe: ("fused_moe",),
               triton_norm: ("rms_norm", "add_rms_norm"), triton_linear: ("fp8_linear",)}  # fmt: skip
    for module, names in kernels.items():
        for name in names:
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=fn, _n=name, **kw: ran.add(_n) or _f(*a, **kw))
    return "triton,torch", ran


def failures(kernels) -> dict:
    """The families whose chosen kernel failed while running (Kernels.reasons)."""
    return {f: r for f, r in kernels.reasons().items() if any("failed" in why for why in r.values())}


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "fp8"])
def test_a_graphed_decode_step_synchronises_nowhere(tmp_path, gpu_code_path, monkeypatch, weights):
    """What a CUDA graph captures (DecodeGraphs._step on the GPU code path, fp32 / bf16 / FP8 experts
    and linears kept FP8) makes no call that waits for the device: a capture would fail on it."""
    from services.presets import init_model

    path = init_model(tmp_path / weights, "tiny", seed=3, fp8=weights == "fp8", fp8_block=(16, 16))
    fp8 = weights == "fp8"
    names, ran = gpu_code_path
    engine = LocalEngine(EngineConfig(model=str(path), max_num_seqs=4, dtype="bfloat16" if weights == "bfloat16"
                                      else "float32", keep_fp8_experts=fp8, keep_fp8_linears=fp8, kernels=names))  # fmt: skip
    assert engine.enable_decode_graphs(capture=False)
    probe, step, steps = HostSyncs(), engine.graphs._step, []

    def probed(bucket):
        steps.append(bucket)
        with probe:
            return step(bucket)

    monkeypatch.setattr(engine.graphs, "_step", probed)
    prompts = [[0, 5, 6, 7], [1, 2, 3], [4, 8]]  # (3 rows in a bucket of 4: a padding row)
    engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert 4 in steps and probe.calls == []
    every = {"mla_decode", "latent_to_cache", "fused_moe", "rms_norm", "add_rms_norm"}
    assert ran == every | ({"fp8_linear"} if fp8 else set()) and not failures(engine.kernels)


def test_the_pieces_of_a_segmented_step_synchronise_nowhere(
    tiny_model, expert_servers, gpu_code_path, monkeypatch
):
    """The same for the pieces SegmentedDecodeGraphs captures with remote experts (their gRPC
    dispatches run between the pieces, outside the graphs, and are not probed)."""
    from services.dataplane.remote_experts import RemoteExperts
    from services.engine import decode_graphs
    from services.engine.engine import Engine
    from services.model.checkpoint import CheckpointReader
    from services.model.model import DeepseekV3

    placement, cfg = expert_servers
    model = DeepseekV3.load(CheckpointReader.for_config(tiny_model, cfg), cfg, torch.float32)
    experts = RemoteExperts(cfg, placement)
    probe, advance, pieces = HostSyncs(), decode_graphs._advance, []

    def probed(step, reply):
        pieces.append(reply)
        with probe:
            return advance(step, reply)

    monkeypatch.setattr(decode_graphs, "_advance", probed)
    try:
        names, ran = gpu_code_path  # (the engine selects them: its model was loaded with the default ones)
        engine = Engine(
            cfg, model, experts, EngineConfig(model=str(tiny_model), max_num_seqs=4, kernels=names)
        )
        assert engine.enable_decode_graphs(capture=False)
        prompts = [[0, 5, 6, 7], [1, 2, 3], [4, 8]]  # (3 rows in a bucket of 4: a padding row)
        engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        experts.close()
    assert len(pieces) > 2 * cfg.num_moe_layers and probe.calls == []
    assert {"mla_decode", "latent_to_cache", "rms_norm", "add_rms_norm"} <= ran
    assert engine.kernels.names()["mla_decode"] == "triton" and not failures(engine.kernels)
    # (the in-process expert servers chose their own kernels: the C++ ones, no fused_moe)
    assert "fused_moe" not in ran
