"""The data plane in shared memory, for an attention worker and an expert worker on one node.

One *channel* per in-flight Dispatch slot of a (client, expert worker) pair:

- a memfd of 2 x `capacity` bytes, mapped by both processes: the request region (hidden [T, H],
  slot [T, K] int32, weight [T, K] float32, each 64-byte aligned) and the response region (the
  output [T, H]). The client writes its rows straight into the request region (the gather of the
  rows is the one copy out), the expert computes from it and writes its sums into the response
  region (the one copy back is the client's sum over workers);
- a Unix SOCK_SEQPACKET connection, the doorbell: one small frame per request (layer, placement
  version, T, H, K, dtype) and one per answer (status, compute seconds, error text). A blocked
  `recv` wakes the other side: no thread pool in between, no serialisation of the tensors.

The expert worker listens on an abstract Unix address named after its gRPC address
(`abstract_address`), so a client finds it exactly when both are on one node (in one network
namespace), and nothing is left on disk when a process dies. The memfd travels with the
handshake (SCM_RIGHTS) and has no name: its memory is freed when both sides have closed it, so
a dead peer leaves no stale buffer behind. A client sees its peer die as the connection closing
(at once) or as no answer within its timeout.

Errors come back as gRPC status codes (`grpc.StatusCode`), so the dispatch client treats a
shared-memory failure as it treats a gRPC one (resend the pairs, or refuse the step).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc
import torch

from . import auth

log = logging.getLogger(__name__)

MAGIC = b"MOE1"
_HELLO = struct.Struct("<4sQ")  # magic, capacity (bytes of each region); then the cluster's secret
MAX_SECRET_BYTES = 1024
MAX_CHANNELS = 4096  # per expert worker (attention workers x in-flight calls)
_ACK = struct.Struct("<4sB")  # magic, accepted
_REQUEST = struct.Struct("<IIQIIIB")  # seq, layer, placement version, T, H, K, dtype code
_ANSWER = struct.Struct("<IId")  # seq, grpc status code value (0 = OK), compute seconds; then the error text
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN = 64
MAX_ERROR_BYTES = 4096
DEFAULT_CAPACITY = 8 << 20  # bytes per region: a decode step's rows (512 rows of 4096 fp32 values)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# memfd, abstract Unix sockets and peer credentials are Linux's: elsewhere (a macOS laptop) every
# pair takes gRPC
SUPPORTED = hasattr(os, "memfd_create") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "send_fds")


def recv_spinning(sock: socket.socket, size: int, spin_s: float, timeout_s: float | None) -> bytes:
    """sock.recv(size), first polling for up to spin_s seconds without sleeping, then blocking until
    timeout_s after the call began (None: no limit; TimeoutError past it: the polling counts). A
    blocked recv's wake-up is a scheduler round trip: a doorbell round trip took ~70 us blocked and
    ~7 us polling on this project's VM (docs/experts.md). Polling burns the core it runs on (and
    holds the GIL between its syscalls), so it pays only where each process has cores of its own
    (`--expert-spin-us`)."""
    if spin_s > 0:
        start = time.perf_counter()
        sock.settimeout(None)  # (blocking mode: with a timeout Python polls before each recv)
        end = start + (spin_s if timeout_s is None else min(spin_s, timeout_s))
        while True:
            try:
                return sock.recv(size, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    break
        if timeout_s is not None:
            timeout_s -= time.perf_counter() - start
            if timeout_s <= 0:
                raise TimeoutError(f"no message in {spin_s} s of polling")
    sock.settimeout(timeout_s)
    return sock.recv(size)


class TransportError(Exception):
    """A Dispatch call that failed, on either transport (the dispatch client's gRPC calls raise it
    too): `code`, the grpc.StatusCode that means it, and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


