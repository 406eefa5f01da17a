"""The gRPC transport: one long-lived DispatchStream per (attention worker, expert worker), the
client's stream and the server's handlers.

A unary call per MoE layer pays gRPC's call set-up every time and, since the driver thread must
not block on it, a hop through a thread pool. A stream pays the set-up once: the driver puts each
request's bytes on the stream's queue (a gRPC thread sends them) and, when it wants the answer,
reads the stream's next response itself. The worker answers a stream's requests in order, so the
i-th response belongs to the i-th request still unanswered (`pending`); a call whose answer is
read by a later call's wait keeps it until its own `result()`.

Deadlines: a stream has none per message, so one thread per client (`DeadlineWatch`) holds every
call's deadline (each call's own: deadlines.py draws them from observed latency), earliest first,
and cancels the stream of a call still unanswered at its deadline. It sleeps until the earliest
deadline. Every call pending on a stream that
breaks (a dead worker, a cancelled stream) fails with the status that says why
(DEADLINE_EXCEEDED after a cancel for a deadline); the next call opens a new stream.

Server side (`DispatchService`, registered by the expert worker's servicer): each request of a
stream is decoded (zero-copy), computed straight into its response's bytes and answered in order
on the thread the stream holds; a refused request is answered with its status and the stream
goes on. A worker holds at most `max_streams` streams (each holds a server thread); beyond them a
stream is refused with RESOURCE_EXHAUSTED and the client sends that worker unary Dispatch calls.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import queue
import threading
import time

import grpc
import torch

from services.rpc import wire

from .frames import STATUS, Compute, StatusOf, TransportError

log = logging.getLogger(__name__)


class StreamCall:
    """One request on a stream: its deadline and, once read, its answer (or error). The answer's
    bytes stay here only until its waiter takes them (the watch keeps the call for a while)."""

    __slots__ = ("abandoned", "answer", "answered", "deadline", "error", "stream")

    def __init__(self, stream: GrpcStream, deadline: float):
        self.stream, self.deadline = stream, deadline
        self.answer: bytes | None = None
        self.answered = False
        self.error: TransportError | None = None
        self.abandoned = False  # its step failed elsewhere: nobody waits for it (no deadline)

    @property
    def done(self) -> bool:
        return self.answered or self.error is not None or self.abandoned


class GrpcStream:
    """A DispatchStream to one worker. Driver-thread only, but for `expire` (the watch's thread)."""

    def __init__(self, call: grpc.StreamStreamMultiCallable, watch: DeadlineWatch,
                 metadata: tuple[tuple[str, str], ...] | None = None):  # fmt: skip
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = call(iter(self._requests.get, None), metadata=metadata)
        self._watch = watch
        self._pending: collections.deque[StreamCall] = collections.deque()
        self._lock = threading.Lock()  # (an answer arriving vs the watch expiring its call)
        self._expired = False
        self.error: TransportError | None = None  # set once the stream broke: open a new one
        self.answered = 0

    def send(self, data: bytes, timeout_s: float) -> StreamCall:
        """Queue a request, to be answered within `timeout_s`."""
        call = StreamCall(self, time.monotonic() + timeout_s)
        if self.error is not None:
            call.error = self.error
            return call
        self._pending.append(call)
        self._watch.add(call)
        self._requests.put(data)
        return call

    def wait(self, call: StreamCall) -> bytes:
        """The answer's bytes (a DispatchStreamResponse); TransportError if the stream broke first."""
        while not call.answered and call.error is None:
            try:
                data = next(self._responses)
            except grpc.RpcError as e:
                code = grpc.StatusCode.DEADLINE_EXCEEDED if self._expired else e.code()
                self._fail(TransportError(code, e.details() or str(code)))
                break
            except StopIteration:
                self._fail(TransportError(grpc.StatusCode.UNAVAILABLE, "the expert worker ended the stream"))
                break
            with self._lock:
                head = self._pending.popleft()
                head.answered = True
                if not head.abandoned:
                    head.answer = data
            self.answered += 1
        if call.error is not None:
            raise call.error
        data, call.answer = call.answer, None  # (the caller holds the bytes now)
        return data

    @property
    def ended(self) -> bool:
        """The stream broke or ended (also while idle: a reset connection): open a new one."""
        return self.error is not None or self._responses.done()

    @property
    def refused(self) -> bool:
        """The worker refused the stream itself (all its streams in use), before any answer."""
        if self.answered:
            return False
        if self.error is not None:
            return self.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        return self._responses.done() and self._responses.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    def _fail(self, error: TransportError) -> None:
        self.error = error
        while self._pending:
            self._pending.popleft().error = error
        self.close()

    def expire(self, call: StreamCall) -> None:
        """(watch thread) `call` is unanswered at its deadline: end the stream; its waiter raises."""
        with self._lock:
            if call.done:
                return
            self._expired = True
            self.error = TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the dispatch deadline"
            )
        self.close()

    def close(self) -> None:
        self._requests.put(None)  # (the request iterator ends: the stream half-closes)
        self._responses.cancel()


