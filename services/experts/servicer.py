"""The `moecluster.expert.v1.Expert` gRPC methods over a `SlotStore` (sync grpc handlers).

The server runs each call on a thread of its pool, so a handler simply does its work. Dispatch
and DispatchStream are the data plane's (`services.dataplane.grpc_stream.DispatchService`, over
`compute_into`, which every transport calls: concurrent calls decode in parallel and compute
`compute_concurrency` at a time, so each finishes as early as it can). `LoadSlots` reads weights on a loader
thread of lower CPU priority while `Dispatch` keeps serving the loaded versions, and copies
experts this node's checkpoint lacks from the request's `peers` (a `PeerFetcher` calling their
FetchExperts). `FetchExperts` streams held experts, one message per expert (one ~88 MB copy for a
DeepSeek-V3 expert in bf16). Request errors map to status codes
(the worker keeps serving after any of them):

    WireError, InvalidRequest  -> INVALID_ARGUMENT
    VersionUnavailable         -> FAILED_PRECONDITION
    VersionConflict            -> FAILED_PRECONDITION
    TooManyVersions            -> RESOURCE_EXHAUSTED
    ExpertNotFound             -> NOT_FOUND
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.dataplane.grpc_stream import DispatchService
from services.rpc import expert_pb2, wire

from .client import PeerFetcher
from .store import (
    ExpertNotFound,
    InvalidRequest,
    SlotStore,
    SlotStoreError,
    StoreStats,
    TooManyVersions,
    VersionConflict,
    VersionUnavailable,
)

log = logging.getLogger(__name__)

_STATUS = [
    (wire.WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (VersionUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (VersionConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (TooManyVersions, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ExpertNotFound, grpc.StatusCode.NOT_FOUND),
]


def status_of(error: Exception) -> grpc.StatusCode:
    return next((code for kind, code in _STATUS if isinstance(error, kind)), grpc.StatusCode.INTERNAL)


class ExpertServicer:
    """The `moecluster.expert.v1.Expert` methods over one SlotStore (sync handlers, called on the
    gRPC server's threads)."""

    def __init__(
        self,
        store: SlotStore,
        peer_timeout_s: float = 600.0,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        secret: str | None = None,
        known_peers: Callable[[set[str]], set[str]] | None = None,
        dispatch_streams: int = 64,
        compute_concurrency: int = 1,
    ):
        if compute_concurrency < 1:
            raise ValueError("compute_concurrency must be >= 1")
        self.store = store
        # the data plane's gRPC methods (each DispatchStream holds a server thread: at most
        # `dispatch_streams` at once)
        self.dispatch = DispatchService(self.compute_into, status_of, dispatch_streams)
        self.known_peers = known_peers  # (peers) -> those LoadSlots may copy from (None: any)
        self.secret = (
            secret  # the cluster's (services/dataplane/auth.py): what this worker sends to its peers
        )
        self.address: str | None = None  # set by the server once bound; skipped among LoadSlots peers
        self.socket_port = 0  # the TCP data plane's port (rpc/tcp.py), set by the server; 0: none
        # () -> refused calls / connections by (transport, reason), set by the server (auth.Refusals)
        self.refusals: Callable[[], dict[tuple[str, str], int]] = dict
        self.peer_timeout_s, self.max_message_bytes = peer_timeout_s, max_message_bytes
        # `compute_concurrency` expert computes at a time (1: in turn, so concurrent calls from
        # micro-batches and attention workers finish one by one instead of all late together on
        # the same cores; more: that many cores of their own, each compute using the worker's
        # torch threads); decoding and encoding overlap freely
        self.compute_concurrency = compute_concurrency
        self._compute_slots = threading.Semaphore(compute_concurrency)
        # compute seconds summed over calls, both transports (the autoscaler's busy time divides
        # them by the slots: a worker busy in every slot all the time is busy 1.0)
        self.compute_seconds = 0.0
        self.queue_seconds = 0.0  # time answered Dispatches waited for a compute slot (queueing delay)
        self._counters = threading.Lock()
        # weights load on one thread of lower CPU priority, so where experts compute on the same
        # cores (CPU workers, or a busy host) loading yields to serving
        self.loader = ThreadPoolExecutor(
            1, thread_name_prefix="expert-load", initializer=lower_thread_priority
        )

    def close(self) -> None:
        self.loader.shutdown(wait=False, cancel_futures=True)

    # ---- data plane ---------------------------------------------------------------------
    def compute_into(self, layer: int, version: int, hidden, slot, weight, out) -> float:
        """SlotStore.forward into `out` (the response's payload, in gRPC bytes or shared memory),
        `compute_concurrency` computes at a time; its seconds."""
        arrived = time.perf_counter()
        with self._compute_slots:
            start = time.perf_counter()
            self.store.forward(version, layer, hidden, slot, weight, out)
            seconds = time.perf_counter() - start
        with self._counters:  # (answered calls only, as Stats.dispatch_calls)
            self.compute_seconds += seconds
            self.queue_seconds += start - arrived
        return seconds

    # ---- control ------------------------------------------------------------------------
    def LoadSlots(self, request: expert_pb2.LoadSlotsRequest, context) -> expert_pb2.LoadSlotsResponse:
        experts = {}
        for entry in request.layers:
            if entry.layer in experts:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layer {entry.layer} listed twice")
            experts[entry.layer] = list(entry.logical_expert)
        peers = [p for p in request.peers if p and p != self.address]
        if peers and self.known_peers is not None:  # (a stranger's host would be sent the secret
            # and could send poisoned weights: only the cluster's own expert workers are peers)
            unknown = sorted(set(peers) - self.known_peers(set(peers)))
            if unknown:
                log.warning("LoadSlots refused: peers %s are not expert workers of this cluster", unknown)
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"LoadSlots peers {unknown} are not expert workers of this cluster")  # fmt: skip
        try:
            report = self.loader.submit(self._load, request.version, experts, peers).result()
        except SlotStoreError as e:
            context.abort(status_of(e), str(e))
        log.info(
            "loaded version %d: %d bytes read, %d reused, %d from peers, %d written, %d rows added, "
            "peak %d bytes beyond the rows before, %.2fs",
            report.version,
            report.bytes_read,
            report.bytes_reused,
            report.bytes_from_peers,
            report.bytes_written,
            report.rows_added,
            report.peak_extra_bytes,
            report.seconds,
        )
        return expert_pb2.LoadSlotsResponse(
            version=report.version,
            bytes_read=report.bytes_read,
            bytes_reused=report.bytes_reused,
            seconds=report.seconds,
            bytes_from_peers=report.bytes_from_peers,
            bytes_written=report.bytes_written,
            rows_added=report.rows_added,
            peak_extra_bytes=report.peak_extra_bytes,
        )

    def _load(self, version: int, experts: dict[int, list[int]], peers: list[str]):
        """SlotStore.load with a peer-copy source over `peers`."""
        if not peers:
            return self.store.load(version, experts)
        fetch = PeerFetcher(
            peers,
            self.store.cfg,
            self.peer_timeout_s,
            max_message_bytes=self.max_message_bytes,
            secret=self.secret,
        )
        try:
            return self.store.load(version, experts, fetch)
        finally:
            fetch.close()

    def FetchExperts(self, request: expert_pb2.FetchExpertsRequest, context):
        """Stream held experts' weights (peer copy), one encoded ExpertWeights per expert."""
        try:  # (the versions read stay held, their rows unwritten, until the stream ends or is cancelled)
            with self.store.fetching(request.layer, list(request.logical_expert)) as held:
                for expert, rows in held:
                    yield wire.encode_expert_weights(wire.ExpertWeights(request.layer, expert, *rows))
        except SlotStoreError as e:  # (raised before the first answer: a bad layer, experts not held)
            context.abort(status_of(e), str(e))

    def ReleaseSlots(self, request, context) -> expert_pb2.ReleaseSlotsResponse:
        return expert_pb2.ReleaseSlotsResponse(loaded_versions=self.store.release(request.version))

    def Stats(self, request, context) -> expert_pb2.StatsResponse:
        reply = stats_to_proto(self.store.stats())
        reply.compute_seconds, reply.queue_seconds = self.compute_seconds, self.queue_seconds
        reply.socket_port, reply.compute_slots = self.socket_port, self.compute_concurrency
        reply.refused.extend(expert_pb2.Refusal(transport=t, reason=r, count=n)
                             for (t, r), n in sorted(self.refusals().items()))  # fmt: skip
        return reply


