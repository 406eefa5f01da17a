"""The attention worker's dispatch client: `RemoteExperts`, the ExpertBackend over the expert workers.

Slot choice is the pure `SlotRouter` (slot_router.py); the transports are transport.py's; this
module splits a layer's rows over the workers and sums their answers. Per MoE layer of a step:

    dispatch(ExpertDispatch(decoder_layer, moe_layer, x [T, H], topk_idx [T, K], topk_weight, counts))
      1. the router maps each (token, choice) pair to a slot on a worker          -> Route
      2. each worker gets only its rows: hidden [Tw, H], local slots [Tw, K] int32 (-1 where
         another worker computes the pair), weights fp32, laid out in the request's bytes
      3. all calls start and a handle returns, each on its pair's transport (transport.py: shared
         memory on this node, else TCP, else a gRPC stream; chosen once per pair), so they
         overlap the shared experts / the other micro-batch
    combine(ExpertCombine(handle))
      4. wait, scatter-add the partial sums in fp32 into [T, H], return in x's dtype (when one
         worker computed every pair, its answer is the result, copied out of the response)

Deadlines: each call must be answered within a deadline drawn from what calls of its size took
lately (deadlines.py: 4 x their p99, at least 1.5 s, at most `timeout_s`), so a hung worker is
found in about a second and a busy one is given the time it has been taking.

Failures: a Dispatch that fails with a transport-like status (UNAVAILABLE, DEADLINE_EXCEEDED,
...) marks its worker dead for `dead_worker_cooldown_s` and its pairs are resent on the router's
resend route (other replicas on live workers); when an expert has no live replica the step raises
`ExpertUnavailableError`, and for `deadline_floor_s` after the failure steps that need such an
expert fail at once instead of waiting on it again (their retries pick up a healed placement
within a step's time). INVALID_ARGUMENT / FAILED_PRECONDITION are bugs or placement mismatches
and raise `ExpertDispatchError` at once. Routes skip dead workers while they cool down.

Not thread-safe: one driver thread per instance (the attention worker's step loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import grpc
import torch

from services.dataplane.placement import Placement
from services.deadlines import Deadlines
from services.model.config import ModelConfig
from services.model.kernels import cpu_kernels
from services.model.messages import ExpertCombine, ExpertDispatch
from services.rpc import wire

from . import shm
from .slot_router import ExpertDispatchError, ExpertUnavailableError, Route, SlotRouter
from .transport import Call, TransportError, Transports

__all__ = ["DispatchConfig", "ExpertDispatchError", "ExpertUnavailableError", "RemoteExperts", "sum_rows"]

log = logging.getLogger(__name__)

# statuses that mean "this worker did not answer" (resend elsewhere), not "the request is wrong"
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


@dataclass
class DispatchConfig:
    # the longest a Dispatch may take (its deadline before calls of its size were seen)
    timeout_s: float = 30.0
    # each call's deadline: deadline_factor x the p99 of recent calls of its size, at least
    # deadline_floor_s (deadlines.py): a hung worker is found in about that
    deadline_floor_s: float = 1.5
    deadline_factor: float = 4.0
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    dead_worker_cooldown_s: float = 10.0  # replicas on a failed worker are skipped this long
    # transport.TRANSPORTS: "auto" (cuda-ipc / shm on this node, else TCP, else gRPC), "cuda-ipc", "shm",
    # "tcp", "grpc"
    transport: str = "auto"
    shm_capacity: int = shm.DEFAULT_CAPACITY  # bytes of a shared-memory channel's request (and answer) buffer
    # the cluster's data-plane secret (dataplane/auth.py)
    secret: str | None = field(default=None, repr=False)
    spin_us: float = 0.0  # shared memory: poll for the answer this long before blocking (shm.recv_spinning)
    device: str = "cpu"  # where this worker's rows are ("cuda": cuda-ipc channels keep them on the GPU)


@dataclass
class DispatchStats:
    rpcs: int = 0  # calls, every transport
    shm_calls: int = 0  # of which through shared memory
    calls_by_transport: dict[str, int] = field(default_factory=dict)  # transport -> calls
    bytes_sent: int = 0  # serialized request bytes
    bytes_received: int = 0  # serialized response bytes
    bytes_copied: int = 0  # request payloads this client wrote (answers copied into results: not counted)
    resent_pairs: int = 0  # (token, choice) pairs resent after a worker failed


@dataclass
class _Part:
    """One worker's share of a dispatch."""

    worker: int  # index into placement.workers
    rows: torch.Tensor | None  # [Tw] int64 rows of x this worker got; None: all of them
    route: Route  # the route it came from (`pairs`: what a resend must cover)
    call: Call  # its output, or TransportError

    @property
    def pairs(self) -> torch.Tensor:
        """[T, K] bool: the (token, choice) pairs it computes."""
        return self.route.pairs(self.worker)


