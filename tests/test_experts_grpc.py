"""The expert worker's gRPC server (real grpc server, in-process on its own threads):
Dispatch answers, hypothesis-generated bad requests, LoadSlots hot swap while serving, health."""

import os
import threading
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.dataplane.placement import Placement
from services.dataplane.remote_experts import (
    DispatchConfig,
    ExpertDispatchError,
    ExpertUnavailableError,
    RemoteExperts,
    sum_rows,
)
from services.experts.client import ExpertClient
from services.experts.server import ExpertServer, ExpertWorkerConfig
from services.model.checkpoint import CheckpointReader
from services.model.config import ModelConfig
from services.model.messages import ExpertCombine
from services.model.moe import LocalExperts
from services.presets import init_model
from services.rpc import expert_pb2, wire

from .wire_encoders import (
    encode_dispatch_request,
    encode_dispatch_response,
    routed_dispatch,
    tensor_from_proto,
    tensor_to_proto,
)

# 64 experts of 3 x 128 x 1024 fp32 (1.5 MB each): loading 32 of them per layer takes ~0.2 s,
# long enough to watch Dispatch keep serving meanwhile
WIDE = {"hidden_size": 128, "moe_intermediate_size": 1024, "n_routed_experts": 64, "intermediate_size": 128}
OK_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


class ServerThread:
    """An ExpertServer in this process (the process is the worker)."""

    def __init__(self, cfg: ExpertWorkerConfig):
        self.server = ExpertServer(cfg)
        self.address = self.server.start()

    def stop(self):
        self.server.stop(0)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    path = init_model(tmp_path_factory.mktemp("wide"), "tiny", seed=5, overrides=WIDE, tokenizer=False)
    cfg = ModelConfig.from_dir(path)
    return path, cfg, LocalExperts.load_all(CheckpointReader.for_config(path, cfg), cfg, torch.float32)


@pytest.fixture
def server(wide_model):
    srv = ServerThread(ExpertWorkerConfig(model=str(wide_model[0]), max_versions=2))
    client = ExpertClient(srv.address)
    yield srv, client
    client.close()
    srv.stop()


def _call_dispatch(channel: grpc.Channel, data: bytes) -> wire.DispatchResponse:
    call = channel.unary_unary(wire.DISPATCH_METHOD)
    return wire.decode_dispatch_response(call(data, timeout=30))


def _layout(cfg, experts):
    return {layer: list(experts) for layer in cfg.moe_layers}


