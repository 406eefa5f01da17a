"""How one worker's share of a Dispatch travels: one transport per (attention worker, expert worker) pair.

What crosses is the same whatever the transport: the worker's rows (hidden [Tw, H]), their
local slots [Tw, K] int32 and routing weights [Tw, K] float32 out, its partial sums [Tw, H]
back. The dispatch client (`remote_experts.RemoteExperts`) asks `Transports.open` for a call,
fills the call's request views in place, starts it, and later takes its `result()`; the slot
router, resends and fault handling stay above, unchanged. The transports:

- **cuda-ipc** (shm.py with cuda_ipc.py), when both compute on GPUs of this node: shared
  memory's channels with their buffers in this worker's GPU memory, opened by the expert worker
  through CUDA IPC: the rows never leave the device.
- **shm** (shm.py), when the expert worker is on this node: the rows are written into a
  shared-memory buffer of the pair and a doorbell wakes the worker's channel thread; the driver
  thread waits for the answer itself (no thread pool hop, no serialisation). A request larger
  than the pair's buffers gets a channel of its own for that call.
- **tcp** (tcp.py), when it is not: the same frames (frames.py) over TCP connections (TLS with the
  cluster's identity when there is a secret), the rows sent straight from the buffer the client
  filled, the answer read by the driver thread itself.
- **grpc** (grpc_stream.py): the portable path, protobuf bytes (services/rpc/wire.py) over one
  long-lived DispatchStream per worker; a worker that refuses a stream (all its streams in use)
  is sent unary Dispatch calls for a while, still by gRPC.

The transport is chosen once per pair, when the pair is first seen (`prepare`, on a thread of
its own, so the driver does not wait on a slow or unreachable port): `DispatchConfig.transport`
"auto" takes cuda-ipc where this client computes on a GPU and the worker opens its buffers on a
GPU of this node, else shm where the worker has a shared-memory listener on this node, else TCP
where it has a TCP data plane that answers, else gRPC; "tcp" tries TCP, then gRPC; "grpc" is
gRPC; "shm" and "cuda-ipc" are that transport or an error (FAILED_PRECONDITION on every call:
for deployments, tests and benchmarks that must not fall back). The choice and its reason are logged and kept as an
event (`events`), and `transport_of` says which one each pair uses now (`moe-cluster status`).

A pair whose transport can no longer open a channel (its worker restarted, its port closed)
falls back to gRPC: an event with the reason; the better transport is tried again after 30 s,
then 60, ... up to 10 minutes, on a thread of its own, and taken back (an event) once it works.
A pair that starts on a lesser transport than its mode prefers is retried the same way. Any
call's failure is a `TransportError` with the gRPC status code that means it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from services.rpc import expert_pb2, expert_pb2_grpc, wire

from . import auth, shm, tcp, tls
from .frames import TransportError, region_bytes
from .grpc_stream import DeadlineWatch, GrpcStream, StreamCall, decode_answer

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "cuda-ipc", "shm", "tcp", "grpc")
PREFERENCE = {
    "auto": ("cuda-ipc", "shm", "tcp", "grpc"),  # (cuda-ipc only where this client computes on a GPU)
    "cuda-ipc": ("cuda-ipc",),
    "shm": ("shm",),
    "tcp": ("tcp", "grpc"),
    "grpc": ("grpc",),
}
RETRY_S, MAX_RETRY_S = 30.0, 600.0  # a lesser transport's pair tries the better one again after
PROBE_S = 5.0  # deadline of each step of choosing (a connect, a Stats call) and of a new channel
MAX_EVENTS = 64


class Call:
    """One worker's share of one Dispatch: `hidden`, `slot`, `weight` are the request's writable
    views (fill them, then `start`); `result()` waits for the output [Tw, H] (valid until `release`)
    until `timeout_s` after the start."""

    transport = ""
    hidden: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    nbytes_sent = 0
    nbytes_received = 0
    timeout_s = 30.0
    started = 0.0  # time.monotonic() at start

    def left_s(self) -> float:
        """Seconds left before the call's deadline (a little at least: a wait must try)."""
        return max(1e-3, self.started + self.timeout_s - time.monotonic())

    def start(self) -> None:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        raise NotImplementedError

    def cancel(self) -> None:
        """The answer will not be read (the step failed elsewhere)."""

    def release(self) -> None:
        """The output has been used: the call's buffers may serve another call."""


