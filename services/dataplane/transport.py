"""How one worker's share of a Dispatch travels: the transports under the dispatch client.

What crosses is the same whatever the transport: the worker's rows (hidden [Tw, H]), their
local slots [Tw, K] int32 and routing weights [Tw, K] float32 out, its partial sums [Tw, H]
back. The dispatch client (`dispatch.RemoteExperts`) asks `Transports.open` for a call, fills
the call's request views in place, starts it, and later takes its `result()`; the slot router,
resends and fault handling stay above, unchanged. Two transports:

- **shm** (services/dataplane/shm.py), when the expert worker is on this node: the rows are written
  into a shared-memory buffer of the pair and a doorbell wakes the worker's channel thread; the
  driver thread waits for the answer itself (no thread pool hop, no serialisation).
- **tcp** (services/dataplane/tcp.py), when it is not: the same frames over plain TCP connections (TLS
  with the cluster's identity when there is a secret), the rows sent straight from the buffer
  the client filled, the answer read by the driver thread itself: ~0.02 ms a small round trip on
  loopback where gRPC takes ~0.3 ms. A worker without a socket listener, or one that cannot be
  reached on its port, gets gRPC for a while.
- **grpc**: the portable path between nodes, protobuf bytes (services/rpc/wire.py) over one
  long-lived DispatchStream per worker (grpc_stream.py): the driver queues a request and later
  reads its answer off the stream itself, with no call set-up and no thread-pool hop per call.
  A worker that refuses a stream (all its streams in use) gets unary calls for a while.
- **grpc-unary**: a unary Dispatch call per request, started on a thread of the client's pool (a
  blocking call there overlaps the other work of the step): what the gRPC path was before streams.

`DispatchConfig.transport`: "auto" (shm where the worker has a shared-memory listener on this
node, else TCP, else gRPC streams), "tcp" (TCP, else gRPC: never shared memory), "grpc",
"grpc-unary", or "shm" (a worker without a listener on this node is an error: for one-node
deployments, tests and benchmarks that must not fall back).
In shm, a request larger than a channel's buffer (a long prefill chunk) still goes by gRPC.
Either way a failure is a `TransportError` with the gRPC status code that means it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from services.dataplane.shm import TransportError
from services.rpc import expert_pb2, expert_pb2_grpc, wire

from . import auth, shm, tcp, tls
from .grpc_stream import DeadlineWatch, GrpcStream, StreamCall, decode_answer

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "grpc", "grpc-unary", "shm", "tcp")
NO_SHM_RETRY_S = 30.0  # (also: how long a worker that refused a stream gets unary calls)


class Call:
    """One worker's share of one Dispatch: `hidden`, `slot`, `weight` are the request's writable
    views (fill them, then `start`); `result()` waits for the output [Tw, H] (valid until `release`)."""

    transport = ""
    hidden: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    nbytes_sent = 0
    nbytes_received = 0

    def start(self) -> None:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        raise NotImplementedError

    def cancel(self) -> None:
        """The answer will not be read (the step failed elsewhere)."""

    def release(self) -> None:
        """The output has been used: the call's buffers may serve another call."""


class GrpcCall(Call):
    transport = "grpc-unary"

    def __init__(self, stub: grpc.UnaryUnaryMultiCallable, pool: ThreadPoolExecutor, timeout_s: float,
                 placement_version: int, layer: int, shape: tuple[int, int], dtype: torch.dtype, top_k: int):  # fmt: skip
        self._stub, self._pool, self._timeout_s = stub, pool, timeout_s
        self._request = wire.DispatchRequestBuffer(layer, placement_version, shape, dtype, top_k)
        self.hidden, self.slot, self.weight = self._request.hidden, self._request.slot, self._request.weight
        self.nbytes_sent = len(self._request.data)
        self._future: Future | None = None

    def start(self) -> None:
        self._future = self._pool.submit(self._stub, self._request.data, timeout=self._timeout_s)

    def result(self) -> torch.Tensor:
        try:
            data = self._future.result()
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details()) from None
        self.nbytes_received = len(data)
        return wire.decode_dispatch_response(data).output

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()


