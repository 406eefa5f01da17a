"""The data plane over plain TCP connections, for an attention worker and an expert worker on
different nodes: the shared-memory transport's frames (services/dataplane/shm.py), with the tensors'
bytes following each frame on the same socket.

Why not gRPC: a gRPC round trip costs ~0.3 ms on loopback even over a persistent stream (HTTP/2
framing, protobuf, its completion-queue threads handing the message over), and torch.distributed's
gloo point-to-point costs the same; a blocking socket read by the thread that needs the answer
costs ~0.02 ms for the same 8 KB (a one-off measurement: docs/benchmarks.md). One call at a time per
connection; the client keeps a few per worker (micro-batches and parts in flight at once):

    client -> worker: REQUEST frame (seq, layer, placement version, T, H, K, dtype), then the
                      request region: hidden [T, H], slot [T, K] int32, weight [T, K] float32
                      (shm.request_layout: 64-byte aligned parts, so the client fills it in place)
    worker -> client: ANSWER frame (seq, status, compute seconds, n), then n bytes: the output
                      [T, H] (status 0) or the error text

Handshake: with a cluster secret the connection is mutual TLS with the cluster's identity (tls.py:
only a holder of the secret can serve it or connect to it: a stranger is cut in the TLS handshake,
before the worker reads a byte from it) and the client's first bytes inside it carry the secret
(auth.py), checked before anything else; without one (hand-started workers, tests) plaintext.
The worker's listener port is in its Stats (`socket_port`). A failure is a TransportError with
the gRPC status code that means it, so the dispatch client resends or refuses as for gRPC. A
malformed frame closes only its own connection; the worker keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading

import grpc
import torch

from services.rpc import wire

from . import auth, tls
from .frames import (
    ANSWER,
    DTYPES,
    REQUEST,
    Compute,
    FrameServer,
    StatusOf,
    TransportError,
    compute_answer,
    idle_alive,
    parse_request,
    read_answer,
    request_frame,
    request_layout,
    request_parts,
)

log = logging.getLogger(__name__)

MAGIC = b"MOT1"
_HELLO = struct.Struct("<4sH")  # magic, secret length; then the secret
_ACK = struct.Struct("<4sB")  # magic, accepted
MAX_CONNECTIONS = 4096  # per expert worker (attention workers x calls in flight)
MAX_HANDSHAKES = 64  # connections not yet past the secret check, per expert worker
HANDSHAKE_S = 10.0  # a connection that has not passed the secret check by then is cut
MAX_REQUEST_BYTES = wire.MAX_MESSAGE_BYTES  # as gRPC's: whatever gRPC would carry, TCP carries
KEEP_BYTES = 8 << 20  # buffers larger than this are dropped after their call


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed")
        got += n


def _send(sock: socket.socket, frame: bytes, payload: memoryview | bytes = b"") -> None:
    """`frame` and `payload` as one write (one wake-up for the reader, not two): one gathered
    sendmsg on a plain socket, one joined buffer under TLS (it encrypts a copy anyway)."""
    if isinstance(sock, ssl.SSLSocket):
        sock.sendall(b"".join((frame, payload)))
        return
    parts, left = [memoryview(frame), memoryview(payload).cast("B")], len(frame) + len(payload)
    while left:
        sent = sock.sendmsg(parts)
        left -= sent
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def _region(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """A byte buffer of at least `nbytes` (the old one while it is big enough)."""
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buf


def _server_context(secret: str) -> ssl.SSLContext:
    """Mutual TLS with the cluster's identity: a client without its certificate fails the handshake."""
    return tls.ssl_context(secret, server_side=True)


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive probes after 10 s idle, every 5 s, 3 unanswered: a peer whose host vanished
    (no FIN) is found within ~25 s instead of hours; no delay of small frames (TCP_NODELAY)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _client_context(secret: str) -> ssl.SSLContext:
    return tls.ssl_context(secret, server_side=False)  # (check_hostname: tls.EXPERT_NAME)