class GrpcCall(Call):
    """A call on the pair's DispatchStream, or (`stream` None: the worker refused a stream) a
    unary Dispatch made when its result is asked for."""

    transport = "grpc"

    def __init__(self, link: GrpcLink, stream: GrpcStream | None, timeout_s: float, placement_version: int,
                 layer: int, shape: tuple[int, int], dtype: torch.dtype, top_k: int):  # fmt: skip
        self._link, self._stream, self.timeout_s = link, stream, timeout_s
        self._request = wire.DispatchRequestBuffer(layer, placement_version, shape, dtype, top_k)
        self.hidden, self.slot, self.weight = self._request.hidden, self._request.slot, self._request.weight
        self.nbytes_sent = len(self._request.data)
        self._call: StreamCall | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        if self._stream is not None:
            self._call = self._stream.send(self._request.data, self.timeout_s)

    def result(self) -> torch.Tensor:
        if self._stream is None:
            data = self._link.unary(self._request.data, self.left_s())
        else:
            try:
                data = self._stream.wait(self._call)
            except TransportError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or self._stream.answered:
                    raise
                data = self._link.unary(self._request.data, self.left_s())  # (the worker refused the stream)
        self.nbytes_received = len(data)
        return decode_answer(data)

    def cancel(self) -> None:
        if self._call is not None:
            self._call.abandoned = True  # (its answer, if it comes, is read past; no deadline)


class ChannelCall(Call):
    """A call over one of a pair's channels (a shared-memory channel or a TCP connection): the
    request views are the channel's own, the driver thread waits for the answer itself, and the
    channel goes back to the pair's idle ones once its answer has been used (a channel whose call
    was started and never answered is closed: the worker may still read and write its buffer)."""

    def __init__(self, channel, idle: list | None, timeout_s: float, placement_version: int, layer: int,
                 shape: tuple[int, int], dtype: torch.dtype, top_k: int):  # fmt: skip
        self._channel, self._idle, self.timeout_s = channel, idle, timeout_s  # idle None: not kept
        self._layer, self._version = layer, placement_version
        self.hidden, self.slot, self.weight = channel.request(*shape, top_k, dtype)
        self.nbytes_sent = self.hidden.nbytes + self.slot.nbytes + self.weight.nbytes
        self._error: TransportError | None = None
        self._released = False

    def start(self) -> None:
        self.started = time.monotonic()
        try:
            self._send()
        except TransportError as e:  # (the worker is gone: reported by result(), as for gRPC)
            self._error = e

    def _send(self) -> None:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        output, _ = self._channel.result(self.left_s())
        self.nbytes_received = output.nbytes
        return output

    def cancel(self) -> None:
        self._channel.close()  # (its answer may still come: the channel is not used again)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._idle is not None and not self._channel.closed and self._channel.answered:
                self._reuse()
            else:
                self._channel.close()

    def _reuse(self) -> None:
        self._idle.append(self._channel)


class ShmCall(ChannelCall):
    transport = "shm"

    def _send(self) -> None:
        self._channel.send(self._layer, self._version)


class TcpCall(ChannelCall):
    transport = "tcp"

    def _send(self) -> None:
        self._channel.send(self._layer, self._version, self.left_s())  # (a send has a deadline too)

    def _reuse(self) -> None:
        self._channel.trim()  # (a long prefill's buffers are not kept)
        super()._reuse()


class LinkDown(Exception):
    """A pair's transport cannot open a channel now (the message says why)."""


def _take_alive(idle: list):
    """The last idle channel (shm) or connection (TCP) that is still usable, or None; the dead
    ones met on the way are dropped (`alive` closes them)."""
    while idle:
        channel = idle.pop()
        if channel.alive():
            return channel
    return None


