"""The gRPC transport's DispatchStream (services/dataplane/grpc_stream.py) against a real expert
server in this process: answers in order, refusals answered in-band without breaking the stream,
abandoned calls read past, a hung worker caught at the deadline, a worker at its stream limit
served by unary calls (still gRPC). (A stream without the cluster's secret: test_data_plane_auth.py.)"""

import threading
import time

import grpc
import pytest
import torch

from services.dataplane.placement import Placement
from services.dataplane.remote_experts import (
    DispatchConfig,
    ExpertDispatchError,
    ExpertUnavailableError,
    RemoteExperts,
)
from services.experts.client import ExpertClient
from services.experts.server import ExpertWorkerConfig
from services.model.messages import ExpertCombine

from .test_experts_grpc import ServerThread, wide_model  # noqa: F401 (a fixture)
from .wire_encoders import routed_dispatch


@pytest.fixture
def worker(wide_model):  # noqa: F811
    path, cfg, everything = wide_model
    srv = ServerThread(ExpertWorkerConfig(model=str(path), max_versions=2, shm=False, dispatch_streams=1))
    client = ExpertClient(srv.address)
    client.load_slots(1, {layer: list(range(cfg.n_routed_experts)) for layer in cfg.moe_layers})
    yield srv, cfg, everything
    client.close()
    srv.stop()


def _experts(srv, cfg, transport="grpc", version=1, timeout_s=30.0):
    placement = Placement.round_robin(cfg.num_moe_layers, cfg.n_routed_experts, (srv.address,),
                                      cfg.n_routed_experts, version=version)  # fmt: skip
    return RemoteExperts(
        cfg, placement, dispatch_cfg=DispatchConfig(timeout_s=timeout_s, transport=transport)
    )


def _stream(experts, srv):
    """The DispatchStream `experts` holds to the worker (None: none open)."""
    return experts.transports._pairs[srv.address].grpc._stream


def _want(everything, msg):
    return everything.packed.forward(msg.decoder_layer, msg.x, msg.topk_idx, msg.topk_weight)


def test_stream_answers_come_in_order_on_one_stream(worker):
    srv, cfg, everything = worker
    msgs = [routed_dispatch(cfg, T=T, seed=s) for s, T in enumerate((1, 16, 3, 40))]
    streamed = _experts(srv, cfg, "grpc")
    for _ in range(3):  # several dispatches in flight on the one stream, combined in another order
        handles = [streamed.dispatch(m) for m in msgs]
        for i in (2, 0, 3, 1):
            got = streamed.combine(ExpertCombine(handles[i]))
            torch.testing.assert_close(got, _want(everything, msgs[i]), rtol=1e-5, atol=1e-6)
    assert streamed.transport_of() == {srv.address: "grpc"}
    assert streamed.stats.rpcs == 12 and streamed.stats.calls_by_transport == {"grpc": 12}
    assert _stream(streamed, srv).answered == 12  # (one stream carried every call)
    assert all(
        c.answer is None for _, _, c in streamed.transports._watch._calls
    )  # (taken: not kept till the deadline)
    streamed.close()


def test_a_refused_request_is_answered_in_band_and_the_stream_goes_on(worker):
    srv, cfg, everything = worker
    msg = routed_dispatch(cfg)
    good, stale = _experts(srv, cfg), _experts(srv, cfg, version=7)
    stale.transports = good.transports  # (the same stream carries both versions' calls)
    torch.testing.assert_close(good.combine(ExpertCombine(good.dispatch(msg))), _want(everything, msg))
    stream = _stream(good, srv)
    with pytest.raises(ExpertDispatchError, match="FAILED_PRECONDITION.*version 7"):
        stale.combine(ExpertCombine(stale.dispatch(msg)))
    torch.testing.assert_close(good.combine(ExpertCombine(good.dispatch(msg))), _want(everything, msg))
    assert _stream(good, srv) is stream and stream.error is None
    good.close()


