"""Control calls to expert workers over gRPC (LoadSlots, ReleaseSlots, Stats, health), for the
migration driver, tools and tests. The data plane client is services/attention/dispatch.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.model import wire
from services.model.placement import Placement
from services.rpc import expert_pb2, expert_pb2_grpc


class ExpertClient:
    """Sync client for one expert worker's control methods."""

    def __init__(self, address: str, max_message_bytes: int = wire.MAX_MESSAGE_BYTES):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=wire.grpc_options(max_message_bytes))
        self.stub = expert_pb2_grpc.ExpertStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def load_slots(
        self, version: int, experts_per_layer: Mapping[int, Sequence[int]], timeout: float = 600.0
    ) -> expert_pb2.LoadSlotsResponse:
        """Load `version`: per MoE (decoder) layer, the logical expert of each local slot."""
        layers = [
            expert_pb2.LayerSlots(layer=layer, logical_expert=[int(e) for e in experts])
            for layer, experts in sorted(experts_per_layer.items())
        ]
        return self.stub.LoadSlots(
            expert_pb2.LoadSlotsRequest(version=version, layers=layers), timeout=timeout
        )

    def release_slots(self, version: int, timeout: float = 30.0) -> list[int]:
        return list(
            self.stub.ReleaseSlots(
                expert_pb2.ReleaseSlotsRequest(version=version), timeout=timeout
            ).loaded_versions
        )

    def stats(self, timeout: float = 30.0) -> expert_pb2.StatsResponse:
        return self.stub.Stats(expert_pb2.StatsRequest(), timeout=timeout)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """ "SERVING" / "NOT_SERVING" / ... of the standard grpc.health.v1 check."""
        reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()


def worker_slots(placement: Placement, worker: int, moe_layers: Sequence[int]) -> dict[int, list[int]]:
    """{decoder layer: logical expert per local slot} of one worker of `placement`."""
    experts = placement.worker_experts(worker)
    return {layer: experts[n].tolist() for n, layer in enumerate(moe_layers)}


def load_placement(
    placement: Placement, addresses: Mapping[str, str], moe_layers: Sequence[int], timeout: float = 600.0
) -> list[expert_pb2.LoadSlotsResponse]:
    """LoadSlots for `placement.version` on all of its workers concurrently (returns when every
    worker can serve it). `addresses`: worker id -> "host:port"."""
    clients = [ExpertClient(addresses[w]) for w in placement.workers]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = [
                pool.submit(c.load_slots, placement.version, worker_slots(placement, i, moe_layers), timeout)
                for i, c in enumerate(clients)
            ]
            return [f.result() for f in futures]
    finally:
        for c in clients:
            c.close()


def release_version(version: int, addresses: Sequence[str], timeout: float = 30.0) -> None:
    """ReleaseSlots(version) on every address."""
    for address in addresses:
        client = ExpertClient(address)
        try:
            client.release_slots(version, timeout)
        finally:
            client.close()