# ---------------------------------------------------------------------------------------------
# Links: one pair's open transport (its idle channels, connections or stream)
# ---------------------------------------------------------------------------------------------
class GrpcLink:
    """The pair's gRPC channel: its DispatchStream, unary Dispatch calls, and Stats (control)."""

    name = "grpc"

    def __init__(self, address: str, secret: str | None, max_message_bytes: int, watch: DeadlineWatch):
        self.address, self.secret, self._watch = address, secret, watch
        self._channel = tls.channel(address, secret, wire.grpc_options(max_message_bytes))
        channel = auth.with_secret(self._channel, secret)
        self._unary = channel.unary_unary(
            wire.DISPATCH_METHOD, request_serializer=None, response_deserializer=None
        )
        self._stream_method = self._channel.stream_stream(
            wire.DISPATCH_STREAM_METHOD, request_serializer=None, response_deserializer=None
        )
        self._stub = expert_pb2_grpc.ExpertStub(channel)
        self._stream: GrpcStream | None = None
        self._unary_until = 0.0  # the worker refused a stream: unary calls until then

    def open(self, layer: int, placement_version: int, shape: tuple[int, int], dtype: torch.dtype,
             top_k: int, timeout_s: float) -> Call:  # fmt: skip
        return GrpcCall(self, self._open_stream(), timeout_s, placement_version, layer, shape, dtype, top_k)

    def _open_stream(self) -> GrpcStream | None:
        """The open DispatchStream (a new one where the last broke); None for unary calls."""
        if time.monotonic() < self._unary_until:
            return None
        stream = self._stream
        if stream is not None and stream.ended:
            stream.close()  # (ends gRPC's request thread of it too)
            self._stream = None
            if stream.refused:
                self._unary_until = time.monotonic() + RETRY_S
                log.info(
                    "expert worker %s refused a dispatch stream: unary calls for %.0f s",
                    self.address,
                    RETRY_S,
                )
                return None
            stream = None
        if stream is None:
            stream = self._stream = GrpcStream(self._stream_method, self._watch, auth.metadata(self.secret))
        return stream

    def unary(self, data: bytes, timeout_s: float) -> bytes:
        """One blocking Dispatch."""
        try:
            return self._unary(data, timeout=timeout_s)
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details()) from None

    def socket_port(self, timeout_s: float) -> int:
        """The worker's TCP data plane port (its Stats; 0: none). grpc.RpcError if it does not answer."""
        return self._stub.Stats(expert_pb2.StatsRequest(), timeout=timeout_s).socket_port

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._channel.close()


class ShmLink:
    """The pair's shared-memory channels: idle ones of `capacity` bytes a region kept for reuse,
    one made to measure (and closed after its call) for a request they cannot hold. Their buffers
    on `device`: the host ("shm") or this process's GPU ("cuda-ipc")."""

    def __init__(self, address: str, capacity: int, secret: str | None, spin_s: float,
                 device: torch.device = torch.device("cpu")):  # fmt: skip
        self.address, self.capacity, self.secret, self.spin_s = address, capacity, secret, spin_s
        self.device = device
        self.name = "cuda-ipc" if device.type == "cuda" else "shm"
        self._idle: list[shm.ShmChannel] = [self._connect(capacity, PROBE_S)]  # (OSError: no listener)

    def _connect(self, capacity: int, timeout_s: float) -> shm.ShmChannel:
        return shm.ShmChannel.connect(
            self.address, capacity, timeout_s, self.secret, self.spin_s, self.device
        )

    def open(self, layer: int, placement_version: int, shape: tuple[int, int], dtype: torch.dtype,
             top_k: int, timeout_s: float) -> Call:  # fmt: skip
        needed = region_bytes(*shape, top_k, dtype)
        idle = self._idle if needed <= self.capacity else None
        channel = _take_alive(idle) if idle is not None else None
        if channel is None:
            capacity = self.capacity if idle is not None else shm.capacity_for(needed)
            if capacity > shm.MAX_CAPACITY:
                raise TransportError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"a request of {needed} bytes: over {shm.MAX_CAPACITY} bytes")  # fmt: skip
            try:  # (within the call's deadline: a hung worker must not hold the step longer)
                channel = self._connect(capacity, min(PROBE_S, timeout_s))
            except OSError as e:
                raise LinkDown(f"no {self.name} channel: {e!r}") from None
        return ShmCall(channel, idle, timeout_s, placement_version, layer, shape, dtype, top_k)

    def close(self) -> None:
        for channel in self._idle:
            channel.close()
        self._idle = []


class TcpLink:
    """The pair's TCP connections to the worker's data plane port: idle live ones kept for reuse."""

    name = "tcp"

    def __init__(self, address: str, port: int, secret: str | None):
        self.host, self.port, self.secret = tcp.socket_host(address), port, secret
        self._idle: list[tcp.TcpChannel] = [self._connect()]  # (OSError: it cannot be reached)

    def _connect(self, timeout_s: float = PROBE_S) -> tcp.TcpChannel:
        return tcp.TcpChannel.connect(self.host, self.port, self.secret, timeout_s=timeout_s)

    def open(self, layer: int, placement_version: int, shape: tuple[int, int], dtype: torch.dtype,
             top_k: int, timeout_s: float) -> Call:  # fmt: skip
        needed = region_bytes(*shape, top_k, dtype)
        if needed > tcp.MAX_REQUEST_BYTES:
            raise TransportError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"a request of {needed} bytes: over {tcp.MAX_REQUEST_BYTES} bytes")  # fmt: skip
        channel = _take_alive(self._idle)
        if channel is None:
            try:  # (within the call's deadline, as above)
                channel = self._connect(min(PROBE_S, timeout_s))
            except OSError as e:
                raise LinkDown(f"no TCP connection to {self.host}:{self.port}: {e!r}") from None
        return TcpCall(channel, self._idle, timeout_s, placement_version, layer, shape, dtype, top_k)

    def close(self) -> None:
        for channel in self._idle:
            channel.close()
        self._idle = []


