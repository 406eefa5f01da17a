"""The shared-memory data plane (services/dataplane/shm.py): channels and their server on their own, a
dispatch client over real expert servers with each transport, and a worker process killed
mid-call."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from services.dataplane import frames, shm
from services.dataplane.placement import Placement
from services.dataplane.remote_experts import DispatchConfig, ExpertDispatchError, RemoteExperts
from services.model.messages import ExpertCombine

from .clusters import expert_servers_in_process
from .wire_encoders import routed_dispatch


class Fake:
    """A compute: out = hidden * (layer + 1) + the sum of each row's weights; errors on demand."""

    def __init__(self):
        self.calls, self.fail, self.sleep = 0, None, 0.0

    def __call__(self, layer, version, hidden, slot, weight, out):
        self.calls += 1
        if self.sleep:
            time.sleep(self.sleep)
        if self.fail is not None:
            raise self.fail
        if version == 7:
            raise KeyError("version 7 is not loaded")
        out.copy_(hidden * (layer + 1) + weight.sum(1, keepdim=True))
        return 0.001


def status_of(e: Exception) -> grpc.StatusCode:
    return (
        grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, KeyError) else grpc.StatusCode.INVALID_ARGUMENT
    )


@pytest.fixture
def served():
    fake, address = Fake(), f"test-{os.getpid()}-{time.monotonic_ns()}:1"
    server = shm.ShmServer(address, fake, status_of)
    yield fake, address, server
    server.close()


