"""The balancer's health rounds and pool target, without Ray: the expert pool's members are fakes
whose health check answers, hangs past its deadline, or is refused."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from services.balancer.pool import ExpertPool, Member
from services.experts.server import ExpertWorkerConfig
from services.settings import SharedSettings


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class FakeHealth:
    """A worker's control client whose health check answers SERVING, or hangs until its deadline
    (`frozen`), counting the checks it was asked."""

    def __init__(self):
        self.frozen = threading.Event()
        self.asked = 0

    def health(self, timeout: float) -> str:
        self.asked += 1
        if self.frozen.is_set():
            threading.Event().wait(timeout)  # (no answer: the whole deadline)
            raise _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
        return "SERVING"

    def close(self) -> None:
        pass


def _pool(**kw) -> tuple[ExpertPool, dict[str, FakeHealth]]:
    pool = ExpertPool(
        SharedSettings(), ExpertWorkerConfig(model="-"), hung_after_s=0.3, health_timeout_s=0.3, **kw
    )
    clients = {w: FakeHealth() for w in ("w0", "w1")}
    for w, client in clients.items():
        pool.members[w] = Member(actor=None, address=f"{w}:1", node="node-a", client=client)
    return pool, clients


def test_a_hung_worker_is_found_by_overlapping_rounds_and_a_healthy_one_is_not():
    """Two rounds started 0.1 s apart both miss the frozen worker's deadline: the second makes it
    hung (two in a row), about one deadline plus one period after the first started; the other
    worker on the same node answers, so it is not taken for a lost node's."""
    pool, clients = _pool()
    clients["w1"].frozen.set()

    async def main():
        first = asyncio.ensure_future(pool.check())
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(pool.check())
        return await first, await second

    first, second = asyncio.run(main())
    assert first == {}  # one missed check may be a hiccup
    assert set(second) == {"w1"} and second["w1"].startswith("hung: 2 health checks in a row failed")
    assert pool.members["w0"].missed == 0


def test_an_answer_between_missed_checks_starts_the_count_again():
    pool, clients = _pool()

    async def round_with(frozen: bool) -> dict:
        (clients["w1"].frozen.set if frozen else clients["w1"].frozen.clear)()
        return await pool.check()

    async def main():
        return [await round_with(f) for f in (True, False, True)]

    assert asyncio.run(main()) == [{}, {}, {}]
    assert pool.members["w1"].missed == 1


def test_a_worker_that_left_the_pool_during_a_round_is_not_reported():
    pool, clients = _pool()
    clients["w1"].frozen.set()
    pool.members["w1"].missed = 1

    async def main():
        round_ = asyncio.ensure_future(pool.check())
        await asyncio.sleep(0.05)
        del pool.members["w1"]  # (fenced by an overlapping round meanwhile)
        return await round_

    assert asyncio.run(main()) == {}


def test_refused_checks_count_with_missed_ones_and_take_the_node_mates_of_a_dead_worker(monkeypatch):
    """Unreachable twice makes a worker dead; a node-mate whose last check failed goes with it."""
    pool, clients = _pool()
    monkeypatch.setattr(ExpertPool, "_process_gone", staticmethod(lambda member: False))

    def refused(timeout: float) -> str:
        raise _RpcError(grpc.StatusCode.UNAVAILABLE)

    clients["w0"].health = refused
    clients["w1"].frozen.set()
    assert asyncio.run(pool.check()) == {}
    dead = asyncio.run(pool.check())
    assert set(dead) == {"w0", "w1"}, dead
    assert "unreachable (UNAVAILABLE)" in dead["w0"]


@pytest.mark.parametrize("replacing", [True, False])
def test_a_replacement_that_does_not_start_keeps_the_pool_target(tiny_model, replacing, monkeypatch):
    """Restoring the pool after deaths: a worker that fails to start leaves the target as it was
    (the watch tick tries again); an explicit resize that cannot grow settles for what started."""
    from services.balancer.service import BalancerConfig, BalancerCore

    core = BalancerCore(BalancerConfig(model=str(tiny_model)))
    core.target_workers = 3
    for w in ("w0", "w1"):
        core.pool.members[w] = Member(actor=None, address=f"{w}:1", node="node-a", client=FakeHealth())

    async def ensure(num_workers: int) -> str:
        return "the actor died in its creation task"

    monkeypatch.setattr(core.pool, "ensure", ensure)
    monkeypatch.setattr(core.pool, "request_capacity", lambda n: None)
    result = asyncio.run(core.scale(3, reason="replace dead workers", replacing=replacing))
    assert result["ok"] is False and "creation task" in result["error"]
    assert core.target_workers == (3 if replacing else 2)
