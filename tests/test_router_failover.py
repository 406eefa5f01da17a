"""The router's failover, driven directly (no Ray cluster): a stream that ends before its request
finished, or whose objects went with a dead node, moves the request to another worker and resumes
it there; it never ends silently. The workers are fakes of the actor-handle calls RouterCore makes
(`generate` streaming, `abort`, `ready`), so the failure modes of a whole node can be staged.
Last, the worker's side of a hung-but-answering worker: AttentionService's `stuck` reason."""

import asyncio
import itertools
import threading
import time

import pytest
import ray
import torch

from services.attention.worker import AttentionService, AttentionWorkerConfig
from services.deadlines import Deadlines
from services.engine.engine import EngineConfig
from services.engine.outputs import Refusal, RequestOutput, StepResult
from services.router.core import RouterConfig, RouterCore, Sub
from services.router.metrics import RouterMetrics
from services.router.protocol import APIError

from .fakes import RemoteCall


def _done(value):
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class FakeWorker:
    """Produces token 100 + i for the i-th token of a request; `cut_after` tokens then the stream
    ends (`None`) or raises `error` (node loss), as a dying node's stream does."""

    def __init__(self, cut_after: int | None = None, error: Exception | None = None):
        self.cut_after, self.error = cut_after, error
        self.calls, self.aborted = [], []
        self.generate = RemoteCall(self._generate)
        self.abort = RemoteCall(self.aborted.append)
        self.ready = RemoteCall(lambda: _done(True))

    async def _generate(self, prompt, params, request_id, resumed, owner):
        self.calls.append((list(prompt), dict(params), request_id))
        start = resumed[0]
        for i in range(params["max_tokens"]):
            if self.cut_after is not None and i == self.cut_after:
                if self.error is not None:
                    raise self.error
                return  # (the stream just ends)
            last = i == params["max_tokens"] - 1
            yield _done(RequestOutput(request_id, [100 + start + i], finished=last,
                                      finish_reason="length" if last else None))  # fmt: skip


def _core(workers: dict[str, FakeWorker], **cfg) -> RouterCore:
    core = RouterCore.__new__(RouterCore)  # (no Ray, no tokenizer: only what run() uses)
    core.cfg = RouterConfig("-", "m", list(workers), prefix_caching=False, **cfg)
    core.gaps, core.pings, core._pinging = {}, Deadlines(ceiling_s=3.0, floor_s=core.cfg.ping_floor_s), {}
    for _ in range(8):  # (the pings of the pool refresh loop, which measure them)
        core.pings.observe(1, 0.01)
    core.workers, core.outstanding, core.down = workers, dict.fromkeys(workers, 0), {}
    core._probes, core._rr, core.metrics, core.owner = set(), itertools.count(), RouterMetrics(), "me"
    core._keepalive = object()  # (no lease thread)
    core.serving, core._refresh = set(workers), object()  # (no pool refresh task)
    return core


@pytest.mark.parametrize(
    "error",
    [
        None,
        ray.exceptions.ObjectLostError("00" * 28, "owner", "call site"),
        ray.exceptions.NodeDiedError("n"),
    ],
)
def test_a_stream_cut_with_its_node_resumes_elsewhere(error):
    cut = FakeWorker(cut_after=3, error=error)
    healthy = FakeWorker()
    core = _core({"a": cut, "b": healthy})
    core.outstanding["b"] = 1  # (the first pick is "a")

    async def collect():
        sub = Sub(0, 0, [0, 5, 6], {"max_tokens": 8}, "req")
        return [out async for out in core.run(sub)]

    outs = asyncio.run(collect())
    assert [t for o in outs for t in o.token_ids] == [100 + i for i in range(8)]  # whole, in order
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    prompt, params, request_id = healthy.calls[0]
    assert prompt == [0, 5, 6, 100, 101, 102] and params["max_tokens"] == 5  # resumed after 3
    assert request_id == "req-resumed-1" and cut.aborted == ["req"]


class RefusingWorker(FakeWorker):
    """Refuses the request (queue full: 429) or raises inside generate (a RayTaskError)."""

    def __init__(self, item):
        super().__init__()
        self.item = item

    async def _generate(self, prompt, params, request_id, resumed, owner):
        self.calls.append((list(prompt), dict(params), request_id))
        if isinstance(self.item, Exception):
            raise self.item
        yield _done(self.item)


@pytest.mark.parametrize("item", [Refusal(400, "bad", "prompt"), Refusal(429, "queue full"),
                                  ray.exceptions.RayTaskError("generate", "Traceback ...", ValueError("bug"))])  # fmt: skip