class GrpcStreamCall(Call):
    transport = "grpc"

    def __init__(self, stream: GrpcStream, unary: Callable[[bytes], bytes], placement_version: int, layer: int,
                 shape: tuple[int, int], dtype: torch.dtype, top_k: int):  # fmt: skip
        self._stream, self._unary = stream, unary
        self._request = wire.DispatchRequestBuffer(layer, placement_version, shape, dtype, top_k)
        self.hidden, self.slot, self.weight = self._request.hidden, self._request.slot, self._request.weight
        self.nbytes_sent = len(self._request.data)
        self._call: StreamCall | None = None

    def start(self) -> None:
        self._call = self._stream.send(self._request.data)

    def result(self) -> torch.Tensor:
        try:
            data = self._stream.wait(self._call)
        except TransportError as e:
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or self._stream.answered:
                raise
            data = self._unary(self._request.data)  # (the worker refused the stream itself)
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

    def __init__(self, channel, idle: list, timeout_s: float, placement_version: int, layer: int,
                 shape: tuple[int, int], dtype: torch.dtype, top_k: int):  # fmt: skip
        self._channel, self._idle, self._timeout_s = channel, idle, timeout_s
        self._layer, self._version = layer, placement_version
        self.hidden, self.slot, self.weight = channel.request(*shape, top_k, dtype)
        self.nbytes_sent = self.hidden.nbytes + self.slot.nbytes + self.weight.nbytes
        self._error: TransportError | None = None
        self._released = False

    def start(self) -> None:
        try:
            self._send()
        except TransportError as e:  # (the worker is gone: reported by result(), as for gRPC)
            self._error = e

    def _send(self) -> None:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        output, _ = self._channel.result(self._timeout_s)
        self.nbytes_received = output.nbytes
        return output

    def cancel(self) -> None:
        self._channel.close()  # (its answer may still come: the channel is not used again)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if not self._channel.closed and self._channel.answered:
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
        self._channel.send(self._layer, self._version, self._timeout_s)  # (a send has a deadline too)

    def _reuse(self) -> None:
        self._channel.trim()  # (a long prefill's buffers are not kept)
        super()._reuse()