# ---------------------------------------------------------------------------------------------
# The client side (the attention worker's dispatch client)
# ---------------------------------------------------------------------------------------------
class TcpChannel:
    """One request at a time to one expert worker over one TCP connection. Not thread-safe."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._request: torch.Tensor | None = None  # the request region (filled in place)
        self._output: torch.Tensor | None = None
        self._frame = bytearray(ANSWER.size)
        self._seq = 0
        self._shape: tuple | None = None  # (T, H, K, dtype) of the request in flight
        self.answered = True  # the last request's answer was read (the connection is free)
        self.closed = False

    @classmethod
    def connect(cls, host: str, port: int, secret: str | None = None, timeout_s: float = 5.0) -> TcpChannel:
        """A connection to an expert worker's socket listener. OSError when it cannot be made, or
        the worker refuses it (a wrong secret)."""
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            _keepalive(sock)
            if secret is not None:
                sock = _client_context(secret).wrap_socket(sock, server_hostname=tls.EXPERT_NAME)
            token = (secret or "").encode()
            sock.sendall(_HELLO.pack(MAGIC, len(token)) + token)
            ack = bytearray(_ACK.size)
            _recv_exact(sock, memoryview(ack))
            if _ACK.unpack(ack) != (MAGIC, 1):
                raise ConnectionRefusedError(f"refused by {host}:{port}")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return cls(sock)

    def request(self, T: int, H: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Writable views (hidden [T, H], slot [T, K] int32, weight [T, K] float32) of the next
        request: fill them, then `send`."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype} cannot travel by socket")
        self._request = _region(self._request, request_layout(T, H, K, dtype)[2])
        self._shape = (T, H, K, dtype)
        return request_parts(self._request, T, H, K, dtype)

    def send(self, layer: int, placement_version: int, timeout_s: float) -> None:
        """Send the request (bounded by `timeout_s`: a worker that stopped reading fails it)."""
        T, H, K, dtype = self._shape
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self.answered = False
        frame = request_frame(self._seq, layer, placement_version, T, H, K, dtype)
        payload = memoryview(self._request.numpy())[: request_layout(T, H, K, dtype)[2]]
        try:
            self._sock.settimeout(timeout_s)
            _send(self._sock, frame, payload)
        except TimeoutError:
            self.close()
            raise TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request not taken in {timeout_s} s"
            ) from None
        except OSError as e:
            self.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker gone ({e})") from None

    def result(self, timeout_s: float) -> tuple[torch.Tensor, float]:
        """Wait for the answer: (output [T, H], valid until the next request; compute seconds).
        TransportError: the worker's error, or UNAVAILABLE / DEADLINE_EXCEEDED."""
        T, H, K, dtype = self._shape
        try:
            self._sock.settimeout(timeout_s)
            _recv_exact(self._sock, memoryview(self._frame))
            try:
                code, seconds, nbytes = read_answer(self._frame, self._seq, T * H * dtype.itemsize)
            except TransportError:
                self.close()
                raise
            if code is not None:
                text = bytearray(nbytes)
                _recv_exact(self._sock, memoryview(text))
                self.answered = True
                raise TransportError(code, text.decode(errors="replace"))
            self._output = _region(self._output, nbytes)
            _recv_exact(self._sock, memoryview(self._output.numpy())[:nbytes])
        except TimeoutError:
            self.close()  # (an answer may still come: nobody must read it in a later call)
            raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout_s} s") from None
        except OSError as e:
            self.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker gone ({e})") from None
        self.answered = True
        return self._output[: T * H * dtype.itemsize].view(dtype).view(T, H), seconds

    def alive(self) -> bool:
        """An idle connection is still usable: nothing to read on it (a closed one reads EOF)."""
        if not self.closed and not idle_alive(self._sock):
            self.close()
        return not self.closed

    def trim(self) -> None:
        """Drop buffers grown past KEEP_BYTES (a long prefill's) once their call is over."""
        if self._request is not None and self._request.numel() > KEEP_BYTES:
            self._request = None
        if self._output is not None and self._output.numel() > KEEP_BYTES:
            self._output = None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._sock.close()


