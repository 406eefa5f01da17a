"""SlotStore (pure, no gRPC): selective loading, tensor reuse across versions, grouped compute
against the in-process experts, token counters, and typed request errors."""

import pytest
import torch

from services.experts.store import (
    InvalidRequest,
    SlotStore,
    TooManyVersions,
    VersionConflict,
    VersionUnavailable,
)
from services.model.checkpoint import CheckpointReader
from services.model.config import ModelConfig
from services.model.moe import LocalExperts
from services.presets import PRESETS, init_model

TINY = ModelConfig.from_hf(PRESETS["tiny"])


@pytest.fixture(scope="module")
def model(tiny_model):
    cfg = ModelConfig.from_dir(tiny_model)
    reader = CheckpointReader.for_config(tiny_model, cfg)
    everything = LocalExperts.load_all(reader, cfg, torch.float32)
    return tiny_model, cfg, everything


def _layout(cfg, experts):
    return {layer: list(experts) for layer in cfg.moe_layers}


def _expert_bytes(cfg, n_experts, itemsize=4):
    return n_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize * cfg.num_moe_layers


def _request(cfg, experts_on_worker, T=11, K=4, seed=0):
    """Random hidden [T, H], local slots [T, K] (some -1) and weights, plus the logical experts
    the slots stand for ([T, K], -1 where none) to compute the expected output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    slot = torch.randint(-1, len(experts_on_worker), (T, K), generator=g, dtype=torch.int32)
    weight = torch.rand(T, K, generator=g)
    table = torch.tensor(experts_on_worker)
    logical = torch.where(slot >= 0, table[slot.long().clamp(min=0)], -1)
    return x, slot, weight, logical


def test_forward_matches_in_process_experts(model):
    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    experts = [3, 7, 7, 0, 15]  # a replica of 7 on two local slots
    store.load(1, _layout(cfg, experts))
    for layer in cfg.moe_layers:
        x, slot, weight, logical = _request(cfg, experts, seed=layer)
        got = store.forward(1, layer, x, slot, weight)
        want = everything.packed.forward(layer, x, logical, weight)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # no slot at all -> zeros; empty batch -> empty output
    x, slot, weight, _ = _request(cfg, experts)
    assert torch.count_nonzero(store.forward(1, cfg.moe_layers[0], x, torch.full_like(slot, -1), weight)) == 0
    empty = store.forward(1, cfg.moe_layers[0], x[:0], slot[:0], weight[:0])
    assert empty.shape == (0, cfg.hidden_size)


def test_loads_only_its_experts_and_reuses_held_tensors(model):
    path, cfg, _ = model
    store = SlotStore(cfg, path, torch.float32, max_versions=4)
    r1 = store.load(1, _layout(cfg, [0, 1, 2, 3]))
    assert r1.bytes_read == _expert_bytes(cfg, 4) and r1.bytes_reused == 0

    r2 = store.load(2, _layout(cfg, [0, 1, 2, 3]))  # identical: shared, nothing read or copied
    assert r2.bytes_read == 0 and r2.bytes_reused == _expert_bytes(cfg, 4)
    layer = cfg.moe_layers[0]
    assert store._versions[2].packed.w13[layer] is store._versions[1].packed.w13[layer]
    assert store.stats().weight_bytes == _expert_bytes(cfg, 4)

    r3 = store.load(3, _layout(cfg, [3, 9, 0, 10]))  # two held, two new
    assert r3.bytes_read == _expert_bytes(cfg, 2) and r3.bytes_reused == _expert_bytes(cfg, 2)

    assert store.load(3, _layout(cfg, [3, 9, 0, 10])).bytes_read == 0  # identical repeat: no-op
    with pytest.raises(VersionConflict, match="different slots"):
        store.load(3, _layout(cfg, [1, 2, 3, 4]))
    store.load(4, _layout(cfg, [5]))
    with pytest.raises(TooManyVersions, match="release one first"):
        store.load(5, _layout(cfg, [5]))
    assert store.release(1) == [2, 3, 4]
    assert store.release(1) == [2, 3, 4]  # idempotent
    assert store.current_version == 4


def test_versions_compute_with_their_own_slots(model):
    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    store.load(2, _layout(cfg, [12, 13, 14, 15]))
    layer = cfg.moe_layers[-1]
    for version, experts in ((1, [0, 1, 2, 3]), (2, [12, 13, 14, 15])):
        x, slot, weight, logical = _request(cfg, experts, seed=version)
        want = everything.packed.forward(layer, x, logical, weight)
        torch.testing.assert_close(store.forward(version, layer, x, slot, weight), want, rtol=1e-5, atol=1e-6)
    store.release(1)
    with pytest.raises(VersionUnavailable, match="version 1 is not loaded on this worker"):
        store.forward(1, layer, x, slot, weight)


def test_token_counters_per_slot(model):
    path, cfg, _ = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [4, 5, 6]))
    layer = cfg.moe_layers[1]
    x, slot, weight, _ = _request(cfg, [4, 5, 6], T=20, K=3)
    store.forward(1, layer, x, slot, weight)
    store.forward(1, layer, x, slot, weight)
    stats = store.stats()
    experts, tokens = stats.slots[1][layer]
    assert experts == [4, 5, 6]
    assert tokens == (2 * torch.bincount(slot[slot >= 0].long(), minlength=3)).tolist()
    assert stats.slots[1][cfg.moe_layers[0]][1] == [0, 0, 0]
    assert stats.dispatch_calls == 2 and stats.loaded_versions == [1] and stats.current_version == 1


def _bad_requests(cfg):
    H, layer = cfg.hidden_size, cfg.moe_layers[0]
    x, slot, w = torch.randn(3, H), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    return {
        "dense layer": ((layer - 1, x, slot, w), "not a MoE layer"),
        "unknown layer": ((99, x, slot, w), "not a MoE layer"),
        "hidden dtype": ((layer, x.half(), slot, w), "computes in torch.float32"),
        "hidden width": ((layer, torch.randn(3, H + 1), slot, w), "hidden size"),
        "hidden 1-D": ((layer, torch.randn(H), slot, w), "2-D"),
        "missing weight": ((layer, x, slot, None), "weight is missing"),
        "slot dtype": ((layer, x, slot.long(), w), "int32"),
        "slot too big": ((layer, x, slot + 4, w), "slot 4 out of range"),
        "slot below -1": ((layer, x, slot - 2, w), "slot -2 out of range"),
        "weight dtype": ((layer, x, slot, w.double()), "float32"),
        "weight shape": ((layer, x, slot, torch.ones(3, 3)), "shapes disagree"),
        "token count": ((layer, x[:2], slot, w), "shapes disagree"),
        "nan weight": ((layer, x, slot, torch.tensor([[1.0, float("nan")]] * 3)), "NaN"),
    }


@pytest.mark.parametrize("case", list(_bad_requests(TINY)))
@pytest.mark.parametrize("into", [False, True], ids=["new-tensor", "into-out"])
def test_bad_requests_raise_invalid_request(model, case, into):
    """Both ways of answering refuse the same requests (with `out`, a decode-sized request takes the
    one-call kernel, which checks slots and weights itself) and write nothing."""
    path, cfg, _ = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    args, message = _bad_requests(cfg)[case]
    x = args[1]
    out = torch.full(x.shape, 7.0, dtype=x.dtype) if into else None
    with pytest.raises(InvalidRequest, match=message):
        store.forward(1, *args, out=out)
    assert out is None or bool((out == 7.0).all())
    assert store.stats().slots[1][cfg.moe_layers[0]][1] == [0, 0, 0, 0]


@pytest.mark.parametrize("T, K", [(1, 4), (8, 3), (20, 3), (64, 6)])
def test_forward_into_out_equals_forward(model, T, K):
    """Answering into the response's buffer (the one-call CPU kernel at decode sizes, the grouped
    matmuls beyond) gives the bits and the slot counts of the plain path."""
    path, cfg, _ = model
    stores = [SlotStore(cfg, path, torch.float32) for _ in range(2)]
    for store in stores:
        store.load(1, _layout(cfg, [4, 5, 6]))
    layer = cfg.moe_layers[1]
    x, slot, weight, _ = _request(cfg, [4, 5, 6], T=T, K=K, seed=T)
    want = stores[0].forward(1, layer, x, slot, weight)
    out = torch.full_like(x, float("nan"))
    assert stores[1].forward(1, layer, x, slot, weight, out) is out
    assert torch.equal(out, want)
    assert stores[1].stats().slots == stores[0].stats().slots
    assert stores[1].stats().dispatch_calls == 1


@pytest.mark.parametrize(
    "version, layout, message",
    [
        (0, None, "version must be > 0"),
        (1, {1: [0]}, "every MoE layer"),
        (1, {1: [0, 1], 2: [0]}, "same number"),
        (1, {1: [], 2: []}, "same number"),
        (1, {1: [0, 16], 2: [0, 1]}, r"logical expert 16 outside \[0, 16\)"),
    ],
)
def test_bad_layouts(model, version, layout, message):
    path, cfg, _ = model
    store = SlotStore(cfg, path, torch.float32)
    with pytest.raises(InvalidRequest, match=message):
        store.load(version, layout or _layout(cfg, [0]))


def test_fp8_checkpoint_and_bf16_compute(tmp_path, model):
    _, cfg, _ = model
    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, tokenizer=False)
    cfg = ModelConfig.from_dir(path)
    reference = LocalExperts.load_all(CheckpointReader.for_config(path, cfg), cfg, torch.bfloat16)
    store = SlotStore(cfg, path, torch.bfloat16)
    store.load(1, _layout(cfg, [2, 11]))
    x, slot, weight, logical = _request(cfg, [2, 11])
    layer = cfg.moe_layers[0]
    got = store.forward(1, layer, x.bfloat16(), slot, weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference.packed.forward(layer, x.bfloat16(), logical, weight))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_store_matches_the_cpu_store(model):
    """An expert worker on a GPU (ExpertWorkerConfig.device): weights on the device, requests and
    answers in host memory, peer copies served from host copies."""
    path, cfg, _ = model
    cpu, gpu = SlotStore(cfg, path, torch.float32), SlotStore(cfg, path, torch.float32, device="cuda")
    for store in (cpu, gpu):
        store.load(1, _layout(cfg, [3, 7, 7, 0]))
        store.load(2, _layout(cfg, [7, 0, 9]))  # reuses version 1's rows, reads expert 9
    layer = cfg.moe_layers[0]
    assert gpu._versions[2].packed.w13[layer].is_cuda
    for version, experts in ((1, [3, 7, 7, 0]), (2, [7, 0, 9])):
        x, slot, weight, _ = _request(cfg, experts, seed=version)
        out = torch.empty_like(x)
        got = gpu.forward(version, layer, x, slot, weight, out)
        assert got is out and not got.is_cuda
        torch.testing.assert_close(got, cpu.forward(version, layer, x, slot, weight), rtol=1e-4, atol=1e-5)
    (_, (w13, w2, _, _)), (_, (c13, c2, _, _)) = (
        gpu.expert_weights(layer, [9])[0],
        cpu.expert_weights(layer, [9])[0],
    )
    assert not w13.is_cuda and torch.equal(w13, c13) and torch.equal(w2, c2)


def test_bf16_held_experts_compute_in_fp32(model):
    """weight_dtype bf16: half the bytes held, fp32 hidden states in and out, the results of the
    in-process experts held in bf16."""
    path, cfg, _ = model
    reader = CheckpointReader.for_config(path, cfg)
    everything = LocalExperts.load_all(reader, cfg, torch.bfloat16)
    store = SlotStore(cfg, path, torch.float32, weight_dtype=torch.bfloat16)
    experts = [3, 7, 0, 15]
    store.load(1, _layout(cfg, experts))
    assert store._versions[1].packed.nbytes() == _expert_bytes(cfg, len(experts), itemsize=2)
    for layer in cfg.moe_layers:
        x, slot, weight, logical = _request(cfg, experts, seed=layer)
        got = store.forward(1, layer, x, slot, weight)
        assert got.dtype == torch.float32
        torch.testing.assert_close(
            got, everything.packed.forward(layer, x, logical, weight), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(InvalidRequest, match="computes in torch.float32"):
        store.forward(1, cfg.moe_layers[0], x.bfloat16(), slot, weight)


def test_slot_counts_are_exact_under_concurrent_calls(model):
    """Dispatches run at once on the gRPC pool and the shared-memory channels: every (token, choice)
    pair is counted (the kernel counts into its own tensor, added under the store's lock)."""
    from concurrent.futures import ThreadPoolExecutor

    path, cfg, _ = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [4, 5, 6]))
    layer = cfg.moe_layers[0]
    x, slot, weight, _ = _request(cfg, [4, 5, 6], T=2, K=3, seed=9)

    def run(_):
        out = torch.empty_like(x)
        for _ in range(500):
            store.forward(1, layer, x, slot, weight, out)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(run, range(4)))
    _, tokens = store.stats().slots[1][layer]
    assert tokens == (2000 * torch.bincount(slot[slot >= 0].long(), minlength=3)).tolist()
