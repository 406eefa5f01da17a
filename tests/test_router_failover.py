"""The router's failover, driven directly (no Ray cluster): a stream that ends before its request
finished, or whose objects went with a dead node, moves the request to another worker and resumes
it there; it never ends silently. The workers are fakes of the actor-handle calls RouterCore makes
(`generate` streaming, `abort`, `ready`), so the failure modes of a whole node can be staged."""

import asyncio
import itertools

import pytest
import ray

from services.deadlines import Deadlines
from services.engine.outputs import Refusal, RequestOutput
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
    answers nothing."""

    def __init__(self, freeze_after: int, frozen_s: float | None, answers_pings: bool):
        super().__init__()
        self.freeze_after, self.frozen_s, self.pings = freeze_after, frozen_s, 0
        self.ready = RemoteCall(self._ready if answers_pings else lambda: asyncio.Event().wait())

    def _ready(self):
        self.pings += 1
        return _done(True)

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
    worker answers, so the stream waits and ends there: nothing moved, nobody marked down."""
    slow, other = FreezingWorker(freeze_after=12, frozen_s=0.6, answers_pings=True), FakeWorker()
    core = _core({"a": slow, "b": other}, stall_floor_s=0.05, ping_floor_s=0.2)
    core.outstanding["b"] = 1
    outs = _collect(core)
    assert [t for o in outs for t in o.token_ids] == [100 + i for i in range(16)]
    assert slow.pings >= 1 and other.calls == [] and core.down == {}