# ---------------------------------------------------------------------------------------------
# The server side (the expert worker)
# ---------------------------------------------------------------------------------------------
class TcpServer(FrameServer):
    """Serves an expert worker's Dispatch over TCP: a listener beside its gRPC port and one thread
    per connection, which reads a request into its own buffer, checks it, runs `compute` into its
    answer buffer and sends that back. `status_of` maps a compute error to its gRPC status code.
    A connection must pass the handshake (TLS, then the secret) within HANDSHAKE_S, and at most
    MAX_HANDSHAKES may be at it at once: strangers cannot hold the worker's threads."""

    what = "socket"

    def __init__(self, host: str, compute: Compute, status_of: StatusOf, secret: str | None = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES, refusals: auth.Refusals | None = None):  # fmt: skip
        self.secret, self.max_request_bytes = secret, max_request_bytes
        self.refusals = refusals if refusals is not None else auth.Refusals()  # (by reason; `refused`: all)
        self._tls = _server_context(secret) if secret is not None else None
        self._handshaking: set[int] = set()  # connections not yet past the secret check
        self._cut_off: set[int] = set()  # connections the handshake deadline cut
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=128)  # fmt: skip
        self.port = listener.getsockname()[1]
        super().__init__(listener, compute, status_of, MAX_CONNECTIONS)

    def _admit(self, conn: socket.socket) -> bool:
        with self._lock:
            if len(self._handshaking) >= MAX_HANDSHAKES or len(self._connections) >= self.max_connections:
                self.refusals.add("tcp", "busy")  # (FrameServer counts it in `refused`)
                return False
            self._connections[id(conn)] = conn
            self._handshaking.add(id(conn))
            return True

    def _forget(self, conn: socket.socket) -> None:
        super()._forget(conn)
        with self._lock:
            self._handshaking.discard(id(conn))
            self._cut_off.discard(id(conn))

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self.refusals.add("tcp", reason)

    def _cut(self, raw: socket.socket) -> None:
        """(timer) Shut down the socket now carrying `raw` (its TLS wrapper once wrapped: the raw
        socket is detached then, and shutting it down would do nothing)."""
        with self._lock:
            conn = self._connections.get(id(raw))
            if conn is not None:
                self._cut_off.add(id(raw))
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.shutdown(socket.SHUT_RDWR)

    def _failed(self, raw: socket.socket, reason: str) -> None:
        """A handshake that raised: cut by the deadline, else `reason`."""
        with self._lock:
            cut = id(raw) in self._cut_off
        self._refuse("handshake_timeout" if cut else reason)

    def _handshake(self, raw: socket.socket) -> socket.socket | None:
        """Mutual TLS (with a secret), then the hello and its secret: the socket to serve, or None
        (refused, told so)."""
        _keepalive(raw)
        raw.settimeout(HANDSHAKE_S)
        conn = raw
        if self._tls is not None:
            try:
                conn = self._tls.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):  # (no TLS, no or not the cluster's certificate)
                self._failed(raw, "tls")
                raise
            self._track(raw, conn)
        try:
            refusal = self._admits(conn)
        except OSError:  # (a hello cut short)
            self._failed(raw, "bad_hello")
            raise
        if refusal is not None:
            self._refuse(refusal)
            conn.sendall(_ACK.pack(MAGIC, 0))
            return None
        conn.sendall(_ACK.pack(MAGIC, 1))
        return conn

    def _serve(self, raw: socket.socket) -> None:
        cut = threading.Timer(HANDSHAKE_S, self._cut, (raw,))
        cut.daemon = True
        cut.start()
        try:
            conn = self._handshake(raw)
            cut.cancel()
            with self._lock:
                self._handshaking.discard(id(raw))  # (its handshake slot is free for another)
            if conn is not None:
                self._serve_requests(conn)
        finally:  # (ssl.SSLError is an OSError: FrameServer logs it and closes the raw socket)
            cut.cancel()
            with self._lock:
                in_use = self._connections.get(id(raw))
            if in_use is not None and in_use is not raw:  # (its TLS wrapper)
                with contextlib.suppress(OSError):
                    in_use.close()

    def _serve_requests(self, conn: socket.socket) -> None:
        """Answer the connection's requests until the client closes it."""
        conn.settimeout(None)
        frame, request, output = bytearray(REQUEST.size), None, None
        while True:
            try:
                _recv_exact(conn, memoryview(frame))
            except ConnectionError:
                return  # the client closed
            answer, request, output = self._answer(conn, frame, request, output)
            _send(conn, *answer)
            if request.numel() > KEEP_BYTES:  # (a long prefill's buffers are not kept)
                request = None
            if output.numel() > KEEP_BYTES:
                output = None

    def _admits(self, conn: socket.socket) -> str | None:
        """Read the hello: None (admitted) or why not."""
        hello = bytearray(_HELLO.size)
        _recv_exact(conn, memoryview(hello))
        magic, length = _HELLO.unpack(hello)
        if magic != MAGIC or length > 1024:
            return "bad_hello"
        token = bytearray(length)
        _recv_exact(conn, memoryview(token))
        if self.secret is None or auth.matches(self.secret, bytes(token)):
            return None
        return "no_secret" if not length else "wrong_secret"

    def _answer(self, conn, frame: bytearray, request, output):
        """Read and run one request; ((answer frame[, payload]), request buffer, output buffer).
        ValueError (closing the connection) for a request whose bytes cannot be skipped safely."""
        req = parse_request(frame, self.max_request_bytes)  # (FrameError: a ValueError)
        request = _region(request, req.nbytes)
        _recv_exact(conn, memoryview(request.numpy())[: req.nbytes])
        output = _region(output, req.output_bytes)
        out = output[: req.output_bytes].view(req.dtype).view(req.T, req.H)
        self.requests += 1
        answer = compute_answer(
            req,
            self.compute,
            self.status_of,
            request_parts(request, req.T, req.H, req.K, req.dtype),
            out,
            self.what,
        )
        if ANSWER.unpack_from(answer)[1]:  # (an error: its text follows in the same buffer)
            return (answer,), request, output
        return (answer, memoryview(output.numpy())[: req.output_bytes]), request, output


def socket_host(address: str) -> str:
    """The host part of a "host:port" / "[v6]:port" gRPC address."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host