def test_abandoned_calls_are_read_past(worker):
    srv, cfg, everything = worker
    experts = _experts(srv, cfg)
    first, second = routed_dispatch(cfg, seed=1), routed_dispatch(cfg, seed=2)
    experts.cancel(experts.dispatch(first))  # (its step failed elsewhere: never combined)
    got = experts.combine(ExpertCombine(experts.dispatch(second)))
    torch.testing.assert_close(got, _want(everything, second), rtol=1e-5, atol=1e-6)
    experts.close()


def test_a_hung_worker_fails_the_stream_at_the_deadline(worker, monkeypatch):
    srv, cfg, everything = worker
    experts = _experts(srv, cfg, timeout_s=1.0)
    msg = routed_dispatch(cfg)
    experts.combine(ExpertCombine(experts.dispatch(msg)))  # (the stream is open)
    release = threading.Event()
    compute = srv.server.servicer.dispatch.compute
    monkeypatch.setattr(srv.server.servicer.dispatch, "compute", lambda *a: release.wait(30) and compute(*a))
    start = time.monotonic()
    with pytest.raises(ExpertUnavailableError, match="no replica on a live worker"):
        experts.combine(ExpertCombine(experts.dispatch(msg)))
    assert 0.9 < time.monotonic() - start < 10
    assert _stream(experts, srv).error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    release.set()
    monkeypatch.undo()
    experts._dead.clear()  # (the worker answers again: a new stream serves the next call)
    torch.testing.assert_close(experts.combine(ExpertCombine(experts.dispatch(msg))), _want(everything, msg))
    experts.close()


def test_a_worker_at_its_stream_limit_is_served_by_unary_calls(worker):
    srv, cfg, everything = worker  # (the worker serves 1 stream)
    msg = routed_dispatch(cfg)
    first, second = _experts(srv, cfg), _experts(srv, cfg)
    for experts in (first, second, second):
        torch.testing.assert_close(
            experts.combine(ExpertCombine(experts.dispatch(msg))), _want(everything, msg)
        )
    assert first.transport_of() == second.transport_of() == {srv.address: "grpc"} and not second._dead
    assert _stream(first, srv).answered == 1  # (first's calls went by its stream, second's by unary calls)
    assert (
        _stream(second, srv) is None
        and second.transports._pairs[srv.address].grpc._unary_until > time.monotonic()
    )
    first.close()  # (its stream ends: the worker has one free again)
    second.close()


def test_a_stream_that_ended_while_idle_is_replaced_without_a_failure(worker):
    srv, cfg, everything = worker
    experts, msg = _experts(srv, cfg), routed_dispatch(cfg)
    experts.combine(ExpertCombine(experts.dispatch(msg)))
    old = _stream(experts, srv)
    old._responses.cancel()  # (as a connection reset while no call is pending)
    torch.testing.assert_close(experts.combine(ExpertCombine(experts.dispatch(msg))), _want(everything, msg))
    assert _stream(experts, srv) is not old and not experts._dead
    experts.close()


def test_an_unexpected_error_fails_its_request_only(worker, monkeypatch):
    srv, cfg, everything = worker
    experts, msg = _experts(srv, cfg), routed_dispatch(cfg)
    experts.combine(ExpertCombine(experts.dispatch(msg)))
    stream = _stream(experts, srv)
    answer = srv.server.servicer.dispatch.answer
    calls = []

    def once(request):  # (the first request after this raises something no handler expects)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory, say")
        return answer(request)

    monkeypatch.setattr(srv.server.servicer.dispatch, "answer", once)
    with pytest.raises(ExpertUnavailableError, match="no replica on a live worker"):  # (INTERNAL: retried)
        experts.combine(ExpertCombine(experts.dispatch(msg)))
    experts._dead.clear()
    torch.testing.assert_close(experts.combine(ExpertCombine(experts.dispatch(msg))), _want(everything, msg))
    assert _stream(experts, srv) is stream and stream.error is None
    experts.close()