def _valid(cfg, experts, T=8, K=4, seed=0, version=1, layer=None):
    """(request, expected output): random tokens over a worker holding `experts`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    slot = torch.randint(-1, len(experts), (T, K), generator=g, dtype=torch.int32)
    weight = torch.rand(T, K, generator=g)
    logical = torch.where(slot >= 0, torch.tensor(experts)[slot.long().clamp(min=0)], -1)
    layer = cfg.moe_layers[0] if layer is None else layer
    return wire.DispatchRequest(layer, version, x, slot, weight), logical


def _expected(everything, req, logical):
    return everything.packed.forward(req.layer, req.hidden, logical, req.weight)


def test_dispatch_health_and_stats(server, wide_model):
    srv, client = server
    _, cfg, everything = wide_model
    assert client.health() == "SERVING" and client.health(wire.EXPERT_SERVICE) == "SERVING"
    assert client.stats().current_version == 0
    experts = [5, 60, 5, 17]
    load = client.load_slots(1, _layout(cfg, experts))
    assert load.version == 1 and load.bytes_read > 0 and load.bytes_reused == 0
    with grpc.insecure_channel(srv.address, options=wire.grpc_options()) as channel:
        for layer in cfg.moe_layers:
            req, logical = _valid(cfg, experts, T=33, seed=layer, layer=layer)
            resp = _call_dispatch(channel, encode_dispatch_request(req))
            torch.testing.assert_close(resp.output, _expected(everything, req, logical), rtol=1e-5, atol=1e-6)
            assert resp.compute_seconds > 0
    stats = client.stats()
    assert (stats.current_version, list(stats.loaded_versions), stats.dispatch_calls) == (1, [1], 2)
    per_slot = [sum(layer.tokens[s] for layer in stats.versions[0].layers) for s in range(len(experts))]
    assert sum(per_slot) > 0 and list(stats.versions[0].layers[0].logical_expert) == experts


# ---- hypothesis: malformed requests --------------------------------------------------------
def _mutate(data, cfg, req: expert_pb2.DispatchRequest, kind: str) -> bytes:
    H, T, K = cfg.hidden_size, req.hidden.shape[0], req.slot.shape[1]
    if kind == "garbage":
        return data.draw(st.binary(max_size=300))
    if kind == "dtype name":
        req.hidden.dtype = data.draw(st.text(max_size=10).filter(lambda s: s not in wire.DTYPES))
    elif kind == "hidden dtype":
        dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.int32]))
        tensor_to_proto(torch.zeros(T, H, dtype=dtype), req.hidden)
    elif kind == "byte length":
        cut = data.draw(st.integers(1, 64))
        req.hidden.data = (
            req.hidden.data[:-cut] if data.draw(st.booleans()) else req.hidden.data + b"\0" * cut
        )
    elif kind == "shape":
        shape = data.draw(st.lists(st.integers(-3, 2 * H), max_size=3))
        assume(shape != [T, H])
        del req.hidden.shape[:]
        req.hidden.shape.extend(shape)
    elif kind == "layer":
        req.layer = data.draw(st.integers(0, 2**32 - 1).filter(lambda n: n not in cfg.moe_layers))
    elif kind == "version":
        req.placement_version = data.draw(st.integers(0, 2**64 - 1).filter(lambda v: v != 1))
    elif kind == "slot range":
        bad = data.draw(st.one_of(st.integers(-(2**31), -2), st.integers(4, 2**31 - 1)))
        slot = tensor_from_proto(req.slot).clone()
        slot[data.draw(st.integers(0, T - 1)), data.draw(st.integers(0, K - 1))] = bad
        tensor_to_proto(slot, req.slot)
    elif kind == "slot dtype":
        dtype = data.draw(st.sampled_from([torch.int64, torch.float32]))
        tensor_to_proto(tensor_from_proto(req.slot).to(dtype), req.slot)
    elif kind == "slot rows":
        tensor_to_proto(torch.zeros(T + data.draw(st.integers(1, 3)), K, dtype=torch.int32), req.slot)
    elif kind == "weight shape":
        rows, cols = data.draw(
            st.tuples(st.integers(0, T + 2), st.integers(0, K + 2)).filter(lambda s: s != (T, K))
        )
        tensor_to_proto(torch.ones(rows, cols), req.weight)
    elif kind == "weight not finite":
        weight = tensor_from_proto(req.weight).clone()
        weight[data.draw(st.integers(0, T - 1)), data.draw(st.integers(0, K - 1))] = data.draw(
            st.sampled_from([float("nan"), float("inf"), float("-inf")])
        )
        tensor_to_proto(weight, req.weight)
    elif kind == "missing tensor":
        req.ClearField(data.draw(st.sampled_from(["hidden", "slot", "weight"])))
    elif kind == "hidden rank":
        tensor_to_proto(torch.zeros(T, H, 1), req.hidden)
    return req.SerializeToString()


KINDS = [
    "garbage",
    "dtype name",
    "hidden dtype",
    "byte length",
    "shape",
    "layer",
    "version",
    "slot range",
    "slot dtype",
    "slot rows",
    "weight shape",
    "weight not finite",
    "missing tensor",
    "hidden rank",
]


@pytest.fixture(scope="module")
def fuzz_server(wide_model):
    _, cfg, everything = wide_model
    srv = ServerThread(ExpertWorkerConfig(model=str(wide_model[0])))
    ExpertClient(srv.address).load_slots(1, _layout(cfg, [1, 2, 3, 4]))
    channel = grpc.insecure_channel(srv.address, options=wire.grpc_options())
    yield srv, channel
    channel.close()
    srv.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_bad_requests_are_refused_and_the_worker_keeps_serving(fuzz_server, wide_model, data, kind):
    _, channel = fuzz_server
    _, cfg, everything = wide_model
    req, logical = _valid(cfg, [1, 2, 3, 4], T=3, K=2, seed=data.draw(st.integers(0, 9)))
    pb = expert_pb2.DispatchRequest.FromString(encode_dispatch_request(req))
    bad = _mutate(data, cfg, pb, kind)
    with pytest.raises(grpc.RpcError) as err:
        _call_dispatch(channel, bad)
    assert err.value.code() in OK_CODES, (kind, err.value.code(), err.value.details())
    assert err.value.details(), "errors carry a message"
    # the worker still answers a valid request correctly
    resp = _call_dispatch(channel, encode_dispatch_request(req))
    torch.testing.assert_close(resp.output, _expected(everything, req, logical), rtol=1e-5, atol=1e-6)


# ---- hot swap ----------------------------------------------------------------------------------
def test_hot_swap_serves_old_version_while_loading_new(server, wide_model):
    srv, client = server
    _, cfg, everything = wide_model
    old, new = list(range(32)), list(range(32, 64))  # nothing shared: v2 reads everything
    client.load_slots(1, _layout(cfg, old))
    req1, logical1 = _valid(cfg, old, seed=1, version=1)
    req2, logical2 = _valid(cfg, new, seed=2, version=2)
    want1, want2 = _expected(everything, req1, logical1), _expected(everything, req2, logical2)
    data1, data2 = encode_dispatch_request(req1), encode_dispatch_request(req2)

    window = {}

    def load_v2():
        window["start"] = time.perf_counter()
        window["report"] = client.load_slots(2, _layout(cfg, new))
        window["end"] = time.perf_counter()

    loader = threading.Thread(target=load_v2)
    served_old, early_new = [], []
    with grpc.insecure_channel(srv.address, options=wire.grpc_options()) as channel:
        torch.testing.assert_close(_call_dispatch(channel, data1).output, want1, rtol=1e-5, atol=1e-6)
        loader.start()
        while loader.is_alive():
            out = _call_dispatch(channel, data1).output
            torch.testing.assert_close(out, want1, rtol=1e-5, atol=1e-6)
            served_old.append(time.perf_counter())
            try:  # v2 before it is loaded: refused, never a wrong answer
                torch.testing.assert_close(_call_dispatch(channel, data2).output, want2, rtol=1e-5, atol=1e-6)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
                early_new.append(e.details())
        loader.join()
        during = [t for t in served_old if window["start"] < t < window["end"]]
        assert len(during) >= 2, f"Dispatch stalled while LoadSlots ran ({len(during)} answers in the window)"
        assert any("still loading" in d for d in early_new), early_new
        assert window["report"].bytes_read > 0

        # both versions serve until the old one is released
        torch.testing.assert_close(_call_dispatch(channel, data1).output, want1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_call_dispatch(channel, data2).output, want2, rtol=1e-5, atol=1e-6)
        assert client.release_slots(1) == [2]
        with pytest.raises(grpc.RpcError) as err:
            _call_dispatch(channel, data1)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "version 1 is not loaded" in err.value.details()
        torch.testing.assert_close(_call_dispatch(channel, data2).output, want2, rtol=1e-5, atol=1e-6)


def test_load_slots_errors(server, wide_model):
    _, client = server
    _, cfg, _ = wide_model
    for layout, code in [
        ({cfg.moe_layers[0]: [0]}, grpc.StatusCode.INVALID_ARGUMENT),  # a MoE layer missing
        (_layout(cfg, [64]), grpc.StatusCode.INVALID_ARGUMENT),  # no such expert
    ]:
        with pytest.raises(grpc.RpcError) as err:
            client.load_slots(1, layout)
        assert err.value.code() == code and err.value.details()
    client.load_slots(1, _layout(cfg, [0, 1]))
    client.load_slots(1, _layout(cfg, [0, 1]))  # identical repeat: fine
    with pytest.raises(grpc.RpcError) as err:
        client.load_slots(1, _layout(cfg, [1, 0]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    client.load_slots(2, _layout(cfg, [1, 0]))
    with pytest.raises(grpc.RpcError) as err:  # max_versions=2
        client.load_slots(3, _layout(cfg, [2]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.release_slots(1) == [2]
    assert client.load_slots(3, _layout(cfg, [0, 2])).bytes_reused > 0


# ---- the dispatch client against a live worker and a dead address ------------------------------
DEAD = "127.0.0.1:1"  # nothing listens there: connection refused, UNAVAILABLE


@pytest.mark.parametrize("transport", ["auto", "grpc", "tcp"])  # (auto: shared memory to the live worker)
def test_remote_experts_resends_to_live_replicas_and_fails_clearly(server, wide_model, transport):
    srv, client = server
    _, cfg, everything = wide_model
    E = cfg.n_routed_experts
    msg = routed_dispatch(cfg)
    want = everything.packed.forward(msg.decoder_layer, msg.x, msg.topk_idx, msg.topk_weight)

    # every expert on both workers; the dead one fails, its pairs go to the live one
    both = Placement.round_robin(cfg.num_moe_layers, E, (srv.address, DEAD), E, version=1)
    client.load_slots(1, {layer: list(range(E)) for layer in cfg.moe_layers})
    experts = RemoteExperts(cfg, both, dispatch_cfg=DispatchConfig(timeout_s=10, transport=transport))
    got = experts.combine(ExpertCombine(experts.dispatch(msg)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert experts.stats.resent_pairs > 0
    live = {"auto": "shm", "grpc": "grpc", "tcp": "tcp"}[transport]
    assert experts.transport_of() == {srv.address: live, DEAD: "grpc"}  # (chosen before the first call)
    assert experts.stats.calls_by_transport[live] >= 1
    reasons = {e["worker"]: e["reason"] for e in experts.transport_events()}
    if transport != "grpc":  # (the dead one: no shared memory, no TCP data plane: gRPC, and why)
        assert "UNAVAILABLE" in reasons[DEAD] and reasons[DEAD].endswith("gRPC"), reasons
    resent = experts.stats.resent_pairs  # the dead worker is now skipped while it cools down
    torch.testing.assert_close(
        experts.combine(ExpertCombine(experts.dispatch(msg))), want, rtol=1e-5, atol=1e-6
    )
    assert experts.stats.resent_pairs == resent
    experts.close()

    # half of the experts only on the dead worker: a clear error naming them
    split = Placement.round_robin(cfg.num_moe_layers, E, (srv.address, DEAD), E // 2, version=2)
    client.load_slots(2, {layer: list(range(E // 2)) for layer in cfg.moe_layers})
    experts = RemoteExperts(cfg, split, dispatch_cfg=DispatchConfig(timeout_s=10, transport=transport))
    with pytest.raises(ExpertUnavailableError, match="no replica on a live worker"):
        experts.combine(ExpertCombine(experts.dispatch(msg)))
    experts.close()

    # a placement version the worker does not hold: refused, not resent
    unknown = Placement.round_robin(cfg.num_moe_layers, E, (srv.address,), E, version=9)
    experts = RemoteExperts(cfg, unknown, dispatch_cfg=DispatchConfig(transport=transport))
    with pytest.raises(ExpertDispatchError, match="FAILED_PRECONDITION"):
        experts.combine(ExpertCombine(experts.dispatch(msg)))
    experts.close()


def test_partial_sums_add_up_per_token_in_fp32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g).bfloat16()  # only its shape, dtype and device count
    a, b = torch.randn(3, 4, generator=g).bfloat16(), torch.randn(2, 4, generator=g).bfloat16()
    want = a.float()
    want[[0, 2]] += b.float()
    for answered in ([(None, a), (torch.tensor([0, 2]), b)], [(torch.tensor([0, 2]), b), (None, a)]):
        got = sum_rows(answered, x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    # one worker computed every row: its output, copied out of the (immutable) response bytes
    output = wire.decode_dispatch_response(encode_dispatch_response(wire.DispatchResponse(a))).output
    got = sum_rows([(None, output)], x)
    assert torch.equal(got, a) and got.untyped_storage().data_ptr() != output.untyped_storage().data_ptr()
    assert torch.equal(sum_rows([], x), torch.zeros_like(x))


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread nice here")
def test_weights_load_on_a_lower_priority_thread(server):
    """LoadSlots runs on the servicer's loader thread, niced so serving keeps the CPU."""
    srv, _ = server
    niceness = srv.server.servicer.loader.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    )
    assert niceness.result(10) == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_computes_run_in_turn_or_side_by_side_as_configured(concurrency):
    """ExpertServicer.compute_into: `compute_concurrency` computes at once (1: in turn), the rest
    wait for a slot; compute seconds are summed over calls (Stats.compute_slots tells the
    autoscaler the slots), the queueing time is what calls waited for a slot. Four calls against
    computes held open by a gate: the count inside is read, not inferred from timings."""
    from services.experts.servicer import ExpertServicer

    gate, lock = threading.Event(), threading.Lock()
    inside, blocked, held = [0], [0], []

    class GatedStore:
        def forward(self, *args):
            start = time.perf_counter()
            with lock:
                inside[0] += 1
            gate.wait(30)
            held.append(time.perf_counter() - start)

    class CountingSlots:  # (the servicer's semaphore, counting the calls it makes wait)
        def __init__(self, slots):
            self.slots = slots

        def __enter__(self):
            if not self.slots.acquire(blocking=False):
                with lock:
                    blocked[0] += 1
                self.slots.acquire()

        def __exit__(self, *exc):
            self.slots.release()

    servicer = ExpertServicer(GatedStore(), compute_concurrency=concurrency)
    servicer._compute_slots = CountingSlots(servicer._compute_slots)
    calls = [
        threading.Thread(target=servicer.compute_into, args=(0, 1, None, None, None, None)) for _ in range(4)
    ]
    for c in calls:
        c.start()
    deadline = time.monotonic() + 30
    while (inside[0], blocked[0]) != (concurrency, 4 - concurrency):
        assert inside[0] <= concurrency and time.monotonic() < deadline, (inside[0], blocked[0])
        time.sleep(0.005)
    gate.set()  # (the gate is open from now on: every call computes as soon as it has a slot)
    for c in calls:
        c.join(30)
    servicer.close()
    assert inside[0] == 4 and not any(c.is_alive() for c in calls)
    assert sum(held) <= servicer.compute_seconds <= sum(held) + 0.5  # (summed over calls)
    assert servicer.queue_seconds > 0  # (the blocked calls waited; the queueing delay counts it)
    with pytest.raises(ValueError):
        ExpertServicer(GatedStore(), compute_concurrency=0)
