"""The data plane in shared memory, for an attention worker and an expert worker on one node.

One *channel* per in-flight Dispatch slot of a (client, expert worker) pair:

- a memfd of 2 x `capacity` bytes, mapped by both processes: the request region (hidden [T, H],
  slot [T, K] int32, weight [T, K] float32, each 64-byte aligned) and the response region (the
  output [T, H]). The client writes its rows straight into the request region (the gather of the
  rows is the one copy out), the expert computes from it and writes its sums into the response
  region (the one copy back is the client's sum over workers);
- a Unix SOCK_SEQPACKET connection, the doorbell: one request frame and one answer frame per
  call (frames.py; an error's text rides in its answer's packet). A blocked `recv` wakes the
  other side: no thread pool in between, no serialisation of the tensors.

The expert worker listens on an abstract Unix address named after its gRPC address
(`abstract_address`), so a client finds it exactly when both are on one node (in one network
namespace), and nothing is left on disk when a process dies. The memfd travels with the
handshake (SCM_RIGHTS) and has no name: its memory is freed when both sides have closed it, so
a dead peer leaves no stale buffer behind. A client sees its peer die as the connection closing
(at once) or as no answer within its timeout.

A request larger than a channel holds (a long prefill chunk) gets a channel of its own, sized to
it and closed after its call: every call of the pair stays in shared memory.

A channel's regions may instead live on the attention worker's GPU (`device` cuda: the
"cuda-ipc" transport, cuda_ipc.py): the same doorbell and frames, the buffer shared by its CUDA
IPC handle in the handshake instead of a memfd, each side synchronising its stream before it
rings. An expert worker that computes on the CPU, or cannot see that GPU, refuses such a
channel with the reason. Errors come back as
gRPC status codes (`frames.TransportError`), as on every transport.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import struct
import time

import grpc
import torch

from . import auth, cuda_ipc
from .frames import (
    ALIGN,
    ANSWER,
    MAX_ERROR_BYTES,
    REQUEST,
    Compute,
    FrameError,
    FrameServer,
    StatusOf,
    TransportError,
    compute_answer,
    error_answer,
    idle_alive,
    parse_request,
    read_answer,
    region_bytes,
    request_frame,
    request_parts,
)

log = logging.getLogger(__name__)

MAGIC = b"MOE1"  # a host channel: its memfd travels with the hello (SCM_RIGHTS)
MAGIC_CUDA = b"MOC1"  # a device channel: its IPC handle follows the hello (cuda_ipc.IpcHandle)
_HELLO = struct.Struct("<4sQ")  # magic, capacity (bytes of each region); [handle]; the cluster's secret
MAX_SECRET_BYTES = 1024
MAX_CHANNELS = 4096  # per expert worker (attention workers x in-flight calls)
_ACK = struct.Struct("<4sB")  # magic, answer (ACCEPTED, or why not); then a reason's text
REFUSED, ACCEPTED, NOT_HERE = 0, 1, 2  # NOT_HERE: a device channel this worker cannot open
DEFAULT_CAPACITY = 8 << 20  # bytes per region: a decode step's rows (512 rows of 4096 fp32 values)
MAX_CAPACITY = 1 << 30  # bytes per region at most (a server refuses larger buffers)
# memfd, abstract Unix sockets and peer credentials are Linux's: elsewhere (a macOS laptop) every
# pair takes another transport
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


def abstract_address(grpc_address: str) -> bytes:
    """The Unix address (Linux abstract namespace: no file) an expert worker's shared-memory
    listener has, derived from its gRPC address."""
    return b"\0moe-cluster-expert/" + grpc_address.encode()


def capacity_for(nbytes: int) -> int:
    """The region size of a channel made for a request of `nbytes`: the next power of two."""
    return max(DEFAULT_CAPACITY, 1 << (max(nbytes, 1) - 1).bit_length())


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
            output = (
                self.region[self.capacity : self.capacity + T * H * dtype.itemsize].view(dtype).view(T, H)
            )
            views = self._made[key] = (*request_parts(self.region, T, H, K, dtype), output)
        return views


# ---------------------------------------------------------------------------------------------
# The client side (the attention worker's dispatch client)
# ---------------------------------------------------------------------------------------------
class ShmChannel:
    """One request at a time to one expert worker through shared memory (`region`: uint8 [2 x
    capacity] on the host or, for cuda-ipc, on this process's GPU). Not thread-safe."""

    def __init__(self, sock: socket.socket, region: torch.Tensor, capacity: int, spin_s: float = 0.0):
        self._sock, self._region, self.capacity, self.spin_s = sock, region, capacity, spin_s
        self.device = region.device
        self._views = _Views(region, capacity)
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
        device: torch.device | str = "cpu",
    ) -> ShmChannel:
        """A channel to the expert worker serving `grpc_address`, its regions on `device` (a
        CUDA device: cuda-ipc). OSError where it has no shared-memory listener on this node
        (another node, or a worker without one: a ConnectionRefusedError), refuses the channel
        (PermissionError), or cannot open a device channel (OSError with its reason). spin_s:
        how long `result` polls for the answer before it blocks (`recv_spinning`)."""
        if not SUPPORTED:
            raise OSError("shared-memory channels need Linux (memfd, abstract Unix sockets, SO_PEERCRED)")
        device = torch.device(device)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout_s)
            sock.connect(abstract_address(grpc_address))
            if peer_uid(sock) != os.getuid():  # (anyone can bind an abstract name: not our secret's)
                raise PermissionError("the listener runs as another user")
            token = (secret or "").encode()
            if device.type == "cuda":
                region = torch.empty(2 * capacity, dtype=torch.uint8, device=device)
                handle = cuda_ipc.share(region).encode()
                sock.send(_HELLO.pack(MAGIC_CUDA, capacity) + handle + token)
            else:
                region = torch.frombuffer(_host_buffer(sock, capacity, token), dtype=torch.uint8)
            _check_ack(sock.recv(_ACK.size + MAX_ERROR_BYTES))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return cls(sock, region, capacity, spin_s)

    def alive(self) -> bool:
        """An idle channel is still usable: its worker has not closed it."""
        if not self.closed and not idle_alive(self._sock):
            self.close()
        return not self.closed

    def fits(self, T: int, H: int, K: int, dtype: torch.dtype) -> bool:
        return region_bytes(T, H, K, dtype) <= self.capacity

    def request(self, T: int, H: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Writable views (hidden [T, H], slot [T, K] int32, weight [T, K] float32) of the next
        request: fill them, then `send`."""
        if not self.fits(T, H, K, dtype):
            raise ValueError(f"a [{T}, {H}] {dtype} request does not fit {self.capacity} bytes")
        self._shape = (T, H, K, dtype)
        return self._views(T, H, K, dtype)[:3]

    def send(self, layer: int, placement_version: int) -> None:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self.answered = False  # (until its answer frame is read, the worker may still use the buffer)
        if self.device.type == "cuda":
            cuda_ipc.synchronize(self.device)  # (the request's rows are written before the doorbell)
        try:
            self._sock.send(request_frame(self._seq, layer, placement_version, *self._shape))
        except OSError as e:
            self.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker gone ({e})") from None

    def result(self, timeout_s: float) -> tuple[torch.Tensor, float]:
        """Wait for the answer: (output [T, H] viewing the response region, valid until the next
        request; compute seconds). TransportError: the worker's error, or UNAVAILABLE / DEADLINE_EXCEEDED."""
        try:
            frame = recv_spinning(self._sock, ANSWER.size + MAX_ERROR_BYTES, self.spin_s, timeout_s)
        except TimeoutError:
            self.close()  # (an answer may still come: nobody must read it in a later call)
            raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout_s} s") from None
        except OSError as e:
            frame, error = b"", e
        else:
            error = "connection closed"
        self.answered = True
        if len(frame) < ANSWER.size:
            self.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert worker gone ({error})")
        T, H, K, dtype = self._shape
        try:
            code, seconds, _ = read_answer(frame, self._seq, T * H * dtype.itemsize)
        except TransportError:
            self.close()
            raise
        if code is not None:
            raise TransportError(code, frame[ANSWER.size :].decode(errors="replace"))
        return self._views(T, H, K, dtype)[3], seconds

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


