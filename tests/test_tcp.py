"""The TCP data plane (services/dataplane/tcp.py) on its own: a TcpServer over a stand-in compute, real
sockets on loopback, TLS when there is a secret. Answers are the compute's; a wrong or missing
secret is refused at the handshake; a bad frame closes only its own connection; a hung or dead
worker is a TransportError with the status that says why."""

import contextlib
import socket
import threading
import time

import grpc
import pytest
import torch

from services.dataplane import tcp, tls
from services.dataplane.frames import REQUEST, TransportError

SECRET = "s3cret-for-tests"


def _compute(layer, version, hidden, slot, weight, out):
    """out = hidden * (sum of the row's weights) + layer; version 9 is not held."""
    if version == 9:
        raise KeyError("placement version 9 is not loaded")
    out.copy_(hidden * weight.sum(-1, keepdim=True).to(hidden.dtype) + layer)
    return 0.001


def _status_of(e):
    return grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, KeyError) else grpc.StatusCode.INTERNAL


@pytest.fixture(params=[None, SECRET], ids=["plaintext", "tls"])
def server(request):
    srv = tcp.TcpServer("127.0.0.1", _compute, _status_of, secret=request.param, max_request_bytes=1 << 20)
    yield srv, request.param
    srv.close()


def _call(channel, T=3, H=8, K=2, dtype=torch.float32, layer=1, version=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, slot, weight = channel.request(T, H, K, dtype)
    hidden.copy_(torch.randn(T, H, generator=g).to(dtype))
    slot.copy_(torch.randint(0, 4, (T, K), generator=g, dtype=torch.int32))
    weight.copy_(torch.rand(T, K, generator=g))
    want = hidden * weight.sum(-1, keepdim=True).to(dtype) + layer
    channel.send(layer, version, 5.0)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_answers_are_the_computes_over_many_calls_and_sizes(server, dtype):
    srv, secret = server
    channel = tcp.TcpChannel.connect("127.0.0.1", srv.port, secret)
    for i, T in enumerate([1, 5, 64, 2, 300]):
        want = _call(channel, T=T, dtype=dtype, layer=i, seed=i)
        out, seconds = channel.result(5.0)
        assert out.dtype == dtype and out.shape == (T, 8) and seconds == 0.001
        torch.testing.assert_close(out, want)
    channel.close()
    assert srv.requests == 5


def test_errors_come_back_in_band_and_the_connection_goes_on(server):
    srv, secret = server
    channel = tcp.TcpChannel.connect("127.0.0.1", srv.port, secret)
    _call(channel, version=9)
    with pytest.raises(TransportError) as err:
        channel.result(5.0)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "version 9" in err.value.details
    assert not channel.closed and channel.answered
    want = _call(channel)
    torch.testing.assert_close(channel.result(5.0)[0], want)


@pytest.mark.parametrize("given", [None, "wrong"])
def test_a_stranger_without_the_secret_is_refused(given):
    srv = tcp.TcpServer("127.0.0.1", _compute, _status_of, secret=SECRET)
    try:
        with pytest.raises(OSError):  # (no TLS: the handshake fails; a wrong secret: refused)
            tcp.TcpChannel.connect("127.0.0.1", srv.port, given, timeout_s=5.0)
        with socket.create_connection(("127.0.0.1", srv.port)) as raw:  # a plaintext request to a TLS port
            raw.sendall(REQUEST.pack(1, 0, 1, 1, 8, 2, 0) + bytes(128))
            raw.settimeout(5.0)
            try:
                answer = raw.recv(64)
            except ConnectionResetError:
                answer = b""
            assert answer == b"" or answer[:1] == b"\x15"  # closed, or a TLS alert: no answer frame
        assert srv.requests == 0 and srv.refused >= 1
    finally:
        srv.close()


def test_a_bad_frame_closes_its_connection_only():
    srv = tcp.TcpServer("127.0.0.1", _compute, _status_of, max_request_bytes=1 << 16)
    try:
        good = tcp.TcpChannel.connect("127.0.0.1", srv.port)
        for frame in [REQUEST.pack(1, 0, 1, 1, 8, 2, 7),  # no such dtype
                      REQUEST.pack(1, 0, 1, 0, 8, 2, 0),  # no rows
                      REQUEST.pack(1, 0, 1, 1 << 20, 4096, 8, 0)]:  # over the size limit  # fmt: skip
            bad = tcp.TcpChannel.connect("127.0.0.1", srv.port)
            bad._sock.sendall(frame)
            bad._sock.settimeout(5.0)
            assert bad._sock.recv(64) == b""  # closed, nothing read beyond the frame
            bad.close()
        want = _call(good)
        torch.testing.assert_close(good.result(5.0)[0], want)  # (the other connection serves on)
    finally:
        srv.close()


def test_a_hung_worker_misses_the_deadline_and_a_dead_one_is_unavailable():
    release = threading.Event()

    def hang(*args):
        release.wait(10)
        return _compute(*args)

    srv = tcp.TcpServer("127.0.0.1", hang, _status_of)
    channel, other = (tcp.TcpChannel.connect("127.0.0.1", srv.port) for _ in range(2))
    _call(channel)
    with pytest.raises(TransportError) as err:
        channel.result(0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and channel.closed
    release.set()
    srv.close()  # (the worker is gone: a call on its other connection fails at once)
    started = time.monotonic()
    with pytest.raises(TransportError) as err:
        _call(other)
        other.result(30.0)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 10


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plaintext", "tls"])
def test_a_worker_that_stops_cuts_its_connections(secret):
    """Stopping the worker (its listener) ends every connection at once, TLS ones too: a call in
    flight fails UNAVAILABLE, not at its deadline; an idle connection is no longer `alive`."""
    stuck = threading.Event()
    dying = tcp.TcpServer("127.0.0.1", lambda *args: stuck.wait(10) and 0.0, _status_of, secret=secret)
    busy = tcp.TcpChannel.connect("127.0.0.1", dying.port, secret)
    idle = tcp.TcpChannel.connect("127.0.0.1", dying.port, secret)
    assert idle.alive()
    _call(busy)
    started = time.monotonic()
    dying.close()  # (the worker goes away with a call in flight)
    with pytest.raises(TransportError) as err:
        busy.result(20.0)
    stuck.set()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while idle.alive():
        assert time.monotonic() < deadline, "an idle connection to a stopped worker still looks alive"
        time.sleep(0.05)
    with pytest.raises(OSError):
        tcp.TcpChannel.connect("127.0.0.1", dying.port, secret, timeout_s=1.0)


def test_a_silent_stranger_is_cut_at_the_handshake_deadline(monkeypatch):
    monkeypatch.setattr(tcp, "HANDSHAKE_S", 0.5)
    srv = tcp.TcpServer("127.0.0.1", _compute, _status_of, secret=SECRET)
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as raw:  # says nothing
            raw.settimeout(10.0)
            started = time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(64) == b""
            assert time.monotonic() - started < 5
        deadline = time.monotonic() + 5
        while srv.connections:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        good = tcp.TcpChannel.connect("127.0.0.1", srv.port, SECRET)
        want = _call(good)
        torch.testing.assert_close(good.result(5.0)[0], want)
    finally:
        srv.close()


def test_a_stranger_past_tls_that_drips_its_hello_is_cut_at_the_handshake_deadline(monkeypatch):
    """TLS done (with the cluster's client certificate: mutual TLS), then the hello one byte at a time, each
    within the per-read timeout: the handshake deadline still cuts it (the TLS socket is shut
    down, not the raw one it detached from), and the handshake slot is free again."""
    monkeypatch.setattr(tcp, "HANDSHAKE_S", 0.5)
    srv = tcp.TcpServer("127.0.0.1", _compute, _status_of, secret=SECRET)
    try:
        raw = socket.create_connection(("127.0.0.1", srv.port))
        sock = tcp._client_context(SECRET).wrap_socket(raw, server_hostname=tls.EXPERT_NAME)
        sock.sendall(tcp._HELLO.pack(tcp.MAGIC, 1000))  # (a secret of 1,000 bytes announced ...)
        sock.settimeout(0.1)
        started, cut = time.monotonic(), False
        while not cut and time.monotonic() - started < 10:
            try:
                sock.send(b"x")  # (... and sent a byte per 0.1 s)
                cut = sock.recv(64) == b""
            except TimeoutError:
                continue
            except OSError:
                cut = True
        assert cut and time.monotonic() - started < 5
        sock.close()
        deadline = time.monotonic() + 5
        while srv.connections or srv._handshaking:
            assert time.monotonic() < deadline, (srv.connections, srv._handshaking)
            time.sleep(0.02)
    finally:
        srv.close()


def test_socket_host_of_grpc_addresses():
    assert tcp.socket_host("10.0.0.7:5001") == "10.0.0.7"
    assert tcp.socket_host("[::1]:5001") == "::1"
