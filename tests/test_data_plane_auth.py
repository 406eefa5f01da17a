"""The authenticated data plane (services/rpc/auth.py): an expert worker started with the
cluster's secret serves its cluster and refuses everyone else, over gRPC and shared memory."""

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.attention.dispatch import DispatchConfig, ExpertDispatchError, RemoteExperts
from services.experts.client import ExpertClient, load_placement
from services.experts.server import ExpertServer, ExpertWorkerConfig
from services.model.config import ModelConfig
from services.model.messages import ExpertCombine
from services.model.placement import Placement
from services.rpc import expert_pb2, shm

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


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_the_clusters_own_calls_are_served_and_strangers_refused(server, transport):
    srv, address, placement, cfg = server
    msg = routed_dispatch(cfg, T=3)
    ours = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport=transport, secret=SECRET))
    want = ours.combine(ExpertCombine(ours.dispatch(msg)))
    assert ours.stats.shm_calls == (ours.stats.rpcs if transport == "shm" else 0)
    ours.close()
    refused = srv.secret_check.refused
    for secret in (None, "a-guess"):
        stranger = RemoteExperts(cfg, placement, dispatch_cfg=DispatchConfig(transport="grpc", secret=secret))
        with pytest.raises(ExpertDispatchError, match="UNAUTHENTICATED"):
            stranger.combine(ExpertCombine(stranger.dispatch(msg)))
        stranger.close()
    assert srv.secret_check.refused == refused + 2
    assert want.shape == msg.x.shape


def test_control_calls_need_the_secret_and_health_stays_open(server):
    _, address, placement, cfg = server
    stranger = ExpertClient(address)
    assert stranger.health() == "SERVING"  # (tells only whether it serves)
    for call in (lambda: stranger.stats(), lambda: stranger.release_slots(placement.version),
                 lambda: stranger.load_slots(9, {layer: [0] for layer in cfg.moe_layers}, 30, ["10.0.0.66:1"])):  # fmt: skip
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stranger.close()
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
    assert shm.ShmChannel.connect(address) is None
    assert shm.ShmChannel.connect(address, secret="a-guess") is None
    channel = shm.ShmChannel.connect(address, secret=SECRET)
    assert channel is not None
    channel.close()
    assert srv.shm.refused == before + 2