class DeadlineWatch:
    """One thread per client: cancels the stream of a call unanswered at its deadline. Calls are
    kept in deadline order (a heap: deadlines differ per call, drawn from observed latency), and
    the thread sleeps until the earliest."""

    def __init__(self):
        self._calls: list[tuple[float, int, StreamCall]] = []  # heap of (deadline, seq, call)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, call: StreamCall) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dispatch-deadlines", daemon=True)
                self._thread.start()
            heapq.heappush(self._calls, (call.deadline, next(self._seq), call))
            if self._calls[0][2] is call:  # (a new earliest deadline: wake to sleep less)
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                while self._calls and self._calls[0][2].done:
                    heapq.heappop(self._calls)
                if not self._calls:
                    self._cond.wait()
                    continue
                delay = self._calls[0][0] - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                _, _, call = heapq.heappop(self._calls)
                call.stream.expire(call)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


def decode_answer(data: bytes) -> torch.Tensor:
    """A DispatchStreamResponse's output [Tw, H]; TransportError with its status if refused."""
    resp = wire.decode_dispatch_response(data)
    if resp.error_code:
        raise TransportError(STATUS.get(resp.error_code, grpc.StatusCode.UNKNOWN), resp.error_message)
    if resp.output is None:
        raise TransportError(grpc.StatusCode.INTERNAL, "a DispatchStream answer without an output")
    return resp.output


# ---------------------------------------------------------------------------------------------
# The server side (the expert worker)
# ---------------------------------------------------------------------------------------------
class DispatchService:
    """The Expert service's Dispatch (unary) and DispatchStream methods over `compute` (the
    expert worker's, into a response's payload); `status_of` maps its errors to status codes."""

    def __init__(self, compute: Compute, status_of: StatusOf, max_streams: int = 64):
        self.compute, self.status_of, self.max_streams = compute, status_of, max_streams
        self._stream_slots = threading.BoundedSemaphore(max_streams)

    def answer(self, request: bytes) -> bytes:
        """Decode a DispatchRequest and compute it into a DispatchResponse's bytes."""
        req = wire.decode_dispatch_request(request)
        if req.hidden is None or req.slot is None or req.weight is None:
            raise wire.WireError("a DispatchRequest needs hidden, slot and weight")
        resp = wire.DispatchResponseBuffer(req.hidden.shape, req.hidden.dtype)
        seconds = self.compute(
            req.layer, req.placement_version, req.hidden, req.slot, req.weight, resp.output
        )
        return resp.finish(seconds)

    def _refusal(self, e: Exception) -> tuple[grpc.StatusCode, str]:
        code = self.status_of(e)
        if code == grpc.StatusCode.INTERNAL:  # (a bug, out of memory: this request fails, serving goes on)
            log.exception("gRPC Dispatch failed")
            return code, f"{type(e).__name__}: {e}"
        return code, str(e)

    def Dispatch(self, request: bytes, context) -> bytes:
        try:
            return self.answer(request)
        except Exception as e:
            context.abort(*self._refusal(e))

    def DispatchStream(self, requests, context):
        """Answer each request of a client's stream in order, on this handler's thread."""
        if not self._stream_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"all {self.max_streams} dispatch streams of this worker are in use: use Dispatch")  # fmt: skip
        try:
            for request in requests:
                try:
                    yield self.answer(request)
                except Exception as e:
                    code, message = self._refusal(e)
                    yield wire.encode_dispatch_error(code.value[0], message)
        finally:
            self._stream_slots.release()

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Method name -> handler, raw bytes in and out (see services/rpc/wire.py)."""
        raw = lambda b: b  # noqa: E731
        return {
            "Dispatch": grpc.unary_unary_rpc_method_handler(
                self.Dispatch, request_deserializer=raw, response_serializer=raw
            ),
            "DispatchStream": grpc.stream_stream_rpc_method_handler(
                self.DispatchStream, request_deserializer=raw, response_serializer=raw
            ),
        }
