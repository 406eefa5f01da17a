"""The fixed frames of the shared-memory and TCP transports, and what their servers share.

One Dispatch is one request frame and one answer frame (no protobuf, no pickle):

    REQUEST (29 bytes)  seq u32, layer u32, placement version u64, T u32, H u32, K u32, dtype u8
    ANSWER  (24 bytes)  seq u32, status u32 (a grpc.StatusCode value, 0 = OK), compute seconds f64,
                        n u64: the bytes that follow (the output [T, H], or the error text)

The request's tensors are one *request region* (`request_layout`): hidden [T, H] in the dtype,
slot [T, K] int32 (-1: another worker computes the pair), weight [T, K] float32, each part
64-byte aligned, so a client fills it in place. Shared memory keeps the region in the pair's
buffer and the output in the buffer's second half; TCP sends the region after the request frame
and the output after the answer frame. Errors are gRPC status codes on every transport, so the
dispatch client resends or refuses alike whatever carried the call.

Servers: `FrameServer` is the accept loop, the connection registry and the counters both servers
share; `parse_request` checks a frame and `compute_answer` runs it, mapping an error to its status.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<IIQIIIB")  # seq, layer, placement version, T, H, K, dtype code
ANSWER = struct.Struct("<IIdQ")  # seq, status (0 = OK), compute seconds, bytes that follow
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtype code indexes this
ALIGN = 64
MAX_ERROR_BYTES = 4096
STATUS = {code.value[0]: code for code in grpc.StatusCode}  # status value -> grpc.StatusCode

# compute(layer, placement_version, hidden, slot, weight, out) -> compute seconds
Compute = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], float]
StatusOf = Callable[[Exception], grpc.StatusCode]


class TransportError(Exception):
    """A Dispatch call that failed, whatever carried it: `code`, the grpc.StatusCode that means
    it, and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FrameError(ValueError):
    """A request frame that cannot be run: answered INVALID_ARGUMENT (`seq`: the frame's)."""

    def __init__(self, seq: int, message: str):
        super().__init__(message)
        self.seq = seq


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def request_layout(T: int, H: int, K: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(slot offset, weight offset, bytes) of a request region [T, H] / [T, K] / [T, K]."""
    slot_at = _align(T * H * dtype.itemsize)
    weight_at = _align(slot_at + T * K * 4)
    return slot_at, weight_at, weight_at + T * K * 4


def request_parts(
    region: torch.Tensor, T: int, H: int, K: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """(hidden [T, H], slot [T, K] int32, weight [T, K] float32) viewing a request region
    (`region`: uint8, at least `request_layout(...)[2]` bytes)."""
    slot_at, weight_at, _ = request_layout(T, H, K, dtype)
    hidden = region[: T * H * dtype.itemsize].view(dtype).view(T, H)
    slot = region[slot_at : slot_at + T * K * 4].view(torch.int32).view(T, K)
    weight = region[weight_at : weight_at + T * K * 4].view(torch.float32).view(T, K)
    return hidden, slot, weight


def region_bytes(T: int, H: int, K: int, dtype: torch.dtype) -> int:
    """Bytes a region must hold for a [T, H] request with K choices and for its answer."""
    return max(request_layout(T, H, K, dtype)[2], T * H * dtype.itemsize)


def request_frame(
    seq: int, layer: int, placement_version: int, T: int, H: int, K: int, dtype: torch.dtype
) -> bytes:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot travel in a frame (one of {DTYPES})")
    return REQUEST.pack(seq, layer, placement_version, T, H, K, DTYPES.index(dtype))


@dataclass(frozen=True)
class Request:
    """A checked request frame."""

    seq: int
    layer: int
    placement_version: int
    T: int
    H: int
    K: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of its request region."""
        return request_layout(self.T, self.H, self.K, self.dtype)[2]

    @property
    def output_bytes(self) -> int:
        return self.T * self.H * self.dtype.itemsize


def parse_request(frame: bytes | bytearray, max_bytes: int) -> Request:
    """The request in `frame`; FrameError for a frame of the wrong size, an unknown dtype, an
    empty shape, or a request (or its answer) larger than `max_bytes`."""
    if len(frame) != REQUEST.size:
        raise FrameError(0, f"request frame of {len(frame)} bytes (expected {REQUEST.size})")
    seq, layer, version, T, H, K, code = REQUEST.unpack(frame)
    if code >= len(DTYPES) or T * H == 0 or K == 0:
        raise FrameError(seq, f"bad request: dtype {code}, [{T}, {H}], K {K}")
    request = Request(seq, layer, version, T, H, K, DTYPES[code])
    if region_bytes(T, H, K, request.dtype) > max_bytes:
        raise FrameError(seq, f"a [{T}, {H}] x {K} request does not fit {max_bytes} bytes")
    return request


def answer_frame(seq: int, seconds: float, nbytes: int) -> bytes:
    """The frame of an answer whose output (`nbytes`) follows."""
    return ANSWER.pack(seq, 0, seconds, nbytes)


def error_answer(seq: int, code: grpc.StatusCode, message: str) -> bytes:
    """An error answer: the frame and its text, as one buffer."""
    text = message.encode()[:MAX_ERROR_BYTES]
    return ANSWER.pack(seq, code.value[0], 0.0, len(text)) + text


def compute_answer(request: Request, compute: Compute, status_of: StatusOf, parts: tuple[torch.Tensor, ...],
                   out: torch.Tensor, what: str) -> bytes:  # fmt: skip
    """Run `request` (`parts`: its hidden, slot, weight) into `out`; its answer frame (an error's
    carries its text). `status_of` maps a compute error to its status; INTERNAL ones are logged."""
    try:
        seconds = compute(request.layer, request.placement_version, *parts, out)
    except Exception as e:
        code = status_of(e)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s Dispatch failed", what)
        return error_answer(request.seq, code, str(e))
    return answer_frame(request.seq, seconds, request.output_bytes)


def read_answer(
    frame: bytes | bytearray, seq: int, output_bytes: int
) -> tuple[grpc.StatusCode | None, float, int]:
    """(status, or None for OK; compute seconds; bytes that follow) of an answer frame to request
    `seq` of `output_bytes`. TransportError INTERNAL for an answer to another request or of the
    wrong size (the connection is out of step: close it)."""
    got, code, seconds, nbytes = ANSWER.unpack_from(frame)
    if got != seq or (nbytes > MAX_ERROR_BYTES if code else nbytes != output_bytes):
        raise TransportError(grpc.StatusCode.INTERNAL, f"answer {got} ({nbytes} bytes) to request {seq}")
    return (STATUS.get(code, grpc.StatusCode.UNKNOWN) if code else None), seconds, nbytes


def idle_alive(sock: socket.socket) -> bool:
    """An idle connection is still usable: nothing to read on it (a closed one reads EOF)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class FrameServer:
    """What the shared-memory and TCP servers share: a listening socket, one thread per
    connection (`_serve`, given each connection `_admit` lets in), the set of open connections,
    counters, and a `close` that cuts them all. Subclasses set `what` and implement `_serve`."""

    what = "frame"

    def __init__(self, listener: socket.socket, compute: Compute, status_of: StatusOf, max_connections: int):
        self.compute, self.status_of, self.max_connections = compute, status_of, max_connections
        self.refused = 0  # connections refused: another user's, no / a wrong secret, too many
        self.requests = 0
        self._listener = listener
        self._connections: dict[int, socket.socket] = {}  # id(accepted socket) -> the socket in use
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"{self.what}-accept", daemon=True).start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def _accept(self) -> None:
        """Accept until closed; a failed accept is logged and tried again after 0.1 s."""
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("%s accept failed: %s", self.what, e)
                time.sleep(0.1)
                continue
            if not self._admit(conn):
                self.refused += 1
                conn.close()
                continue
            try:
                threading.Thread(
                    target=self._run, args=(conn,), name=f"{self.what}-conn", daemon=True
                ).start()
            except RuntimeError as e:
                log.warning("%s connection not served: %s", self.what, e)
                self._forget(conn)
                conn.close()

    def _admit(self, conn: socket.socket) -> bool:
        """Register `conn` if there is room (subclasses check more first)."""
        with self._lock:
            if len(self._connections) >= self.max_connections:
                return False
            self._connections[id(conn)] = conn
            return True

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        except (OSError, ValueError) as e:
            if not self._closed:
                log.info("%s connection closed: %s", self.what, e)
        finally:
            self._forget(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _track(self, conn: socket.socket, in_use: socket.socket) -> None:
        """`in_use` now carries `conn` (its TLS wrapper): closing the server must cut that one."""
        with self._lock:
            self._connections[id(conn)] = in_use

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.pop(id(conn), None)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept thread)
        self._listener.close()
        with self._lock:
            connections = list(self._connections.values())
        for conn in connections:
            with contextlib.suppress(OSError, ValueError):
                conn.shutdown(socket.SHUT_RDWR)