def test_refusals_and_generate_errors_are_no_deaths(item):
    """A refusal or an error raised by generate itself is the request's answer: no other worker
    is tried, nobody is marked down."""
    refusing, other = RefusingWorker(item), FakeWorker()
    core = _core({"a": refusing, "b": other})
    core.outstanding["b"] = 1

    async def collect():
        return [out async for out in core.run(Sub(0, 0, [0, 5], {"max_tokens": 4}, "req"))]

    with pytest.raises((APIError, ray.exceptions.RayTaskError)):
        asyncio.run(collect())
    assert other.calls == [] and core.down == {}


def test_a_consumer_that_leaves_aborts_once_and_fails_nothing_over():
    worker, other = FakeWorker(), FakeWorker()
    core = _core({"a": worker, "b": other})
    core.outstanding["b"] = 1

    async def first_then_leave():
        stream = core.run(Sub(0, 0, [0, 5], {"max_tokens": 8}, "req"))
        out = await anext(stream)
        await stream.aclose()
        return out

    assert asyncio.run(first_then_leave()).token_ids == [100]
    assert worker.aborted == ["req"] and other.calls == [] and core.down == {}


def test_the_router_follows_the_pool_as_it_grows_and_drains(monkeypatch):
    """A new worker takes requests at once; a draining one takes none but keeps its streams; one
    that left is dropped once nothing of it is open."""
    a, b, c = FakeWorker(), FakeWorker(), FakeWorker()
    core = _core({"a": a, "b": b})
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: {"c": c}[name])

    async def pick():
        return await core.pick_worker([1, 2, 3])

    core.outstanding.update(a=5, b=5)
    core.set_pool(["a", "b", "c"], [])
    assert core.workers["c"] is c and asyncio.run(pick()) == "c"  # (the idle newcomer)
    core.outstanding.update(c=9)
    core.set_pool(["a", "c"], ["b"])  # b drains: kept (its streams), never picked
    assert "b" in core.workers and {asyncio.run(pick()) for _ in range(4)} == {"a"}
    core.set_pool(["a", "c"], [])  # b left the pool while a stream of it is open: kept until it ends
    assert "b" in core.workers
    core.outstanding["b"] = 0
    core.set_pool(["a", "c"], [])
    assert "b" not in core.workers and "b" not in core.outstanding


class FreezingWorker(FakeWorker):
    """Streams `freeze_after` tokens, then stops producing for `frozen_s` (forever: None); its
    `ready` answers only when `answers_pings` (a live but slow worker), as a SIGSTOPped process
    answers nothing; the answer says its engine thread is `stuck` (a reason) or not (None)."""

    def __init__(
        self, freeze_after: int, frozen_s: float | None, answers_pings: bool, stuck: str | None = None
    ):
        super().__init__()
        self.freeze_after, self.frozen_s, self.pings, self.stuck = freeze_after, frozen_s, 0, stuck
        self.ready = RemoteCall(self._ready if answers_pings else lambda: asyncio.Event().wait())

    def _ready(self):
        self.pings += 1
        return _done({"worker_id": "w", "stuck": self.stuck})

    async def _generate(self, prompt, params, request_id, resumed, owner):
        self.calls.append((list(prompt), dict(params), request_id))
        for i in range(params["max_tokens"]):
            if i == self.freeze_after:
                await (asyncio.sleep(self.frozen_s) if self.frozen_s else asyncio.Event().wait())
            last = i == params["max_tokens"] - 1
            yield _done(RequestOutput(request_id, [100 + i], finished=last,
                                      finish_reason="length" if last else None))  # fmt: skip


def _collect(core, max_tokens=16):
    async def collect():
        return [out async for out in core.run(Sub(0, 0, [0, 5], {"max_tokens": max_tokens}, "req"))]

    return asyncio.run(collect())


def test_a_hung_worker_is_found_by_its_stalled_stream_and_an_unanswered_ping():
    """No output for the stall deadline (learned from this worker's gaps), then no answer to a
    ping: hung. The request resumes on the other worker, the hung one is marked down and aborted."""
    hung, healthy = FreezingWorker(freeze_after=12, frozen_s=None, answers_pings=False), FakeWorker()
    core = _core({"a": hung, "b": healthy}, stall_floor_s=0.05, ping_floor_s=0.2)
    core.outstanding["b"] = 1
    outs = _collect(core)
    assert [t for o in outs for t in o.token_ids] == [100 + i for i in range(16)]
    prompt, params, request_id = healthy.calls[0]
    assert prompt[2:] == [100 + i for i in range(12)] and params["max_tokens"] == 4
    assert request_id == "req-resumed-1" and hung.aborted == ["req"] and "a" in core.down
    assert core.gaps["a"].timeout_s(1) < 1.0  # (learned: 12 gaps seen, not the 5 s ceiling)


