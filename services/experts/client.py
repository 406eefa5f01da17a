"""Control calls to expert workers over gRPC (LoadSlots, ReleaseSlots, Stats, health,
FetchExperts), for the migration driver, tools and tests, and `PeerFetcher`, the peer-copy source
an expert worker hands to `SlotStore.load`. The data plane client is services/dataplane/remote_experts.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.dataplane import auth, tls
from services.dataplane.placement import Placement
from services.model.config import ModelConfig
from services.rpc import expert_pb2, expert_pb2_grpc, wire

from .store import ExpertNotFound, ExpertRows, check_expert_weights

log = logging.getLogger(__name__)


class ExpertClient:
    """Sync client for one expert worker's control methods."""

    def __init__(
        self, address: str, max_message_bytes: int = wire.MAX_MESSAGE_BYTES, secret: str | None = None
    ):
        self.address = address
        channel = tls.channel(address, secret, wire.grpc_options(max_message_bytes))
        self._raw_channel, self.channel = channel, auth.with_secret(channel, secret)
        self.stub = expert_pb2_grpc.ExpertStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def load_slots(
        self,
        version: int,
        experts_per_layer: Mapping[int, Sequence[int]],
        timeout: float = 600.0,
        peers: Sequence[str] = (),
    ) -> expert_pb2.LoadSlotsResponse:
        """Load `version`: per MoE (decoder) layer, the logical expert of each local slot.
        `peers`: workers to copy experts from when the worker's node lacks them in its checkpoint."""
        layers = [
            expert_pb2.LayerSlots(layer=layer, logical_expert=[int(e) for e in experts])
            for layer, experts in sorted(experts_per_layer.items())
        ]
        return self.stub.LoadSlots(
            expert_pb2.LoadSlotsRequest(version=version, layers=layers, peers=list(peers)), timeout=timeout
        )

    def fetch_experts(
        self, layer: int, experts: Sequence[int], timeout: float = 600.0
    ) -> Iterator[wire.ExpertWeights]:
        """The worker's weights of `experts` of MoE layer `layer`, one decoded message per expert
        (tensors view the received bytes). Raises grpc.RpcError (NOT_FOUND: not held there)."""
        call = self.channel.unary_stream(
            wire.FETCH_EXPERTS_METHOD,
            request_serializer=expert_pb2.FetchExpertsRequest.SerializeToString,
            response_deserializer=lambda b: b,
        )
        request = expert_pb2.FetchExpertsRequest(layer=layer, logical_expert=[int(e) for e in experts])
        for message in call(request, timeout=timeout):
            yield wire.decode_expert_weights(message)

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
        self._raw_channel.close()


def load_placement(
    placement: Placement,
    addresses: Mapping[str, str],
    moe_layers: Sequence[int],
    timeout: float = 600.0,
    peers: Sequence[str] = (),
    secret: str | None = None,
) -> list[expert_pb2.LoadSlotsResponse]:
    """LoadSlots for `placement.version` on all of its workers concurrently (returns when every
    worker can serve it). `addresses`: worker id -> "host:port". `peers`: addresses of workers
    holding loaded versions (the current pool), to copy experts from where a worker's node has
    no checkpoint (each worker skips its own address)."""
    clients = [ExpertClient(addresses[w], secret=secret) for w in placement.workers]
    layouts = [placement.worker_layout(i, moe_layers) for i in range(len(clients))]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = [
                pool.submit(c.load_slots, placement.version, layout, timeout, list(peers))
                for c, layout in zip(clients, layouts, strict=True)
            ]
            return [f.result() for f in futures]
    finally:
        for c in clients:
            c.close()


def release_version(
    version: int, addresses: Sequence[str], timeout: float = 30.0, secret: str | None = None
) -> None:
    """ReleaseSlots(version) on every address (each one tried; raises afterwards, naming the ones
    that failed)."""
    failed = []
    for address in addresses:
        client = ExpertClient(address, secret=secret)
        try:
            client.release_slots(version, timeout)
        except grpc.RpcError as e:
            failed.append(f"{address}: {e.code().name}")
        finally:
            client.close()
    if failed:
        raise RuntimeError(f"ReleaseSlots(v{version}) failed on {failed}")