def abstract_address(grpc_address: str) -> bytes:
    """The Unix address (Linux abstract namespace: no file) an expert worker's shared-memory
    listener has, derived from its gRPC address."""
    return b"\0moe-cluster-expert/" + grpc_address.encode()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def request_layout(T: int, H: int, K: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(slot offset, weight offset, bytes) of a request [T, H] / [T, K] / [T, K] in its region."""
    slot_at = _align(T * H * dtype.itemsize)
    weight_at = _align(slot_at + T * K * 4)
    return slot_at, weight_at, weight_at + T * K * 4


class _Views:
    """(hidden, slot, weight, output) tensors viewing a channel's regions (`region`: its bytes),
    made once per shape (making them costs ~20 us; a decode step brings the same few shapes)."""

    MAX_SHAPES = 256

    def __init__(self, region: torch.Tensor, capacity: int):
        self.region, self.capacity = region, capacity
        self._made: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def __call__(self, T: int, H: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (T, H, K, dtype)
        views = self._made.get(key)
        if views is None:
            if len(self._made) >= self.MAX_SHAPES:
                self._made.clear()
            views = self._made[key] = _views(self.region, self.capacity, T, H, K, dtype)
        return views


def fits(T: int, H: int, K: int, dtype: torch.dtype, capacity: int) -> bool:
    """Whether a [T, H] request with K choices, and its answer, fit regions of `capacity` bytes."""
    return (
        dtype in DTYPES
        and request_layout(T, H, K, dtype)[2] <= capacity
        and T * H * dtype.itemsize <= capacity
    )


def request_parts(
    region: torch.Tensor, T: int, H: int, K: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """(hidden [T, H], slot [T, K] int32, weight [T, K] float32) viewing a request region laid
    out by `request_layout` (region: its bytes; also the TCP transport's buffers)."""
    slot_at, weight_at, _ = request_layout(T, H, K, dtype)
    hidden = region[: T * H * dtype.itemsize].view(dtype).view(T, H)
    slot = region[slot_at : slot_at + T * K * 4].view(torch.int32).view(T, K)
    weight = region[weight_at : weight_at + T * K * 4].view(torch.float32).view(T, K)
    return hidden, slot, weight


def _views(region: torch.Tensor, capacity: int, T: int, H: int, K: int, dtype: torch.dtype):
    """(hidden, slot, weight, output) tensors viewing a channel's regions (region: its bytes)."""
    output = region[capacity : capacity + T * H * dtype.itemsize].view(dtype).view(T, H)
    return *request_parts(region, T, H, K, dtype), output


# ---------------------------------------------------------------------------------------------
# The client side (the attention worker's dispatch client)
# ---------------------------------------------------------------------------------------------
class ShmChannel:
    """One request at a time to one expert worker through shared memory. Not thread-safe."""

    def __init__(self, sock: socket.socket, buf: mmap.mmap, capacity: int, spin_s: float = 0.0):
        self._sock, self._buf, self.capacity, self.spin_s = sock, buf, capacity, spin_s
        self._views = _Views(torch.frombuffer(buf, dtype=torch.uint8), capacity)
        self._seq = 0
        self.answered = True  # the last request's answer frame was read (the buffer is free)
        self._shape: tuple | None = None  # (T, H, K, dtype) of the request in flight
        self.closed = False

    @classmethod
    def connect(
        cls,
        grpc_address: str,
        capacity: int = DEFAULT_CAPACITY,
        timeout_s: float = 5.0,
        secret: str | None = None,
        spin_s: float = 0.0,
    ) -> ShmChannel | None:
        """A channel to the expert worker serving `grpc_address`, or None where it has no
        shared-memory listener on this node (another node, or a worker without one). spin_s: how
        long `result` polls for the answer before it blocks (`recv_spinning`)."""
        if not SUPPORTED:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout_s)
            sock.connect(abstract_address(grpc_address))
            if peer_uid(sock) != os.getuid():  # (anyone can bind an abstract name: not our secret's)
                raise OSError("the listener runs as another user")
        except OSError as e:
            if not isinstance(e, ConnectionRefusedError | FileNotFoundError):
                log.warning("no shared-memory channel to %s: %s", grpc_address, e)
            sock.close()
            return None
        fd = os.memfd_create("moe-dispatch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 2 * capacity)
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            )  # (no SIGBUS for the peer)
            buf = mmap.mmap(fd, 2 * capacity)
            socket.send_fds(sock, [_HELLO.pack(MAGIC, capacity) + (secret or "").encode()], [fd])
            ack = sock.recv(_ACK.size)
            if len(ack) != _ACK.size or _ACK.unpack(ack) != (MAGIC, 1):
                raise OSError(f"refused: {ack!r}")
        except OSError as e:
            log.info("no shared-memory channel to %s (%s); using gRPC", grpc_address, e)
            sock.close()
            return None
        finally:
            os.close(fd)  # (the mapping and the peer's copy keep the memory)
        sock.settimeout(None)
        return cls(sock, buf, capacity, spin_s)

    def fits(self, T: int, H: int, K: int, dtype: torch.dtype) -> bool:
        return fits(T, H, K, dtype, self.capacity)

    def request(self, T: int, H: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Writable views (hidden [T, H], slot [T, K] int32, weight [T, K] float32) of the next
        request: fill them, then `send`."""
        if not self.fits(T, H, K, dtype):
            raise ValueError(f"a [{T}, {H}] {dtype} request does not fit {self.capacity} bytes")
        self._shape = (T, H, K, dtype)
        return self._views(T, H, K, dtype)[:3]

    def send(self, layer: int, placement_version: int) -> None:
        T, H, K, dtype = self._shape
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self.answered = False  # (until its answer frame is read, the worker may still use the buffer)
        try:
            self._sock.send(_REQUEST.pack(self._seq, layer, placement_version, T, H, K, DTYPES.index(dtype)))
        except OSError as e:
            self.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker gone ({e})") from None

    def result(self, timeout_s: float) -> tuple[torch.Tensor, float]:
        """Wait for the answer: (output [T, H] viewing the response region, valid until the next
        request; compute seconds). TransportError: the worker's error, or UNAVAILABLE / DEADLINE_EXCEEDED."""
        try:
            frame = recv_spinning(self._sock, _ANSWER.size + MAX_ERROR_BYTES, self.spin_s, timeout_s)
        except TimeoutError:
            self.close()  # (an answer may still come: nobody must read it in a later call)
            raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout_s} s") from None
        except OSError as e:
            frame, error = b"", e
        else:
            error = "connection closed"
        self.answered = True
        if len(frame) < _ANSWER.size:
            self.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker gone ({error})")
        seq, code, seconds = _ANSWER.unpack_from(frame)
        if seq != self._seq:
            self.close()
            raise TransportError(grpc.StatusCode.INTERNAL, f"answer {seq} to request {self._seq}")
        if code:
            raise TransportError(
                _CODES.get(code, grpc.StatusCode.UNKNOWN), frame[_ANSWER.size :].decode(errors="replace")
            )
        T, H, K, dtype = self._shape
        return self._views(T, H, K, dtype)[3], seconds

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


# ---------------------------------------------------------------------------------------------
# The server side (the expert worker)
# ---------------------------------------------------------------------------------------------
# compute(layer, placement_version, hidden, slot, weight, out) -> compute seconds
Compute = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], float]