@dataclass
class PendingDispatch:
    """The handle `dispatch` returns; `combine` consumes it."""

    msg: ExpertDispatch
    router: SlotRouter  # the placement it was routed with (a resend uses the same one)
    addresses: dict[str, str]
    parts: list[_Part] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # every call made, resends too (released at the end)


class RemoteExperts:
    """ExpertBackend that runs routed experts on gRPC expert workers."""

    def __init__(
        self,
        cfg: ModelConfig,
        placement: Placement,
        addresses: Mapping[str, str] | None = None,
        dispatch_cfg: DispatchConfig | None = None,
    ):
        self.cfg, self.dispatch_cfg = cfg, dispatch_cfg or DispatchConfig()
        self.stats = DispatchStats()
        d = self.dispatch_cfg
        self.transports = Transports(
            d.transport,
            d.timeout_s,
            d.max_message_bytes,
            d.shm_capacity,
            d.secret,
            d.spin_us * 1e-6,
            d.device,
        )
        self.deadlines = Deadlines(d.timeout_s, d.deadline_floor_s, d.deadline_factor)
        self._retired: set[str] = set()
        self._pending = 0
        self._dead: dict[str, float] = {}  # address -> time it failed
        self.set_placement(placement, addresses)

    # ---- placement ----------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self.router.placement

    def set_placement(self, placement: Placement, addresses: Mapping[str, str] | None = None) -> None:
        """Route later dispatches with `placement` (call between steps). `addresses`: worker id ->
        "host:port" (None: the worker ids are the addresses). Every worker must already serve
        `placement.version`. Channels to addresses no longer used close once nothing is pending."""
        if placement.num_moe_layers != self.cfg.num_moe_layers:
            raise ValueError(
                f"placement has {placement.num_moe_layers} MoE layers, model has {self.cfg.num_moe_layers}"
            )
        addresses = dict(addresses) if addresses is not None else {w: w for w in placement.workers}
        missing = [w for w in placement.workers if w not in addresses]
        if missing:
            raise ValueError(f"no address for workers {missing}")
        self.router, self.addresses = SlotRouter(placement, self.cfg.n_routed_experts), addresses
        in_use = {addresses[w] for w in placement.workers}
        self._retired = (self._retired | self.transports.addresses) - in_use
        self._close_retired()
        self.transports.prepare(in_use)  # (each new worker's transport is chosen meanwhile)

    def _close_retired(self) -> None:
        if self._pending:
            return
        for address in self._retired:
            self.transports.forget(address)
        self._retired = set()

    def transport_of(self) -> dict[str, str]:
        """worker id -> the transport its calls use ("shm", "tcp", "grpc"; "choosing" while it is
        being chosen; "-" where none can serve)."""
        return {w: self.transports.transport_of(a) for w, a in self.addresses.items()}

    def transport_events(self) -> list[dict]:
        """The transports chosen and changed, oldest first (the last transport.MAX_EVENTS)."""
        return [asdict(e) for e in list(self.transports.events)]

    def _dead_workers(self, pending: PendingDispatch, within_s: float | None = None) -> frozenset[int]:
        """Indices (in the pending dispatch's placement) of workers that failed recently (in the
        last `within_s`; None: the cooldown)."""
        now, cooldown = time.monotonic(), self.dispatch_cfg.dead_worker_cooldown_s
        self._dead = {a: t for a, t in self._dead.items() if now - t < cooldown}
        if not self._dead:
            return frozenset()
        within = cooldown if within_s is None else within_s
        workers = pending.router.placement.workers
        return frozenset(
            i for i, w in enumerate(workers) if now - self._dead.get(pending.addresses[w], -1e9) < within
        )

    # ---- dispatch / combine ------------------------------------------------------------
    def dispatch(self, msg: ExpertDispatch) -> PendingDispatch:
        """Start the expert RPCs of one MoE layer; returns at once."""
        pending = PendingDispatch(msg, self.router, self.addresses)
        topk_idx = msg.topk_idx.cpu()
        # a worker that failed in the last `deadline_floor_s` is not waited for again where it holds
        # an expert's only replicas: the step fails at once and is retried (its retries apply a
        # new placement as soon as the balancer sends one); after that it is tried again
        pending.router.check_live(
            msg.moe_layer, topk_idx, self._dead_workers(pending, self.dispatch_cfg.deadline_floor_s)
        )
        route = pending.router.first(
            msg.moe_layer, topk_idx, msg.expert_counts.cpu(), self._dead_workers(pending)
        )
        pending.parts = self._send(pending, route)
        self._pending += 1
        return pending

    def combine(self, msg: ExpertCombine) -> torch.Tensor:
        """Wait for a dispatch's RPCs; [T, H] weighted sums in x's dtype (fp32 accumulation)."""
        pending: PendingDispatch = msg.handle
        parts, failed_workers, answered = pending.parts, set(), []
        try:
            while parts:
                failed = []
                for part in parts:
                    output = self._result(pending, part, failed)
                    if output is not None:
                        answered.append((part.rows, output))
                if not failed:
                    break
                failed_workers |= {p.worker for p in failed}
                pairs = torch.stack([p.pairs for p in failed]).any(0)
                self.stats.resent_pairs += int(pairs.sum())
                dead = self._dead_workers(pending) | failed_workers
                route = pending.router.resend(pending.msg.moe_layer, pending.msg.topk_idx.cpu(), pairs, dead)
                parts = self._send(pending, route)
            return sum_rows(answered, pending.msg.x)
        except BaseException:
            for part in parts:  # don't start calls for a step that failed (running ones time out)
                part.call.cancel()
            raise
        finally:
            for call in pending.calls:  # (their outputs are summed: the buffers may serve again)
                call.release()
            self._pending -= 1
            self._close_retired()

    def cancel(self, pending: PendingDispatch) -> None:
        """Drop a dispatch that will not be combined (its step failed elsewhere)."""
        for call in pending.calls:
            call.cancel()
            call.release()
        self._pending -= 1
        self._close_retired()

    def _result(self, pending: PendingDispatch, part: _Part, failed: list[_Part]) -> torch.Tensor | None:
        """A part's output [Tw, H], or None after recording a worker failure in `failed`."""
        placement = pending.router.placement
        address = pending.addresses[placement.workers[part.worker]]
        try:
            output = part.call.result()
            self.deadlines.observe(part.call.hidden.shape[0], time.monotonic() - part.call.started)
        except TransportError as e:
            code = e.code
            if code not in RETRYABLE:
                raise ExpertDispatchError(
                    f"decoder layer {pending.msg.decoder_layer}: worker {address} refused Dispatch "
                    f"(placement version {placement.version}): {code.name}: {e.details}"
                ) from None
            elapsed = time.monotonic() - part.call.started
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and Deadlines.caller_stalled(
                elapsed, part.call.timeout_s
            ):
                # this process was stalled (frozen, starved), not the worker: resent elsewhere for
                # this step (or the step retried), the worker not held dead
                log.warning("decoder layer %d: this process stalled %.1fs during a call to %s; resending",
                            pending.msg.decoder_layer, elapsed, address)  # fmt: skip
            else:
                log.warning("decoder layer %d: worker %s failed (%s: %s); resending",
                            pending.msg.decoder_layer, address, code.name, e.details)  # fmt: skip
                self._dead[address] = time.monotonic()
            failed.append(part)
            return None
        self.stats.bytes_received += part.call.nbytes_received
        x = pending.msg.x
        want = (x.shape[0] if part.rows is None else part.rows.numel(), x.shape[1])
        if output is None or tuple(output.shape) != want:
            got = None if output is None else list(output.shape)
            raise ExpertDispatchError(f"worker {address} answered shape {got}, expected {list(want)}")
        return output

    def _send(self, pending: PendingDispatch, route: Route) -> list[_Part]:
        """Start one RPC per worker of `route`. On the CPU each worker's request is written into
        its buffer in one kernel call (cpu_kernels.pack_share); elsewhere by torch ops."""
        weight = pending.msg.topk_weight.cpu().float()
        x = pending.msg.x
        if x.device.type == "cpu":
            rows = cpu_kernels.dispatch_rows(
                route.slot, route.slots_per_worker, len(pending.router.placement.workers)
            )
            if rows is not None:
                return [self._start(pending, route, w, weight, n) for w, n in enumerate(rows) if n]
        return [self._start(pending, route, w, weight) for w, _ in route.shares]

    def _open(self, pending: PendingDispatch, w: int, T: int) -> Call:
        x, placement, layer = pending.msg.x, pending.router.placement, pending.msg.decoder_layer
        address = pending.addresses[placement.workers[w]]
        try:
            return self.transports.open(address, layer, placement.version, (T, x.shape[1]), x.dtype,
                                        pending.msg.topk_idx.shape[1], self.deadlines.timeout_s(T))  # fmt: skip
        except TransportError as e:
            raise ExpertDispatchError(f"decoder layer {layer}: worker {address}: {e}") from None

    def _start(
        self,
        pending: PendingDispatch,
        route: Route,
        w: int,
        weight: torch.Tensor,
        num_rows: int | None = None,
    ) -> _Part:
        """Start the RPC of worker `w`'s share of `route` (routing weights `weight` [T, K]): its
        request holds only the rows it computes something for (`num_rows` of them, where known).
        The request is laid out first and its tensors are built in place: the gather of the rows is
        the one copy of the hidden states."""
        x = pending.msg.x
        if num_rows is not None:  # (CPU) one pass writes the request
            call = self._open(pending, w, num_rows)
            rows = cpu_kernels.pack_share(x, route.slot, weight, route.slots_per_worker, w, call.hidden, call.slot,
                                          call.weight)  # fmt: skip
            if rows is not None:
                return self._started(pending, w, None if num_rows == x.shape[0] else rows, route, call)
        mine, local = route.pairs(w), route.local_slot
        hit = mine.any(1)  # [T]
        rows = None if bool(hit.all()) else hit.nonzero().view(-1)
        if num_rows is None:
            call = self._open(pending, w, x.shape[0] if rows is None else rows.numel())
        slot, weight = (
            torch.where(mine, local, _NO_SLOT),
            torch.where(mine, weight, _NO_WEIGHT),
        )  # [T, K], small
        if rows is None:
            wire.copy_into(call.hidden, x)
        else:
            slot, weight = slot.index_select(0, rows), weight.index_select(0, rows)
            if x.device == call.hidden.device:
                torch.index_select(x, 0, rows.to(x.device), out=call.hidden)
            else:
                call.hidden.copy_(x.index_select(0, rows.to(x.device)))
        call.slot.copy_(slot)  # (to the device where the call's buffers are: cuda-ipc)
        call.weight.copy_(weight)
        return self._started(pending, w, rows, route, call)

    def _started(self, pending: PendingDispatch, w: int, rows, route: Route, call: Call) -> _Part:
        call.start()
        pending.calls.append(call)
        self.stats.rpcs += 1
        self.stats.shm_calls += call.transport == "shm"
        by = self.stats.calls_by_transport
        by[call.transport] = by.get(call.transport, 0) + 1
        self.stats.bytes_sent += call.nbytes_sent
        self.stats.bytes_copied += call.hidden.nbytes + call.slot.nbytes + call.weight.nbytes
        return _Part(w, rows, route, call)

    def close(self) -> None:
        self.transports.close()


_NO_SLOT = torch.tensor(-1, dtype=torch.int32)  # the slot of a pair another worker computes
_NO_WEIGHT = torch.tensor(0.0, dtype=torch.float32)


def sum_rows(answered: list[tuple[torch.Tensor | None, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The workers' partial sums added up per token: [T, H] like x (its dtype and device), summed
    in fp32. answered: (rows [Tw] int64 or None for all T rows, output [Tw, H]) per worker."""
    if len(answered) == 1 and answered[0][0] is None:
        # one worker computed every pair: its sum is the answer (copied: it views the response)
        return answered[0][1].to(device=x.device, dtype=x.dtype, copy=True)
    # summed where the answers are (the GPU for cuda-ipc: rows stay on the device), then moved
    device = answered[0][1].device if answered else x.device
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=device)
    for rows, output in answered:
        if rows is None:
            out.add_(output.to(device))
        else:
            out.index_add_(0, rows.to(device), output.to(device=device, dtype=torch.float32))
    return out.to(device=x.device, dtype=x.dtype)