def test_a_slow_worker_that_answers_pings_is_waited_for():
    """A stream that stalls on a live worker (a long prefill elsewhere in its batch) pings it; the
    worker answers (its engine thread not stuck: a step within its deadline), so the stream waits
    and ends there: nothing moved, nobody marked down."""
    slow, other = FreezingWorker(freeze_after=12, frozen_s=0.6, answers_pings=True), FakeWorker()
    core = _core({"a": slow, "b": other}, stall_floor_s=0.05, ping_floor_s=0.2)
    core.outstanding["b"] = 1
    outs = _collect(core)
    assert [t for o in outs for t in o.token_ids] == [100 + i for i in range(16)]
    assert slow.pings >= 1 and other.calls == [] and core.down == {}


def test_a_worker_whose_engine_thread_is_stuck_is_hung_though_it_answers_pings():
    """The event loop answers, but says the engine thread is stuck (a deadlocked step): hung. The
    request resumes on the other worker (same tokens), the stuck one is marked down with the
    reason, the balancer is asked to fence it, and it stays down while it answers stuck."""
    stuck = FreezingWorker(freeze_after=12, frozen_s=None, answers_pings=True,
                           stuck="the engine thread has been in a step for 12.0s (its deadline 10.0s)")  # fmt: skip
    healthy = FakeWorker()
    core = _core({"a": stuck, "b": healthy}, stall_floor_s=0.05, ping_floor_s=0.2)
    core.outstanding["b"] = 1
    fenced = []
    core._fence = lambda name, reason: fenced.append((name, reason))

    async def collect_then_probe():
        outs = [out async for out in core.run(Sub(0, 0, [0, 5], {"max_tokens": 16}, "req"))]
        deadline = time.monotonic() + 10
        while stuck.pings < 3:  # (the probe asks again; a stuck answer keeps it out)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        return outs

    outs = asyncio.run(collect_then_probe())
    assert [t for o in outs for t in o.token_ids] == [100 + i for i in range(16)]
    prompt, params, request_id = healthy.calls[0]
    assert prompt[2:] == [100 + i for i in range(12)] and params["max_tokens"] == 4
    assert request_id == "req-resumed-1" and stuck.aborted == ["req"] and "a" in core.down
    assert [name for name, _ in fenced] == ["a"] and "engine thread" in fenced[0][1]


# ---- the worker's side: when its ping answer says `stuck` (AttentionService, no Ray) ----


class _BlockingEngine:
    """Enough of an Engine for the engine thread: one unfinished request whose step blocks until
    `release` is set (a deadlocked kernel, a hung call)."""

    def __init__(self):
        self.entered, self.release, self.pending = threading.Event(), threading.Event(), False

    def has_unfinished(self):
        return self.pending

    def step(self):
        self.entered.set()
        self.release.wait()
        self.pending = False
        return StepResult([], 0, 0, torch.zeros(0), 0.0, 0.0)


def _poll(condition, timeout_s=10.0):
    """Polls `condition()` until it is true; returns it and the seconds it took."""
    t0, deadline = time.monotonic(), time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return value, time.monotonic() - t0


def test_a_stuck_engine_thread_is_reported_after_its_deadline_and_cleared_after():
    """A step running past max(stuck_floor_s, the dispatch deadline + the step attempts' own
    deadline) makes `stuck()` give a reason (ready() answers it: the router and the balancer treat
    the worker as hung); it clears when the step returns. A command blocking at a step boundary
    is stuck the same way."""
    engine = _BlockingEngine()
    # nothing timed yet: the attempts' part is its ceiling (0.2 s); + a 0.5 s dispatch deadline
    cfg = AttentionWorkerConfig(engine=EngineConfig(model="-"), stuck_floor_s=0.3, stuck_ceiling_s=0.2)
    svc = AttentionService(cfg, engine, dispatch_deadline_s=lambda: 0.5)
    try:
        assert svc.stuck() is None  # (idle)
        engine.pending = True
        assert engine.entered.wait(10)
        entered = time.monotonic()
        early = svc.stuck()
        assert early is None or time.monotonic() - entered > 0.7
        reason, _ = _poll(svc.stuck)
        assert time.monotonic() - entered >= 0.7 and "a step" in reason and "deadline 0.7s" in reason
        engine.release.set()
        _poll(lambda: svc.stuck() is None)
        assert not engine.pending and "rows<=1" in svc.attempts.snapshot()  # (the attempt was timed)

        async def blocked_command():
            block = threading.Event()
            call = asyncio.ensure_future(svc.between_steps(block.wait))
            reason, _ = await asyncio.to_thread(_poll, svc.stuck)
            block.set()
            await call
            return reason

        assert "a command (call)" in asyncio.run(blocked_command())
        _poll(lambda: svc.stuck() is None)
    finally:
        engine.release.set()
        svc.close()