def _host_buffer(sock: socket.socket, capacity: int, token: bytes) -> mmap.mmap:
    """A memfd of two regions, sealed against resizing (the peer cannot be sent SIGBUS by a
    shrink), mapped here and sent with the hello; the mapping."""
    fd = os.memfd_create("moe-dispatch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 2 * capacity)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        buf = mmap.mmap(fd, 2 * capacity)
        socket.send_fds(sock, [_HELLO.pack(MAGIC, capacity) + token], [fd])
    finally:
        os.close(fd)  # (the mapping and the peer's copy keep the memory)
    return buf


def _check_ack(ack: bytes) -> None:
    if len(ack) < _ACK.size or _ACK.unpack_from(ack)[0] != MAGIC:
        raise PermissionError(f"refused: {ack[: _ACK.size]!r}")
    answer, reason = _ACK.unpack_from(ack)[1], ack[_ACK.size :].decode(errors="replace")
    if answer == NOT_HERE:
        raise OSError(reason)
    if answer != ACCEPTED:
        raise PermissionError(f"refused: {reason or answer}")


# ---------------------------------------------------------------------------------------------
# The server side (the expert worker)
# ---------------------------------------------------------------------------------------------
class ShmServer(FrameServer):
    """Serves an expert worker's Dispatch through shared memory: a listener on the worker's
    abstract Unix address and one thread per channel, which waits on its doorbell, checks the
    request against its buffer and runs `compute` straight from and into the shared regions.
    `status_of` maps a compute error to its gRPC status code (the worker keeps serving after any
    error; a malformed frame is answered INVALID_ARGUMENT). spin_s: how long a channel's thread
    polls for the next request after each answer before it blocks (`recv_spinning`). `device`:
    where the worker computes; a CUDA one also serves device (cuda-ipc) channels."""

    what = "shared-memory"

    def __init__(self, grpc_address: str, compute: Compute, status_of: StatusOf,
                 max_capacity: int = MAX_CAPACITY, secret: str | None = None, spin_s: float = 0.0,
                 device: torch.device | str = "cpu", refusals: auth.Refusals | None = None):  # fmt: skip
        if not SUPPORTED:
            raise OSError("shared-memory channels need Linux (memfd, abstract Unix sockets, SO_PEERCRED)")
        self.max_capacity, self.secret, self.spin_s = max_capacity, secret, spin_s
        self.refusals = refusals if refusals is not None else auth.Refusals()  # (by reason; `refused`: all)
        self.device = torch.device(device)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(abstract_address(grpc_address))
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        super().__init__(listener, compute, status_of, MAX_CHANNELS)

    @property
    def channels(self) -> int:
        return self.connections

    def _admit(self, conn: socket.socket) -> bool:
        # another user's process, or too many channels: refused before any thread or read
        # (FrameServer counts it in `refused`)
        try:
            if peer_uid(conn) != os.getuid():
                self.refusals.add("shm", "other_user")
                return False
        except OSError:
            self.refusals.add("shm", "other_user")
            return False
        if not super()._admit(conn):
            self.refusals.add("shm", "busy")
            return False
        return True

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        hello, fds, _, _ = socket.recv_fds(
            conn, _HELLO.size + cuda_ipc.MAX_HANDLE_BYTES + MAX_SECRET_BYTES, 1
        )
        conn.settimeout(None)
        try:
            region, capacity = self._open(conn, hello, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if region is None:
            return
        views = _Views(region, capacity)
        conn.send(_ACK.pack(MAGIC, ACCEPTED))
        while True:
            frame = recv_spinning(conn, REQUEST.size + 1, self.spin_s, None)
            if not frame:
                return  # the client closed
            conn.send(self._answer(frame, views, capacity))

    def _open(self, conn: socket.socket, hello: bytes, fds: list[int]) -> tuple[torch.Tensor | None, int]:
        """The channel's regions (uint8 [2 x capacity], host or device) from its hello; (None, 0)
        after telling the client why not where this worker cannot open a device channel.
        ValueError (the connection closes) for a malformed or refused hello."""
        if len(hello) < _HELLO.size:
            raise ValueError("bad handshake")
        magic, capacity = _HELLO.unpack_from(hello)
        if magic not in (MAGIC, MAGIC_CUDA) or not 0 < capacity <= self.max_capacity or capacity % ALIGN:
            raise ValueError(f"bad handshake: {magic!r}, capacity {capacity}")
        if magic == MAGIC_CUDA:
            if fds:
                raise ValueError("bad handshake: a device channel with a file")
            handle, secret = cuda_ipc.IpcHandle.decode(hello[_HELLO.size :])
        else:
            if len(fds) != 1:
                raise ValueError("bad handshake: a host channel needs its memfd")
            handle, secret = None, hello[_HELLO.size :]
        refusal = self._admits(secret, None if handle is not None else fds[0])
        if refusal is not None:
            self.refused += 1
            self.refusals.add("shm", refusal)
            raise ValueError("refused: no / a wrong cluster secret, or an unsealed buffer")
        if handle is None:
            if os.fstat(fds[0]).st_size < 2 * capacity:
                raise ValueError(f"bad handshake: a buffer smaller than 2 x {capacity} bytes")
            return torch.frombuffer(mmap.mmap(fds[0], 2 * capacity), dtype=torch.uint8), capacity
        try:
            if self.device.type != "cuda":
                raise OSError("this expert worker computes on the CPU: no device channel")
            region = cuda_ipc.open_region(handle)
            if region.numel() < 2 * capacity:
                raise OSError(f"a device buffer smaller than 2 x {capacity} bytes")
        except (OSError, RuntimeError) as e:  # (RuntimeError: CUDA refused the handle)
            conn.send(_ACK.pack(MAGIC, NOT_HERE) + str(e).encode()[:MAX_ERROR_BYTES])
            return None, 0
        return region, capacity

    def _admits(self, secret: bytes, fd: int | None) -> str | None:
        """None when the peer (already checked to run as this process's user at accept) knows the
        cluster's secret, if any, and sealed its host buffer's size (so it cannot shrink it under
        us); else why not."""
        if fd is not None:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not (seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW):
                return "unsealed"
        if self.secret is None or auth.matches(self.secret, secret):
            return None
        return "no_secret" if not secret else "wrong_secret"

    def _answer(self, frame: bytes, views: _Views, capacity: int) -> bytes:
        """Run one request frame; the answer frame."""
        try:
            request = parse_request(frame, capacity)
        except FrameError as e:
            return error_answer(e.seq, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        hidden, slot, weight, out = views(request.T, request.H, request.K, request.dtype)
        # (checked, then used: the client cannot change them between)
        parts = (hidden, slot.clone(), weight.clone())
        self.requests += 1
        answer = compute_answer(request, self.compute, self.status_of, parts, out, self.what)
        if out.device.type == "cuda":
            cuda_ipc.synchronize(out.device)  # (the output is written before the answer)
        return answer


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (the kernel's word)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