class ShmServer:
    """Serves an expert worker's Dispatch through shared memory: a listener on the worker's
    abstract Unix address and one thread per channel, which waits on its doorbell, checks the
    request against its buffer and runs `compute` straight from and into the shared regions.
    `status_of` maps a compute error to its gRPC status code (the worker keeps serving after any
    error; a malformed frame closes only its own channel). spin_s: how long a channel's thread
    polls for the next request after each answer before it blocks (`recv_spinning`)."""

    def __init__(self, grpc_address: str, compute: Compute, status_of: Callable[[Exception], grpc.StatusCode],
                 max_capacity: int = 1 << 30, secret: str | None = None, spin_s: float = 0.0):  # fmt: skip
        if not SUPPORTED:
            raise OSError("shared-memory channels need Linux (memfd, abstract Unix sockets, SO_PEERCRED)")
        self.compute, self.status_of, self.max_capacity = compute, status_of, max_capacity
        self.secret, self.spin_s = secret, spin_s
        self.refused = 0  # handshakes refused: another user's process, or no / a wrong secret
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(abstract_address(grpc_address))
        self._listener.listen(64)
        self._channels: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.requests = 0
        self._thread = threading.Thread(target=self._accept, name="shm-accept", daemon=True)
        self._thread.start()

    @property
    def channels(self) -> int:
        with self._lock:
            return len(self._channels)

    def _accept(self) -> None:
        accept_each(self._listener, lambda: self._closed, self._admit, "shared-memory")

    def _admit(self, conn: socket.socket) -> None:
        try:  # another user's process, or too many channels: refused before any thread or read
            if peer_uid(conn) != os.getuid() or self.channels >= MAX_CHANNELS:
                self.refused += 1
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), name="shm-channel", daemon=True).start()
        except (OSError, RuntimeError) as e:
            log.warning("shared-memory channel not started: %s", e)
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._channels.add(conn)
        buf = region = None
        try:
            conn.settimeout(10.0)
            hello, fds, _, _ = socket.recv_fds(conn, _HELLO.size + MAX_SECRET_BYTES, 1)
            conn.settimeout(None)
            if len(hello) < _HELLO.size or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise ValueError("bad handshake")
            magic, capacity = _HELLO.unpack_from(hello)
            if not self._admits(fds[0], hello[_HELLO.size :]):
                os.close(fds[0])
                self.refused += 1
                raise ValueError("refused: another user's process, or no / a wrong cluster secret")
            try:
                ok = magic == MAGIC and 0 < capacity <= self.max_capacity and capacity % ALIGN == 0
                if not ok or os.fstat(fds[0]).st_size < 2 * capacity:
                    raise ValueError(f"bad handshake: {magic!r}, capacity {capacity}")
                buf = mmap.mmap(fds[0], 2 * capacity)
                region = _Views(torch.frombuffer(buf, dtype=torch.uint8), capacity)
            finally:
                os.close(fds[0])
            conn.send(_ACK.pack(MAGIC, 1))
            while True:
                frame = recv_spinning(conn, _REQUEST.size + 1, self.spin_s, None)
                if not frame:
                    return  # the client closed
                conn.send(self._answer(frame, region, capacity))
        except (OSError, ValueError) as e:
            if not self._closed:
                log.info("shared-memory channel closed: %s", e)
        finally:
            with self._lock:
                self._channels.discard(conn)
            conn.close()
            del region, buf  # (the mapping closes once no view of it is left)

    def _admits(self, fd: int, secret: bytes) -> bool:
        """The peer (already checked to run as this process's user at accept) knows the cluster's
        secret, if any, and sealed its buffer's size (so it cannot shrink it under us)."""
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        sealed = seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        return bool(sealed) and (self.secret is None or auth.matches(self.secret, secret))

    def _answer(self, frame: bytes, views: _Views, capacity: int) -> bytes:
        """Run one request frame; the answer frame (a malformed request is answered INVALID_ARGUMENT)."""
        if len(frame) != _REQUEST.size:
            return _error(0, grpc.StatusCode.INVALID_ARGUMENT, f"request frame of {len(frame)} bytes")
        seq, layer, version, T, H, K, code = _REQUEST.unpack(frame)
        if code >= len(DTYPES) or T * H == 0 or K == 0:
            return _error(
                seq, grpc.StatusCode.INVALID_ARGUMENT, f"bad request: dtype {code}, [{T}, {H}], K {K}"
            )
        dtype = DTYPES[code]
        if not fits(T, H, K, dtype, capacity):
            return _error(
                seq, grpc.StatusCode.INVALID_ARGUMENT, f"[{T}, {H}] x {K} does not fit {capacity} bytes"
            )
        hidden, slot, weight, out = views(T, H, K, dtype)
        slot, weight = (
            slot.clone(),
            weight.clone(),
        )  # (checked, then used: the client cannot change them between)
        self.requests += 1
        try:
            seconds = self.compute(layer, version, hidden, slot, weight, out)
        except Exception as e:
            code = self.status_of(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("shared-memory Dispatch failed")
            return _error(seq, code, str(e))
        return _ANSWER.pack(seq, 0, seconds)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            channels = list(self._channels)
        for conn in channels:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def accept_each(listener: socket.socket, closed: Callable[[], bool], admit: Callable[[socket.socket], None],
                what: str) -> None:  # fmt: skip
    """Accept connections on `listener` until `closed()`, handing each to `admit` (which serves it
    on a thread of its own or refuses it); a failed accept is logged and tried again after 0.1 s."""
    while not closed():
        try:
            conn, _ = listener.accept()
        except OSError as e:
            if closed():
                return
            log.warning("%s accept failed: %s", what, e)
            time.sleep(0.1)
            continue
        admit(conn)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (the kernel's word)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _error(seq: int, code: grpc.StatusCode, message: str) -> bytes:
    return _ANSWER.pack(seq, code.value[0], 0.0) + message.encode()[:MAX_ERROR_BYTES]