def lower_thread_priority(niceness: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads by their own nice value;
    elsewhere, or when not permitted, nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError) as e:
        log.debug("could not lower the loader thread's priority: %s", e)


def stats_to_proto(stats: StoreStats) -> expert_pb2.StatsResponse:
    return expert_pb2.StatsResponse(
        current_version=stats.current_version,
        loaded_versions=stats.loaded_versions,
        loading_versions=stats.loading_versions,
        versions=[
            expert_pb2.VersionStats(
                version=v,
                layers=[
                    expert_pb2.LayerStats(layer=layer, logical_expert=experts, tokens=tokens)
                    for layer, (experts, tokens) in layers.items()
                ],
            )
            for v, layers in stats.slots.items()
        ],
        dispatch_calls=stats.dispatch_calls,
        weight_bytes=stats.weight_bytes,
    )


def add_expert_service(server: grpc.Server, servicer: ExpertServicer) -> None:
    """Register the Expert service on `server`: the data plane's methods (services/dataplane/
    grpc_stream.py) and the control methods."""
    raw = lambda b: b  # noqa: E731
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        **servicer.dispatch.handlers(),
        "LoadSlots": unary(
            servicer.LoadSlots,
            request_deserializer=expert_pb2.LoadSlotsRequest.FromString,
            response_serializer=expert_pb2.LoadSlotsResponse.SerializeToString,
        ),
        "ReleaseSlots": unary(
            servicer.ReleaseSlots,
            request_deserializer=expert_pb2.ReleaseSlotsRequest.FromString,
            response_serializer=expert_pb2.ReleaseSlotsResponse.SerializeToString,
        ),
        "Stats": unary(
            servicer.Stats,
            request_deserializer=expert_pb2.StatsRequest.FromString,
            response_serializer=expert_pb2.StatsResponse.SerializeToString,
        ),
        "FetchExperts": grpc.unary_stream_rpc_method_handler(
            servicer.FetchExperts,
            request_deserializer=expert_pb2.FetchExpertsRequest.FromString,
            response_serializer=raw,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.EXPERT_SERVICE, handlers),))