class Transports:
    """The calls of one dispatch client: gRPC channels and shared-memory channels per worker
    address, opened on first use. Not thread-safe (one driver thread)."""

    def __init__(self, transport: str, timeout_s: float, max_message_bytes: int, rpc_threads: int,
                 shm_capacity: int = shm.DEFAULT_CAPACITY, secret: str | None = None, spin_s: float = 0.0):  # fmt: skip
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.transport, self.timeout_s, self.shm_capacity = transport, timeout_s, shm_capacity
        self.spin_s = spin_s  # shared-memory answers: polled this long before blocking
        self.max_message_bytes, self.secret = (
            max_message_bytes,
            secret,
        )  # (the cluster's: services/dataplane/auth.py)
        self._grpc: dict[str, tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable]] = {}
        self._streams: dict[str, GrpcStream] = {}
        self._no_stream: dict[str, float] = {}  # address -> when it refused a stream
        self._watch = DeadlineWatch()
        self._idle: dict[str, list[shm.ShmChannel]] = {}  # address -> idle channels
        self._no_shm: dict[str, float] = {}  # address -> when it had no shared-memory listener here
        self._sockets: dict[str, list[tcp.TcpChannel]] = {}  # address -> idle TCP connections
        self._socket_port: dict[str, int] = {}  # address -> its TCP data plane's port
        self._socket_retry: dict[str, tuple[float, float]] = {}  # address -> (retry at, backoff s)
        self._connecting: set[str] = set()  # addresses a connection is being opened to
        self._pool = ThreadPoolExecutor(rpc_threads, thread_name_prefix="dispatch-rpc")
        self.used: dict[str, str] = {}  # address -> the transport of its last call

    def open(self, address: str, layer: int, placement_version: int, shape: tuple[int, int],
             dtype: torch.dtype, top_k: int) -> Call:  # fmt: skip
        """A call to the worker at `address` for a [Tw, H] request: shared memory where it can."""
        if self.transport in ("auto", "shm") and self._may_try_shm(address):
            channel = self._shm_channel(address)
            if channel is not None and channel.fits(*shape, top_k, dtype):
                self.used[address] = "shm"
                return ShmCall(channel, self._idle[address], self.timeout_s, placement_version, layer, shape,
                               dtype, top_k)  # fmt: skip
            if channel is not None:
                self._idle[address].append(channel)  # (too big for it: this one goes by gRPC)
        if self.transport == "shm" and address in self._no_shm:
            raise TransportError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"transport shm: expert worker {address} has no shared-memory listener on this node")  # fmt: skip
        if self.transport in ("auto", "tcp") and tcp.fits(*shape, top_k, dtype):
            channel = self._socket(address)
            if channel is not None:
                self.used[address] = "tcp"
                return TcpCall(channel, self._sockets[address], self.timeout_s, placement_version, layer, shape,
                               dtype, top_k)  # fmt: skip
        stream = self._stream(address)
        if stream is None:
            self.used[address] = "grpc-unary"
            return GrpcCall(self._stub(address), self._pool, self.timeout_s, placement_version, layer, shape,
                            dtype, top_k)  # fmt: skip
        self.used[address] = "grpc"
        return GrpcStreamCall(stream, lambda data: self._unary(address, data), placement_version, layer, shape,
                              dtype, top_k)  # fmt: skip

    def _stream(self, address: str) -> GrpcStream | None:
        """The open DispatchStream to `address` (a new one where the last broke); None for unary calls."""
        if self.transport == "grpc-unary":
            return None
        refused = self._no_stream.get(address)
        if refused is not None and time.monotonic() - refused < NO_SHM_RETRY_S:
            return None
        stream = self._streams.get(address)
        if stream is not None and stream.ended:
            stream.close()  # (ends gRPC's request thread of it too)
            del self._streams[address]
            if stream.refused:
                self._no_stream[address] = time.monotonic()
                log.info(
                    "expert worker %s refused a dispatch stream: unary calls for %.0f s",
                    address,
                    NO_SHM_RETRY_S,
                )
                return None
            stream = None
        if stream is None:
            self._stub(address)  # (opens the channel)
            call = self._grpc[address][0].stream_stream(
                wire.DISPATCH_STREAM_METHOD, request_serializer=None, response_deserializer=None
            )
            stream = self._streams[address] = GrpcStream(
                call, self._watch, self.timeout_s, auth.metadata(self.secret)
            )
        return stream

    def _unary(self, address: str, data: bytes) -> bytes:
        """One blocking Dispatch (a call whose stream was refused)."""
        try:
            return self._stub(address)(data, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details()) from None

    def _may_try_shm(self, address: str) -> bool:
        """No listener found for `address` is remembered for NO_SHM_RETRY_S (a full backlog or a
        slow handshake must not send a worker on this node to gRPC for good)."""
        since = self._no_shm.get(address)
        if since is not None and time.monotonic() - since > NO_SHM_RETRY_S:
            del self._no_shm[address]
        return address not in self._no_shm

    def _shm_channel(self, address: str) -> shm.ShmChannel | None:
        idle = self._idle.setdefault(address, [])
        while idle:
            channel = idle.pop()
            if not channel.closed:
                return channel
        channel = shm.ShmChannel.connect(address, self.shm_capacity, secret=self.secret, spin_s=self.spin_s)
        if channel is None and not idle:
            self._no_shm[address] = time.monotonic()
            del self._idle[address]
            log.info("expert worker %s: gRPC (no shared-memory listener on this node)", address)
        return channel

    def _socket(self, address: str) -> tcp.TcpChannel | None:
        """An idle live TCP connection to `address`; None (this call goes by gRPC) while there is
        none, and then one is opened in the background (the port lookup and the connect never
        block the driver: a firewalled port would cost seconds per worker)."""
        idle = self._sockets.setdefault(address, [])
        while idle:
            channel = idle.pop()
            if channel.alive():
                return channel
        if (
            address not in self._connecting
            and time.monotonic() >= self._socket_retry.get(address, (0.0, 0.0))[0]
        ):
            self._connecting.add(address)
            threading.Thread(
                target=self._connect, args=(address, idle), name="tcp-connect", daemon=True
            ).start()
        return None

    def _connect(self, address: str, idle: list[tcp.TcpChannel]) -> None:
        """Open a TCP connection to `address` into `idle` (learning its port from Stats once).
        A worker without a listener, or one that cannot be reached, is tried again after 30 s,
        then 60, ... up to 10 minutes (gRPC meanwhile)."""
        try:
            port = self._socket_port.get(address)
            if port is None:
                port = self._socket_port[address] = socket_port(address, self.secret)
            if not port:
                raise OSError("no socket listener")
            channel = tcp.TcpChannel.connect(tcp.socket_host(address), port, self.secret, timeout_s=2.0)
            if self._sockets.get(address) is idle:
                idle.append(channel)
            else:  # (forgotten meanwhile: the worker left the placement)
                channel.close()
            self._socket_retry.pop(address, None)
        except (OSError, grpc.RpcError, ValueError) as e:
            backoff = min(600.0, 2 * self._socket_retry.get(address, (0.0, NO_SHM_RETRY_S / 2))[1])
            self._socket_retry[address] = (time.monotonic() + backoff, backoff)
            log.info("expert worker %s: gRPC for %.0f s (no TCP data plane: %s)", address, backoff, e)
        finally:
            self._connecting.discard(address)

    def _stub(self, address: str) -> grpc.UnaryUnaryMultiCallable:
        entry = self._grpc.get(address)
        if entry is None:
            channel = tls.channel(address, self.secret, wire.grpc_options(self.max_message_bytes))
            call = auth.with_secret(channel, self.secret).unary_unary(
                wire.DISPATCH_METHOD, request_serializer=None, response_deserializer=None
            )
            entry = self._grpc[address] = (channel, call)
        return entry[1]

    def forget(self, address: str) -> None:
        """Close what is open to `address` (it left the placement, or died: a restarted worker gets
        fresh buffers)."""
        stream = self._streams.pop(address, None)
        if stream is not None:
            stream.close()
        self._no_stream.pop(address, None)
        entry = self._grpc.pop(address, None)
        if entry is not None:
            entry[0].close()
        for channel in self._idle.pop(address, []):
            channel.close()
        for connection in self._sockets.pop(address, []):
            connection.close()
        self._socket_port.pop(address, None)
        self._socket_retry.pop(address, None)
        self._no_shm.pop(address, None)
        self.used.pop(address, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watch.close()
        for address in list({*self._grpc, *self._idle, *self._streams, *self._sockets}):
            self.forget(address)


def socket_port(address: str, secret: str | None, timeout_s: float = 5.0) -> int:
    """The TCP data plane's port of the expert worker at `address` (its Stats; 0: none)."""
    channel = tls.channel(address, secret, wire.grpc_options())
    try:
        stub = expert_pb2_grpc.ExpertStub(auth.with_secret(channel, secret))
        return stub.Stats(expert_pb2.StatsRequest(), timeout=timeout_s).socket_port
    finally:
        channel.close()
