"""The authenticated data plane (services/dataplane/auth.py, services/dataplane/tls.py): an expert worker
started with the cluster's secret serves its cluster over TLS keyed by that secret and refuses
everyone else, over gRPC and shared memory: a client without the secret cannot finish a TLS
handshake, and one that skips the certificate check still needs the secret in every call."""

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_health.v1.health_pb2_grpc import HealthStub

from services.dataplane import shm, tcp, tls
from services.dataplane.placement import Placement
from services.dataplane.remote_experts import DispatchConfig, ExpertUnavailableError, RemoteExperts
from services.experts.client import ExpertClient, load_placement
from services.experts.server import ExpertServer, ExpertWorkerConfig
from services.model.config import ModelConfig
from services.model.messages import ExpertCombine
from services.rpc import expert_pb2, expert_pb2_grpc, wire

from .wire_encoders import routed_dispatch

SECRET = "s3cret-of-this-cluster"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ExpertServer(ExpertWorkerConfig(model=str(tiny_model), secret=SECRET))
    address = srv.start()
    cfg = ModelConfig.from_dir(tiny_model)
    placement = Placement.round_robin(
        cfg.num_moe_layers, cfg.n_routed_experts, (address,), cfg.n_routed_experts
    )
    load_placement(placement, {address: address}, cfg.moe_layers, secret=SECRET)
    yield srv, address, placement, cfg
    srv.stop(0)


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
def test_the_clusters_own_calls_are_served_and_strangers_refused(server, transport):
    srv, address, placement, cfg = server
    msg = routed_dispatch(cfg, T=3)
    ours = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport=transport, secret=SECRET))
    want = ours.combine(ExpertCombine(ours.dispatch(msg)))
    assert ours.stats.calls_by_transport == {transport: ours.stats.rpcs}  # (tcp: TLS, the secret inside it)
    assert set(ours.transport_of().values()) == {transport}
    torch.testing.assert_close(ours.combine(ExpertCombine(ours.dispatch(msg))), want)
    ours.close()
    refused, socket_refused, served = srv.secret_check.refused, srv.socket.refused, srv.socket.requests
    for secret in (None, "a-guess"):  # plaintext / another cluster's certificate: no handshake
        for kind in ("grpc", "tcp"):
            stranger = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport=kind, secret=secret,
                                                                                 timeout_s=10))  # fmt: skip
            with pytest.raises(ExpertUnavailableError, match="no replica on a live worker"):
                stranger.combine(ExpertCombine(stranger.dispatch(msg)))
            stranger.close()
    assert srv.secret_check.refused == refused  # (they never got as far as a call)
    assert srv.socket.refused == socket_refused  # (tcp: no Stats for them, so no socket tried either)
    with pytest.raises(OSError):  # a stranger who knows the port: no TLS handshake, nothing served
        tcp.TcpChannel.connect(tcp.socket_host(address), srv.socket.port, "a-guess", timeout_s=5.0)
    deadline = time.monotonic() + 10  # (the worker's side of the failed handshake ends on its own thread)
    while srv.socket.refused == socket_refused:
        assert time.monotonic() < deadline, "the socket listener did not refuse the stranger"
        time.sleep(0.02)
    assert srv.socket.requests == served
    assert want.shape == msg.x.shape


def test_control_calls_need_the_secret_and_health_stays_open(server):
    _, address, placement, cfg = server
    with pytest.raises(grpc.RpcError) as e:  # plaintext to a TLS port
        ExpertClient(address).health()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # a TLS client that gets past the certificate (e.g. one that skips the check) but has no secret
    channel = tls.channel(address, SECRET)
    assert HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1  # SERVING
    stub = expert_pb2_grpc.ExpertStub(channel)
    for call in (lambda: stub.Stats(expert_pb2.StatsRequest(), timeout=10),
                 lambda: stub.ReleaseSlots(expert_pb2.ReleaseSlotsRequest(version=placement.version), timeout=10),
                 lambda: stub.LoadSlots(expert_pb2.LoadSlotsRequest(version=9, peers=["10.0.0.66:1"]), timeout=10)):  # fmt: skip
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub = channel.stream_stream(wire.DISPATCH_STREAM_METHOD)
    with pytest.raises(grpc.RpcError) as e:
        next(stub(iter([b""]), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    ours = ExpertClient(address, secret=SECRET)
    stats = ours.stats()
    assert isinstance(stats, expert_pb2.StatsResponse) and placement.version in list(stats.loaded_versions)
    assert (
        ours.health_stub.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    ours.close()


def test_shared_memory_handshakes_need_the_secret(server):
    srv, address, _, _ = server
    before = srv.shm.refused
    for secret in (None, "a-guess"):
        with pytest.raises(PermissionError, match="refused"):
            shm.ShmChannel.connect(address, secret=secret)
    channel = shm.ShmChannel.connect(address, secret=SECRET)
    assert channel.alive()
    channel.close()
    assert srv.shm.refused == before + 2


def test_the_tls_identity_comes_from_the_secret_alone():
    """Every process derives the same key and certificate bytes from the secret (nothing is sent)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    tls.identity.cache_clear()
    first = tls.identity(SECRET)
    tls.identity.cache_clear()
    assert tls.identity(SECRET) == first and tls.identity("another cluster") != first
    cert, key = x509.load_pem_x509_certificate(first.cert_pem), load_pem_private_key(first.key_pem, None)
    assert cert.public_key() == key.public_key()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [tls.EXPERT_NAME]