# ---------------------------------------------------------------------------------------------
# Pairs: the choice, made once, and its events
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransportEvent:
    """A pair's transport chosen or changed."""

    at: float  # time.time()
    worker: str  # the expert worker's address
    transport: str  # what its calls use from now on ("" for none: transport shm without a listener)
    reason: str


class Pair:
    """One expert worker as this client reaches it: the link its calls use and why."""

    def __init__(self, address: str, grpc_link: GrpcLink):
        self.address, self.grpc = address, grpc_link
        self.link: GrpcLink | ShmLink | TcpLink | None = None  # None: none can serve (shm mode)
        self.reason = ""
        self.chosen = threading.Event()  # set once the first choice is made
        self.better: GrpcLink | ShmLink | TcpLink | None = None  # found by a retry, taken at the next call
        self.retry_at, self.backoff, self.probing = float("inf"), RETRY_S, False

    @property
    def transport(self) -> str:
        if not self.chosen.is_set():
            return "choosing"
        return "-" if self.link is None else self.link.name


class Transports:
    """The transports of one dispatch client, one chosen per expert worker address. `open` is
    for the one driver thread; choosing runs on threads of its own."""

    def __init__(self, transport: str, timeout_s: float, max_message_bytes: int,
                 shm_capacity: int = shm.DEFAULT_CAPACITY, secret: str | None = None, spin_s: float = 0.0,
                 device: torch.device | str = "cpu"):  # fmt: skip
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.device = torch.device(device)  # where this client's rows are
        if transport == "cuda-ipc" and self.device.type != "cuda":
            raise ValueError(f"transport cuda-ipc: this client computes on {self.device}, not a GPU")
        self.mode, self.timeout_s, self.shm_capacity = transport, timeout_s, shm_capacity
        # the transports to try, best first (cuda-ipc only from a GPU)
        self.preference = tuple(
            t for t in PREFERENCE[transport] if t != "cuda-ipc" or self.device.type == "cuda"
        )
        self.max_message_bytes, self.secret = max_message_bytes, secret  # (the cluster's: auth.py)
        self.spin_s = spin_s  # shared-memory answers: polled this long before blocking
        self._watch = DeadlineWatch()
        self._pairs: dict[str, Pair] = {}
        self._lock = threading.Lock()  # (pairs and events: choosing threads write them)
        self.events: collections.deque[TransportEvent] = collections.deque(maxlen=MAX_EVENTS)

    # ---- the driver's side --------------------------------------------------------------
    def prepare(self, addresses) -> None:
        """Start choosing the transport of every address not seen before (returns at once)."""
        for address in addresses:
            self._pair(address)

    def open(self, address: str, layer: int, placement_version: int, shape: tuple[int, int],
             dtype: torch.dtype, top_k: int, timeout_s: float | None = None) -> Call:  # fmt: skip
        """A call to the worker at `address` for a [Tw, H] request, on the pair's transport
        (waiting, the first time, for the choice: a few seconds at most), answered within
        `timeout_s` of its start (None: the configured dispatch timeout)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        pair = self._pair(address)
        pair.chosen.wait()
        if pair.better is not None:
            self._switch(pair, pair.better, "restored: it answers again")
        elif time.monotonic() >= pair.retry_at and not pair.probing:
            self._probe(pair, retry=True)
        if pair.link is None:
            raise TransportError(grpc.StatusCode.FAILED_PRECONDITION, pair.reason)
        t0 = time.monotonic()
        try:
            return pair.link.open(layer, placement_version, shape, dtype, top_k, timeout_s)
        except LinkDown as e:
            if "grpc" not in self.preference:  # (transport shm: no fallback; the next call tries again)
                raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker {address}: {e}") from None
            self._switch(pair, pair.grpc, f"{pair.link.name} lost: {e}", retry=True)
            left = timeout_s - (time.monotonic() - t0)  # (the deadline counts from this call's start)
            if left <= 0.01:
                raise TransportError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"expert worker {address}: {e}"
                ) from None
            return pair.link.open(layer, placement_version, shape, dtype, top_k, left)

    @property
    def addresses(self) -> set[str]:
        """The addresses a transport is chosen (or being chosen) for."""
        return set(self._pairs)

    def transport_of(self, address: str) -> str:
        """The transport calls to `address` use now ("-": none yet)."""
        pair = self._pairs.get(address)
        return "-" if pair is None else pair.transport

    def forget(self, address: str) -> None:
        """Close what is open to `address` (it left the placement, or died: a restarted worker is
        chosen for again)."""
        with self._lock:
            pair = self._pairs.pop(address, None)
        if pair is not None:
            for link in {id(x): x for x in (pair.link, pair.better, pair.grpc) if x is not None}.values():
                link.close()

    def close(self) -> None:
        self._watch.close()
        for address in list(self._pairs):
            self.forget(address)

    # ---- choosing -----------------------------------------------------------------------
    def _pair(self, address: str) -> Pair:
        pair = self._pairs.get(address)
        if pair is None:
            grpc_link = GrpcLink(address, self.secret, self.max_message_bytes, self._watch)
            with self._lock:
                pair = self._pairs[address] = Pair(address, grpc_link)
            self._probe(pair, retry=False)
        return pair

    def _probe(self, pair: Pair, retry: bool) -> None:
        pair.probing = True
        threading.Thread(
            target=self._choose, args=(pair, retry), name="transport-choice", daemon=True
        ).start()

    def _choose(self, pair: Pair, retry: bool) -> None:
        """Try the mode's transports in order of preference; the first that works is the pair's
        (a retry offers it as `better` only where it beats the current one)."""
        reasons, link = [], None
        order = self.preference
        if retry and pair.link is not None:
            order = order[: order.index(pair.link.name)]  # (only the better ones)
        try:
            for name in order:
                try:
                    link = self._connect(name, pair)
                    break
                except (OSError, grpc.RpcError) as e:
                    reasons.append(f"{name}: {_why(e)}")
            if retry:
                if link is not None and self._forgotten(pair):
                    link.close()  # (the worker left the placement while this retry ran)
                elif link is not None:
                    pair.better = link
                else:
                    pair.backoff = min(MAX_RETRY_S, 2 * pair.backoff)
                    pair.retry_at = time.monotonic() + pair.backoff
                return
            if link is None:
                reason = f"transport {self.mode}: expert worker {pair.address} has no {self.mode} listener for this client ({'; '.join(reasons)})"  # fmt: skip
            else:
                reason = _chosen_because(link, reasons)
            self._switch(pair, link, reason, retry=link is None or link.name != order[0])
        finally:
            pair.probing = False
            pair.chosen.set()

    def _connect(self, name: str, pair: Pair) -> GrpcLink | ShmLink | TcpLink:
        if name in ("shm", "cuda-ipc"):
            device = self.device if name == "cuda-ipc" else torch.device("cpu")
            return ShmLink(pair.address, self.shm_capacity, self.secret, self.spin_s, device)
        if name == "tcp":
            port = pair.grpc.socket_port(PROBE_S)
            if not port:
                raise OSError("the worker has no TCP data plane")
            return TcpLink(pair.address, port, self.secret)
        return pair.grpc

    def _switch(self, pair: Pair, link, reason: str, retry: bool = False) -> None:
        """Make `link` the pair's (closing the one it replaces, but for the gRPC link, kept for
        Stats and fallbacks), as an event."""
        old, pair.link, pair.better, pair.reason = pair.link, link, None, reason
        if old is not None and old is not link and old is not pair.grpc:
            old.close()
        if retry:
            pair.retry_at = time.monotonic() + pair.backoff
        else:
            pair.retry_at, pair.backoff = float("inf"), RETRY_S
        event = TransportEvent(time.time(), pair.address, "" if link is None else link.name, reason)
        with self._lock:
            self.events.append(event)
        first_choice = link is not None and link.name == self.preference[0]
        log.log(
            logging.INFO if old is None and first_choice else logging.WARNING,
            "expert worker %s: %s (%s)",
            pair.address,
            event.transport or "no transport",
            reason,
        )

    def _forgotten(self, pair: Pair) -> bool:
        return self._pairs.get(pair.address) is not pair


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, ConnectionRefusedError | FileNotFoundError):
        return "no listener"
    return str(e) or type(e).__name__


def _chosen_because(link, reasons: list[str]) -> str:
    why = {
        "cuda-ipc": "it opens this GPU's buffers",
        "shm": "a shared-memory listener on this node",
        "tcp": "its TCP data plane answers",
        "grpc": "gRPC",
    }
    return "; ".join([*(f"no {r}" for r in reasons), why[link.name]])