def _roundtrip(channel: shm.ShmChannel, T=3, H=8, K=2, dtype=torch.float32, layer=2, version=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, slot, weight = channel.request(T, H, K, dtype)
    x, w = torch.randn(T, H, generator=g).to(dtype), torch.rand(T, K, generator=g)
    hidden.copy_(x)
    slot.fill_(1)
    weight.copy_(w)
    channel.send(layer, version)
    out, seconds = channel.result(10)
    assert seconds == pytest.approx(0.001)
    return out, (x * (layer + 1) + w.sum(1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_channel_carries_requests_and_answers(served, dtype):
    fake, address, server = served
    channel = shm.ShmChannel.connect(address, capacity=1 << 16)
    assert channel is not None and server.channels == 1
    for seed, T in enumerate((1, 5, 64)):  # shapes change from call to call
        out, want = _roundtrip(channel, T=T, dtype=dtype, seed=seed)
        assert torch.equal(out, want)
    assert fake.calls == 3 and channel.fits(64, 8, 2, dtype) and not channel.fits(4096, 8, 2, dtype)
    with pytest.raises(ValueError, match="does not fit"):
        channel.request(4096, 8, 2, dtype)
    channel.close()


def test_no_listener_means_no_channel():
    with pytest.raises(ConnectionRefusedError):
        shm.ShmChannel.connect("nobody-listens-here:1")


def test_errors_come_back_as_status_codes_and_the_channel_goes_on(served):
    fake, address, _ = served
    channel = shm.ShmChannel.connect(address, capacity=1 << 16)
    channel.request(2, 8, 2, torch.float32)
    channel.send(0, 7)
    with pytest.raises(shm.TransportError) as e:
        channel.result(10)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "version 7" in e.value.details
    fake.fail = ValueError("slot 99 out of range")
    channel.request(2, 8, 2, torch.float32)
    channel.send(0, 1)
    with pytest.raises(shm.TransportError) as e:
        channel.result(10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "slot 99" in e.value.details
    fake.fail = None
    out, want = _roundtrip(channel)
    assert torch.equal(out, want)


def test_malformed_frames_and_handshakes_are_refused_and_others_keep_serving(served):
    fake, address, server = served
    good = shm.ShmChannel.connect(address, capacity=1 << 16)
    # a frame that claims more than the buffer holds, an unknown dtype, a short frame
    raw = shm.ShmChannel.connect(address, capacity=1 << 12)
    for frame in (
        frames.REQUEST.pack(1, 0, 1, 1 << 20, 4096, 8, 0),
        frames.REQUEST.pack(2, 0, 1, 2, 8, 2, 9),
        b"\x01\x02",
    ):
        raw._sock.send(frame)
        answer = raw._sock.recv(frames.ANSWER.size + frames.MAX_ERROR_BYTES)
        assert frames.ANSWER.unpack_from(answer)[1] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # a handshake without its memfd, and one with a wrong magic: those connections close
    # ... and one whose buffer is not sealed against shrinking (it could SIGBUS the worker)
    for hello, fds in ((shm._HELLO.pack(shm.MAGIC, 4096), []), (shm._HELLO.pack(b"NOPE", 4096), None),
                       (shm._HELLO.pack(shm.MAGIC, 4096), None)):  # fmt: skip
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(shm.abstract_address(address))
        if fds is None:
            fd = os.memfd_create("x")
            os.ftruncate(fd, 8192)
            socket.send_fds(s, [hello], [fd])
            os.close(fd)
        else:
            s.send(hello)
        s.settimeout(10)
        assert s.recv(64) == b""  # closed, no ack
        s.close()
    assert fake.calls == 0
    out, want = _roundtrip(good)
    assert torch.equal(out, want)


def test_a_closed_server_or_a_slow_one_fails_the_call_at_once_or_at_the_deadline(served):
    fake, address, server = served
    channel = shm.ShmChannel.connect(address, capacity=1 << 16)
    fake.sleep = 1.0
    channel.request(2, 8, 2, torch.float32)
    channel.send(0, 1)
    with pytest.raises(shm.TransportError) as e:
        channel.result(0.2)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and channel.closed
    fake.sleep = 0.0
    channel = shm.ShmChannel.connect(address, capacity=1 << 16)
    channel.request(2, 8, 2, torch.float32)
    server.close()
    t0 = time.monotonic()
    with pytest.raises(shm.TransportError) as e:
        channel.send(0, 1)
        channel.result(30)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5


def test_spinning_doorbells_carry_the_same_calls_and_keep_the_deadlines():
    """spin_s on both sides (`--expert-spin-us`): the same answers and errors; a slow worker still
    misses the deadline (the spin is part of the wait, not added to it), a closed one fails the
    call at once, and a channel idle past the spin blocks and still wakes for the next request."""
    fake, address = Fake(), f"test-{os.getpid()}-{time.monotonic_ns()}:1"
    server = shm.ShmServer(address, fake, status_of, spin_s=0.002)
    try:
        channel = shm.ShmChannel.connect(address, capacity=1 << 16, spin_s=0.002)
        assert channel.spin_s == 0.002
        for seed, T in enumerate((1, 7)):
            out, want = _roundtrip(channel, T=T, seed=seed)
            assert torch.equal(out, want)
        time.sleep(0.05)  # past both spins: each side blocks in recv, and a doorbell still wakes it
        out, want = _roundtrip(channel, T=3, seed=5)
        assert torch.equal(out, want)
        channel.request(2, 8, 2, torch.float32)
        channel.send(0, 7)  # (version 7: the fake's KeyError)
        with pytest.raises(shm.TransportError) as e:
            channel.result(10)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and not channel.closed
        fake.sleep = 0.5
        channel.request(2, 8, 2, torch.float32)
        channel.send(0, 1)
        t0 = time.monotonic()
        with pytest.raises(shm.TransportError) as e:
            channel.result(0.1)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 0.4
        fake.sleep = 0.0
        channel = shm.ShmChannel.connect(address, capacity=1 << 16, spin_s=0.002)
        channel.request(2, 8, 2, torch.float32)
    finally:
        server.close()
    with pytest.raises(shm.TransportError) as e:
        channel.send(0, 1)
        channel.result(30)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_polling_receives_without_blocking_and_counts_toward_the_deadline(monkeypatch):
    """recv_spinning: a message sent while it polls is taken by a non-blocking recv (no blocking
    recv at all), and the deadline counts from the start of the wait, polling included."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    threading.Timer(0.02, b.send, (b"ring",)).start()
    blocking = []
    real_settimeout = socket.socket.settimeout
    monkeypatch.setattr(socket.socket, "settimeout", lambda s, t: blocking.append(t) or real_settimeout(s, t))
    assert shm.recv_spinning(a, 64, 1.0, 5.0) == b"ring" and blocking == [None]  # (only the poll's mode)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        shm.recv_spinning(a, 64, 0.5, 0.05)  # polls 0.05 s at most, then no time is left
    assert time.monotonic() - t0 < 0.3
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        shm.recv_spinning(a, 64, 0.02, 0.1)  # polls 0.02 s, then blocks for the rest
    assert 0.08 < time.monotonic() - t0 < 0.4
    b.close()
    assert shm.recv_spinning(a, 64, 0.01, 1.0) == b""  # the peer closed: seen while polling
    a.close()


def test_the_dispatch_client_gives_the_same_sums_over_each_transport(tiny_model):
    with expert_servers_in_process(tiny_model, n=2) as (placement, cfg):
        sums, stats, events = {}, {}, {}
        for transport in ("grpc", "shm", "auto"):
            dispatch_cfg = DispatchConfig(transport=transport, shm_capacity=1 << 16)  # (a decode step's rows)
            experts = RemoteExperts(cfg, placement, dispatch_cfg=dispatch_cfg)
            # two micro-batches in flight at once: two channels per worker
            a, b = (
                experts.dispatch(routed_dispatch(cfg, T=6, seed=1)),
                experts.dispatch(routed_dispatch(cfg, T=6, seed=2)),
            )
            sums[transport] = (experts.combine(ExpertCombine(a)), experts.combine(ExpertCombine(b)))
            big = routed_dispatch(cfg, T=1024)  # more than a channel holds: a channel made to measure
            sums[transport] += (experts.combine(ExpertCombine(experts.dispatch(big))),)
            stats[transport] = (experts.stats.calls_by_transport, set(experts.transport_of().values()))
            events[transport] = [(e["transport"], e["reason"]) for e in experts.transport_events()]
            experts.close()
        assert all(torch.equal(x, y) for x, y in zip(sums["grpc"], sums["shm"], strict=True))
        assert all(torch.equal(x, y) for x, y in zip(sums["grpc"], sums["auto"], strict=True))
        assert stats["grpc"] == ({"grpc": 6}, {"grpc"})
        assert stats["shm"] == ({"shm": 6}, {"shm"}) == stats["auto"]  # (the big call too)
        # chosen once per worker, with the reason
        assert events["auto"] == [("shm", "a shared-memory listener on this node")] * 2 == events["shm"]
        assert events["grpc"] == [("grpc", "gRPC")] * 2


def test_a_pair_that_loses_its_transport_falls_back_to_grpc_as_an_event(tiny_model):
    """A worker whose shared-memory listener goes away (its channels closed too) is served by gRPC
    from the next call on, as one event with the reason; the retry takes shared memory back."""
    from services.experts.client import load_placement
    from services.experts.server import ExpertServer, ExpertWorkerConfig
    from services.experts.servicer import status_of as worker_status_of
    from services.model.config import ModelConfig

    cfg, server = ModelConfig.from_dir(tiny_model), ExpertServer(ExpertWorkerConfig(model=str(tiny_model)))
    address = server.start()
    try:
        placement = Placement.round_robin(
            cfg.num_moe_layers, cfg.n_routed_experts, (address,), cfg.n_routed_experts
        )
        load_placement(placement, {address: address}, cfg.moe_layers)
        experts = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport="auto"))
        msg = routed_dispatch(cfg, T=6, seed=1)
        want = experts.combine(ExpertCombine(experts.dispatch(msg)))
        assert experts.transport_of() == {address: "shm"}
        server.shm.close()  # (its channels close too: the idle one is dead)
        deadline = time.monotonic() + 30
        while server.shm.channels:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert torch.equal(experts.combine(ExpertCombine(experts.dispatch(msg))), want)
        assert experts.transport_of() == {address: "grpc"}
        chosen, lost = [(e["transport"], e["reason"]) for e in experts.transport_events()]
        assert chosen[0] == "shm" and lost[0] == "grpc" and lost[1].startswith("shm lost: no shm channel")
        server.shm = shm.ShmServer(address, server.servicer.compute_into, worker_status_of)
        experts.transports._pairs[address].retry_at = 0.0  # (the retry's time has come)
        deadline = time.monotonic() + 30
        while experts.transport_of() != {address: "shm"}:
            assert time.monotonic() < deadline, experts.transport_events()
            assert torch.equal(experts.combine(ExpertCombine(experts.dispatch(msg))), want)
            time.sleep(0.01)
        assert experts.transport_events()[-1]["reason"].startswith("restored")
        assert torch.equal(experts.combine(ExpertCombine(experts.dispatch(msg))), want)
        assert experts.stats.calls_by_transport["grpc"] >= 1
        experts.close()
    finally:
        server.stop(0)


def test_transport_shm_refuses_a_worker_without_a_listener(tiny_model):
    with expert_servers_in_process(tiny_model, n=1) as (placement, cfg):
        elsewhere = Placement(placement.version, placement.phy2log, ("127.0.0.1:1",))
        experts = RemoteExperts(cfg, elsewhere, dispatch_cfg=DispatchConfig(transport="shm", timeout_s=5))
        with pytest.raises(ExpertDispatchError, match="transport shm: .* no listener"):
            experts.combine(ExpertCombine(experts.dispatch(routed_dispatch(cfg, T=6))))
        experts.close()
        with pytest.raises(ValueError, match="transport 'carrier-pigeon'"):
            RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport="carrier-pigeon"))


SERVER = """
import sys, time, torch, grpc
from services.dataplane import shm
def compute(layer, version, hidden, slot, weight, out):
    if layer == 1:
        time.sleep(60)  # killed meanwhile
    out.copy_(hidden)
    return 0.0
server = shm.ShmServer(sys.argv[1], compute, lambda e: grpc.StatusCode.INTERNAL)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_worker_killed_mid_call_is_seen_at_once():
    address = f"killed-{os.getpid()}:1"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        channel = shm.ShmChannel.connect(address, capacity=1 << 16)
        _roundtrip_identity(channel, layer=0)
        channel.request(2, 8, 2, torch.float32)
        channel.send(1, 1)  # the worker sleeps in this one
        threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(shm.TransportError) as e:
            channel.result(60)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 10
        with pytest.raises((ConnectionRefusedError, ConnectionResetError)):  # nothing left to connect to
            shm.ShmChannel.connect(address)
    finally:
        proc.kill()
        proc.wait()


def _roundtrip_identity(channel, layer):
    hidden, slot, weight = channel.request(2, 8, 2, torch.float32)
    hidden.copy_(torch.arange(16.0).view(2, 8))
    slot.zero_()
    weight.zero_()
    channel.send(layer, 1)
    out, seconds = channel.result(10)
    assert torch.equal(out, torch.arange(16.0).view(2, 8))
    return out, seconds