class PeerFetcher:
    """`fetch(layer, experts)` for `SlotStore.load`: copies experts from other expert workers
    over FetchExperts (sync gRPC, runs in the loader thread).

    On first use it asks every peer for Stats to learn which (layer, expert) each one holds in a
    loaded version; each layer's missing experts are then spread over their holders (the least
    asked first) and streamed, one message per expert. A peer that fails (down, NOT_FOUND because
    it released the version meanwhile, a malformed message) is dropped for those experts and the
    next holder is asked; experts no peer can give raise ExpertNotFound naming the peers' errors.
    """

    def __init__(
        self,
        peers: Sequence[str],
        cfg: ModelConfig,
        timeout: float = 600.0,
        stats_timeout: float = 10.0,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        secret: str | None = None,
    ):
        self.peers = [p for p in dict.fromkeys(peers) if p]
        self.secret = secret
        self.cfg, self.timeout, self.stats_timeout = cfg, timeout, stats_timeout
        self.max_message_bytes = max_message_bytes
        self._clients: dict[str, ExpertClient] = {}
        self._holders: dict[tuple[int, int], list[str]] | None = None
        self.errors: dict[str, str] = {}  # peer -> its last error
        self.asked: dict[str, int] = {}  # peer -> experts asked of it

    def _client(self, address: str) -> ExpertClient:
        if address not in self._clients:
            self._clients[address] = ExpertClient(address, self.max_message_bytes, self.secret)
        return self._clients[address]

    def holders(self) -> dict[tuple[int, int], list[str]]:
        """(layer, logical expert) -> peers holding it in a loaded version (Stats, once)."""
        if self._holders is None:
            self._holders = {}
            for address in self.peers:
                try:
                    stats = self._client(address).stats(timeout=self.stats_timeout)
                except grpc.RpcError as e:
                    self.errors[address] = f"Stats: {_rpc_error(e)}"
                    continue
                for version in stats.versions:
                    for layer in version.layers:
                        for e in dict.fromkeys(layer.logical_expert):
                            holders = self._holders.setdefault((layer.layer, e), [])
                            if address not in holders:
                                holders.append(address)
        return self._holders

    def __call__(self, layer: int, experts: list[int]) -> dict[int, ExpertRows]:
        holders = self.holders()
        got: dict[int, ExpertRows] = {}
        failed: dict[int, set[str]] = {e: set() for e in experts}
        remaining = list(dict.fromkeys(experts))
        while remaining:
            plan: dict[str, list[int]] = {}
            for e in remaining:
                candidates = [a for a in holders.get((layer, e), []) if a not in failed[e]]
                if not candidates:
                    raise ExpertNotFound(self._not_found(layer, [x for x in remaining if x not in got]))
                peer = min(candidates, key=lambda a: self.asked.get(a, 0))
                self.asked[peer] = self.asked.get(peer, 0) + 1
                plan.setdefault(peer, []).append(e)
            remaining = []
            for peer, wanted in plan.items():
                try:
                    for msg in self._client(peer).fetch_experts(layer, wanted, self.timeout):
                        rows = ExpertRows(msg.w13, msg.w2, msg.w13_scale, msg.w2_scale)
                        problem = (
                            f"an answer for layer {msg.layer} expert {msg.logical_expert}"
                            if msg.layer != layer or msg.logical_expert not in wanted
                            else check_expert_weights(self.cfg, rows)
                        )
                        if problem:
                            raise wire.WireError(f"FetchExperts sent {problem}")
                        got[msg.logical_expert] = rows
                except (grpc.RpcError, wire.WireError) as e:
                    self.errors[peer] = _rpc_error(e) if isinstance(e, grpc.RpcError) else str(e)
                    log.warning("peer copy of layer %d from %s failed: %s", layer, peer, self.errors[peer])
                lost = [e for e in wanted if e not in got]
                for e in lost:
                    failed[e].add(peer)
                remaining += lost
        return got

    def _not_found(self, layer: int, experts: list[int]) -> str:
        if not self.peers:
            return f"no peers to copy experts {experts} of layer {layer} from"
        errors = "; ".join(f"{p}: {m}" for p, m in self.errors.items())
        return (
            f"no peer could give experts {experts} of layer {layer} (asked {len(self.peers)} peers: "
            f"{', '.join(self.peers)}{'; errors: ' + errors if errors else ''})"
        )

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _rpc_error(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {details}"
