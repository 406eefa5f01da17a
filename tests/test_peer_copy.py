"""Peer copy of expert weights (FetchExperts): a worker whose node has no checkpoint (or lacks
some of its files) loads a version from a worker that holds the experts. Real grpc servers in
this process; the wire codec of the streamed message against the generated classes."""

import shutil

import grpc
import pytest
import torch
from safetensors.torch import save_file

from services.dataplane.placement import Placement
from services.dataplane.remote_experts import RemoteExperts
from services.experts.client import ExpertClient, load_placement
from services.experts.server import ExpertWorkerConfig, read_model_config
from services.experts.store import ExpertNotFound, ExpertRows, InvalidRequest, SlotStore
from services.model.checkpoint import CheckpointReader, expert_name
from services.model.config import ModelConfig
from services.model.messages import ExpertCombine, ExpertDispatch
from services.model.moe import LocalExperts
from services.presets import init_model
from services.rpc import expert_pb2, wire

from .test_experts_grpc import DEAD, ServerThread, _call_dispatch, _valid
from .wire_encoders import encode_dispatch_request, tensor_to_proto


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny (2 MoE layers x 16 experts) in two shards, its config alone, everything in process."""
    path = init_model(tmp_path_factory.mktemp("peer"), "tiny", seed=3, tokenizer=False, shards=2)
    cfg = ModelConfig.from_dir(path)
    bare = tmp_path_factory.mktemp("bare")  # a node without the checkpoint: config.json only
    shutil.copy(path / "config.json", bare / "config.json")
    everything = LocalExperts.load_all(CheckpointReader.for_config(path, cfg), cfg, torch.float32)
    return path, bare, cfg, everything


def _layout(cfg, experts):
    return {layer: list(experts) for layer in cfg.moe_layers}


def _expert_bytes(cfg, n, itemsize=4):
    return n * 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize


# ---- wire codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("layer", "expert"), [(0, 0), (3, 7), (60, 255), (1, -1)])
def test_expert_weights_codec_matches_protobuf(dtype, layer, expert):
    g = torch.Generator().manual_seed(expert + 2)
    w13, w2 = torch.randn(6, 5, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)
    ours = wire.encode_expert_weights(wire.ExpertWeights(layer, expert, w13, w2))
    theirs = expert_pb2.ExpertWeights(
        layer=layer, logical_expert=expert, w13=tensor_to_proto(w13), w2=tensor_to_proto(w2)
    )
    assert ours == theirs.SerializeToString()
    back = wire.decode_expert_weights(ours)
    assert (back.layer, back.logical_expert) == (layer, expert)
    assert torch.equal(back.w13, w13) and torch.equal(back.w2, w2)
    empty = wire.decode_expert_weights(expert_pb2.ExpertWeights(layer=layer).SerializeToString())
    assert (empty.layer, empty.logical_expert, empty.w13, empty.w2) == (layer, 0, None, None)
    with pytest.raises(wire.WireError):
        wire.decode_expert_weights(ours[:-3])


# ---- the store alone: the injected fetch --------------------------------------------------------
def test_store_copies_what_the_checkpoint_here_lacks(model, tmp_path):
    path, bare, cfg, everything = model
    a = SlotStore(cfg, path, torch.float32)
    a.load(1, _layout(cfg, [0, 1, 2, 3, 4, 5]))
    calls = []

    def fetch(layer, experts):
        calls.append((layer, list(experts)))
        return dict(a.expert_weights(layer, experts))

    b = SlotStore(cfg, bare, torch.float32)
    report = b.load(1, _layout(cfg, [5, 3, 3, 0]), fetch)
    assert report.bytes_read == 0 and report.bytes_from_peers == _expert_bytes(cfg, 3) * cfg.num_moe_layers
    assert calls == [(layer, [0, 3, 5]) for layer in cfg.moe_layers]
    g = torch.Generator().manual_seed(0)
    x, slot = torch.randn(9, cfg.hidden_size, generator=g), torch.randint(-1, 4, (9, 3), dtype=torch.int32)
    weight = torch.rand(9, 3, generator=g)
    logical = torch.where(slot >= 0, torch.tensor([5, 3, 3, 0])[slot.long().clamp(min=0)], -1)
    for layer in cfg.moe_layers:
        want = everything.packed.forward(layer, x, logical, weight)
        torch.testing.assert_close(b.forward(1, layer, x, slot, weight), want, rtol=1e-5, atol=1e-6)

    # held experts are reused, not fetched again; an expert nobody holds fails clearly and
    # the loaded version keeps serving
    calls.clear()
    assert b.load(2, _layout(cfg, [0, 3]), fetch).bytes_from_peers == 0 and not calls
    with pytest.raises(ExpertNotFound, match=r"experts \[9\] are not held by this worker"):
        b.load(3, _layout(cfg, [0, 9]), fetch)
    with pytest.raises(ExpertNotFound, match="no checkpoint on this node.*no peers were given"):
        b.load(3, _layout(cfg, [9]))
    assert b.loaded_versions == [1, 2] and b.stats().loading_versions == []
    b.forward(1, cfg.moe_layers[0], x, slot, weight)

    # a shard file missing on this node: its tensors come from the peer (every tiny expert has
    # a tensor in each of the two shards)
    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded)
    sorted(sharded.glob("model-*.safetensors"))[1].unlink()
    report = SlotStore(cfg, sharded, torch.float32).load(1, _layout(cfg, [5, 2]), fetch)
    assert report.bytes_read == 0 and report.bytes_from_peers == _expert_bytes(cfg, 2) * cfg.num_moe_layers

    # a peer sending the wrong shapes is refused
    def bad(layer, experts):
        return {e: ExpertRows(torch.zeros(2, 2), torch.zeros(2, 2)) for e in experts}

    with pytest.raises(ExpertNotFound, match="w13 of shape"):
        b.load(3, _layout(cfg, [10]), bad)
    assert b.loaded_versions == [1, 2]


def test_expert_weights_errors(model):
    path, _, cfg, _ = model
    a = SlotStore(cfg, path, torch.float32)
    with pytest.raises(ExpertNotFound, match=r"loaded versions: \[\]"):
        a.expert_weights(cfg.moe_layers[0], [0])
    a.load(1, _layout(cfg, [4, 2]))
    got = a.expert_weights(cfg.moe_layers[0], [2, 4, 2])
    assert [e for e, _ in got] == [2, 4]  # distinct, first-seen order
    assert got[0][1].w13.shape == (2 * cfg.moe_intermediate_size, cfg.hidden_size) and not got[0][1].fp8
    with pytest.raises(InvalidRequest, match="not a MoE layer"):
        a.expert_weights(0, [2])
    with pytest.raises(InvalidRequest, match="outside"):
        a.expert_weights(cfg.moe_layers[0], [cfg.n_routed_experts])


# ---- real gRPC: two workers, B without the checkpoint ------------------------------------------
@pytest.fixture
def pair(model):
    path, bare, cfg, _ = model
    a = ServerThread(ExpertWorkerConfig(model=str(path)))
    b = ServerThread(ExpertWorkerConfig(model=str(bare)))
    clients = ExpertClient(a.address), ExpertClient(b.address)
    yield a, b, *clients
    for c in clients:
        c.close()
    a.stop()
    b.stop()


def test_worker_without_checkpoint_loads_from_peer(pair, model):
    a, b, ca, cb = pair
    _, _, cfg, everything = model
    experts = [7, 1, 7, 12, 3]
    load_a = ca.load_slots(1, _layout(cfg, [1, 3, 7, 12, 15]))
    assert load_a.bytes_read > 0 and load_a.bytes_from_peers == 0
    # B's own address and a dead one among the peers: skipped / failed over
    load_b = cb.load_slots(1, _layout(cfg, experts), peers=[DEAD, b.address, a.address])
    assert load_b.bytes_read == 0 and load_b.bytes_reused == 0
    assert load_b.bytes_from_peers == _expert_bytes(cfg, 4) * cfg.num_moe_layers
    ca.load_slots(2, _layout(cfg, experts))  # the same slots on A (reused from A's v1)
    with (
        grpc.insecure_channel(a.address, options=wire.grpc_options()) as ch_a,
        grpc.insecure_channel(b.address, options=wire.grpc_options()) as ch_b,
    ):
        for layer in cfg.moe_layers:
            req_b, logical = _valid(cfg, experts, T=13, seed=layer, version=1, layer=layer)
            req_a = wire.DispatchRequest(layer, 2, req_b.hidden, req_b.slot, req_b.weight)
            out_b = _call_dispatch(ch_b, encode_dispatch_request(req_b)).output
            out_a = _call_dispatch(ch_a, encode_dispatch_request(req_a)).output
            torch.testing.assert_close(
                out_b, out_a, rtol=1e-6, atol=1e-6
            )  # (rows in another order: sums too)
            want = everything.packed.forward(layer, req_b.hidden, logical, req_b.weight)
            torch.testing.assert_close(out_b, want, rtol=1e-5, atol=1e-6)

        # an expert no peer holds: NOT_FOUND naming it, B keeps serving v1
        with pytest.raises(grpc.RpcError) as err:
            cb.load_slots(2, _layout(cfg, [1, 9]), peers=[a.address, DEAD])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "[9]" in err.value.details() and a.address in err.value.details(), err.value.details()
        assert "no checkpoint on this node" in err.value.details()
        stats = cb.stats()
        assert list(stats.loaded_versions) == [1] and list(stats.loading_versions) == []
        out = _call_dispatch(ch_b, encode_dispatch_request(req_b)).output
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)

    # FetchExperts itself: NOT_FOUND for what is not held, INVALID_ARGUMENT for bad ids
    got = list(ca.fetch_experts(cfg.moe_layers[1], [12, 1, 12]))
    assert [(m.layer, m.logical_expert) for m in got] == [(cfg.moe_layers[1], 12), (cfg.moe_layers[1], 1)]
    for layer, ids, code in [
        (cfg.moe_layers[0], [1, 2], grpc.StatusCode.NOT_FOUND),
        (0, [1], grpc.StatusCode.INVALID_ARGUMENT),
        (cfg.moe_layers[0], [-1], grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            list(ca.fetch_experts(layer, ids))
        assert err.value.code() == code and err.value.details()


def test_partial_checkpoint_and_config_from_the_caller(model, tmp_path):
    """A node whose checkpoint lacks some experts' tensors reads what it can and copies the
    rest; a node without even the directory gets its config from the caller (`model_config`)."""
    path, _, cfg, everything = model
    partial = tmp_path / "partial"  # layer moe_layers[1]: experts 8.. have no down_proj here
    partial.mkdir()
    shutil.copy(path / "config.json", partial / "config.json")
    reader = CheckpointReader(path)
    lacking = {expert_name(cfg.moe_layers[1], e, "down") for e in range(8, cfg.n_routed_experts)}
    kept = {n: reader.raw(n) for n in reader.names() if n not in lacking}
    save_file(kept, str(partial / "model.safetensors"))
    a = ServerThread(ExpertWorkerConfig(model=str(path)))
    b = ServerThread(ExpertWorkerConfig(model=str(partial)))
    c = ServerThread(
        ExpertWorkerConfig(model=str(tmp_path / "nowhere"), model_config=read_model_config(path))
    )
    clients = [ExpertClient(s.address) for s in (a, b, c)]
    try:
        everyone = list(range(cfg.n_routed_experts))
        clients[0].load_slots(1, _layout(cfg, everyone))
        load_b = clients[1].load_slots(1, _layout(cfg, everyone), peers=[a.address])
        assert load_b.bytes_read == _expert_bytes(cfg, 16 + 8) and load_b.bytes_from_peers == _expert_bytes(
            cfg, 8
        )
        # C copies from B (all held there now), A not asked
        load_c = clients[2].load_slots(1, _layout(cfg, [2, 14]), peers=[b.address])
        assert (
            load_c.bytes_read == 0 and load_c.bytes_from_peers == _expert_bytes(cfg, 2) * cfg.num_moe_layers
        )
        with grpc.insecure_channel(c.address, options=wire.grpc_options()) as ch:
            req, logical = _valid(cfg, [2, 14], T=7, seed=5)
            out = _call_dispatch(ch, encode_dispatch_request(req)).output
            torch.testing.assert_close(
                out, everything.packed.forward(req.layer, req.hidden, logical, req.weight)
            )
    finally:
        for client in clients:
            client.close()
        for s in (a, b, c):
            s.stop()


def test_scale_up_onto_a_node_without_checkpoint(pair, model):
    """load_placement with peers (what the balancer's migration does): v1 on A alone, v2 split
    over A and B (no checkpoint on B); the dispatch client over v2 matches the local experts."""
    a, b, _, cb = pair
    _, _, cfg, everything = model
    E = cfg.n_routed_experts
    v1 = Placement.round_robin(cfg.num_moe_layers, E, (a.address,), E, version=1)
    load_placement(v1, {a.address: a.address}, cfg.moe_layers)
    v2 = Placement.round_robin(cfg.num_moe_layers, E, (a.address, b.address), E // 2, version=2)
    addresses = {a.address: a.address, b.address: b.address}
    replies = load_placement(v2, addresses, cfg.moe_layers, peers=[a.address, b.address])
    assert replies[0].bytes_from_peers == 0 and replies[0].bytes_reused > 0
    assert replies[1].bytes_read == 0 and replies[1].bytes_from_peers == _expert_bytes(cfg, E // 2) * 2
    g = torch.Generator().manual_seed(1)
    T, K = 24, cfg.num_experts_per_tok
    x = torch.randn(T, cfg.hidden_size, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    msg = ExpertDispatch.routed(cfg.moe_layers[1], 1, x, topk, torch.rand(T, K, generator=g), E)
    experts = RemoteExperts(cfg, v2)
    try:
        got = experts.combine(ExpertCombine(experts.dispatch(msg)))
    finally:
        experts.close()
    torch.testing.assert_close(got, everything.packed.forward(msg.decoder_layer, x, topk, msg.topk_weight))
    assert cb.stats().dispatch_calls == 1


# ---- FP8 experts kept FP8 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """tiny as an FP8 checkpoint with 16 x 16 blocks (32-wide experts: whole row blocks), and a
    node with its config only."""
    path = init_model(
        tmp_path_factory.mktemp("fp8"), "tiny", seed=3, tokenizer=False, fp8=True, fp8_block=(16, 16)
    )
    bare = tmp_path_factory.mktemp("fp8-bare")
    shutil.copy(path / "config.json", bare / "config.json")
    return path, bare, ModelConfig.from_dir(path)


def test_expert_weights_codec_carries_fp8_and_scales():
    g = torch.Generator().manual_seed(1)
    w13, w2 = (
        torch.randn(6, 5, generator=g).to(torch.float8_e4m3fn),
        torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
    )
    s13, s2 = torch.rand(3, 1, generator=g), torch.rand(1, 1, generator=g)
    ours = wire.encode_expert_weights(wire.ExpertWeights(3, 7, w13, w2, s13, s2))
    theirs = expert_pb2.ExpertWeights(layer=3, logical_expert=7, w13=tensor_to_proto(w13), w2=tensor_to_proto(w2),
                                      w13_scale=tensor_to_proto(s13), w2_scale=tensor_to_proto(s2))  # fmt: skip
    assert ours == theirs.SerializeToString()
    back = wire.decode_expert_weights(ours)
    assert back.w13.dtype == back.w2.dtype == torch.float8_e4m3fn
    assert torch.equal(back.w13.view(torch.uint8), w13.view(torch.uint8))
    assert torch.equal(back.w2.view(torch.uint8), w2.view(torch.uint8))
    assert torch.equal(back.w13_scale, s13) and torch.equal(back.w2_scale, s2)
    unscaled = wire.decode_expert_weights(wire.encode_expert_weights(wire.ExpertWeights(3, 7, w13, w2)))
    assert unscaled.w13_scale is None and unscaled.w2_scale is None


def test_fp8_kept_stores_serve_and_copy_experts_as_shipped(fp8_model):
    """keep_fp8: the store holds the checkpoint's FP8 experts and scales (a quarter of fp32's bytes
    plus scales) and answers as a store that dequantized them at load, bit for bit; a peer copy
    moves them as they are held (FP8 to an FP8 store, dequantized for a store that does not keep
    FP8), and an FP8 store refuses experts that are not FP8."""
    path, bare, cfg = fp8_model
    kept, loaded = SlotStore(cfg, path, torch.float32, keep_fp8=True), SlotStore(cfg, path, torch.float32)
    experts = [5, 3, 3, 0, 9]
    for store in (kept, loaded):
        store.load(1, _layout(cfg, experts))
    layer = cfg.moe_layers[0]
    assert kept._versions[1].packed.w13[layer].dtype == torch.float8_e4m3fn
    assert kept.stats().weight_bytes < loaded.stats().weight_bytes / 3.5
    g = torch.Generator().manual_seed(0)
    x, slot = torch.randn(9, cfg.hidden_size, generator=g), torch.randint(-1, 5, (9, 3), dtype=torch.int32)
    weight = torch.rand(9, 3, generator=g)
    for layer in cfg.moe_layers:
        assert torch.equal(kept.forward(1, layer, x, slot, weight), loaded.forward(1, layer, x, slot, weight))

    def fetch_from(store):
        return lambda layer, wanted: dict(store.expert_weights(layer, wanted))

    copy = SlotStore(cfg, bare, torch.float32, keep_fp8=True)
    report = copy.load(1, _layout(cfg, experts), fetch_from(kept))
    assert (
        report.bytes_read == 0
        and 0 < report.bytes_from_peers < _expert_bytes(cfg, 4, itemsize=2) * cfg.num_moe_layers
    )
    plain = SlotStore(cfg, bare, torch.float32)
    plain.load(1, _layout(cfg, experts), fetch_from(kept))  # FP8 from the peer, dequantized here
    for layer in cfg.moe_layers:
        want = loaded.forward(1, layer, x, slot, weight)
        assert torch.equal(copy.forward(1, layer, x, slot, weight), want)
        assert torch.equal(plain.forward(1, layer, x, slot, weight), want)
    with pytest.raises(ExpertNotFound, match="a mix of FP8 parts: w13 FP8 yes, w2 FP8 yes, w13_scale no"):
        SlotStore(cfg, bare, torch.float32, keep_fp8=True).load(
            1, _layout(cfg, [5]), lambda layer, wanted: {e: r._replace(w13_scale=None, w2_scale=None)
                                                         for e, r in kept.expert_weights(layer, wanted)})  # fmt: skip
    with pytest.raises(ExpertNotFound, match="keeps its experts in FP8"):
        SlotStore(cfg, bare, torch.float32, keep_fp8=True).load(1, _layout(cfg, [5]), fetch_from(loaded))


def test_fp8_peer_copy_over_grpc(fp8_model):
    """Two expert workers keeping FP8 (ExpertWorkerConfig.keep_fp8_experts), the second without
    the checkpoint: it copies the FP8 experts and scales over FetchExperts and answers Dispatch
    as the first."""
    path, bare, cfg = fp8_model
    a = ServerThread(ExpertWorkerConfig(model=str(path), keep_fp8_experts=True))
    b = ServerThread(ExpertWorkerConfig(model=str(bare), keep_fp8_experts=True))
    ca, cb = ExpertClient(a.address), ExpertClient(b.address)
    try:
        experts = [7, 1, 7, 12, 3]
        ca.load_slots(1, _layout(cfg, experts))
        load_b = cb.load_slots(1, _layout(cfg, experts), peers=[a.address])
        assert load_b.bytes_read == 0 and load_b.bytes_from_peers > 0
        assert cb.stats().weight_bytes == ca.stats().weight_bytes
        with (
            grpc.insecure_channel(a.address, options=wire.grpc_options()) as ch_a,
            grpc.insecure_channel(b.address, options=wire.grpc_options()) as ch_b,
        ):
            for layer in cfg.moe_layers:
                req, _ = _valid(cfg, experts, T=11, seed=layer, version=1, layer=layer)
                out_a = _call_dispatch(ch_a, encode_dispatch_request(req)).output
                assert torch.equal(_call_dispatch(ch_b, encode_dispatch_request(req)).output, out_a)
    finally:
        for c in (ca, cb):
            c.close()
        a.stop()
        b.stop()
    with pytest.raises(ValueError, match="not FP8 block-quantised"):
        ServerThread(ExpertWorkerConfig(model=str(path.parent / "missing-fp8"), keep_fp8_experts=True,
                                        model_config=read_model_config(bare) | {"quantization_config": None}))  # fmt: skip
