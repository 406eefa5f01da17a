"""Fencing hung attention workers. A router that finds an attention worker hung (its streams
stalled, its pings unanswered: router/core.py) moves that worker's requests and asks the balancer
to fence it. The balancer does not take one router's word for it: it pings the worker itself,
within a deadline drawn from the pings it has timed (the watch tick pings every attention worker),
and only if no answer comes (or one that says its engine thread is stuck: a deadlocked step, its
event loop still answering) kills it; Ray restarts it in place (a fresh process that re-attaches
and catches up with the placement), so a frozen worker that thaws holds nothing and serves
nothing stale. Once per restart: a worker fenced less than `restart_s` ago is left to its restart
(every router replica may report it)."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from services.deadlines import Deadlines
from services.ray_control import actor_state

log = logging.getLogger(__name__)


class AttentionFence:
    def __init__(self, restart_s: float = 120.0):
        self.restart_s = restart_s
        self.pings = Deadlines(ceiling_s=10.0, floor_s=1.0)  # `ready` calls, as observed
        self.history: list[dict] = []  # fenced workers, newest last
        self._until: dict[str, float] = {}  # name -> until when it may still be restarting (fenced)
        self._fencing: dict[str, asyncio.Task] = {}  # name -> the fence under way (one per worker)

    async def ping(self, name: str, actor, timeout_s: float) -> dict:
        """The worker's `ready` answer within `timeout_s` (TimeoutError without one); the time it
        took is observed (the deadline of the next pings). A fenced worker that answers again is
        back: it may be fenced again."""
        t0 = time.monotonic()
        state = await asyncio.wait_for(actor.ready.remote(), timeout_s)
        self.pings.observe(1, time.monotonic() - t0)
        self._until.pop(name, None)
        return state

    async def fence(self, name: str, actor, reason: str) -> dict:
        """Ping `name` within the measured deadline; kill it if it does not answer (or answers that
        its engine thread is stuck) and Ray counts it alive (not restarting: a fresh process
        loading the model answers nothing yet either). `reason`: the router's. Reports from several routers at once share one fence.
        {"fenced": bool, "why": str}."""
        if time.monotonic() < self._until.get(name, 0.0):
            return {"fenced": False, "why": "fenced already; restarting"}
        task = self._fencing.get(name)
        if task is None or task.done():
            task = self._fencing[name] = asyncio.ensure_future(self._fence(name, actor, reason))
        return await asyncio.shield(task)

    async def _fence(self, name: str, actor, reason: str) -> dict:
        deadline, t0 = self.pings.timeout_s(1), time.monotonic()
        try:
            stuck = (await self.ping(name, actor, deadline)).get("stuck")
            if not stuck:
                return {"fenced": False, "why": "it answers"}
            why = f"{reason}; it answers the balancer's ping, but {stuck}"
        except ray.exceptions.ActorDiedError:
            return {"fenced": False, "why": "dead; Ray restarts it"}
        except Exception as e:  # noqa: BLE001 (no answer in time, or unreachable: hung)
            if Deadlines.caller_stalled(time.monotonic() - t0, deadline):
                return {"fenced": False, "why": "the balancer itself was stalled; not proven"}
            why = f"{reason}; no answer to the balancer's ping in {deadline:.2f}s ({type(e).__name__})"
        state = await asyncio.to_thread(actor_state, actor)
        if state != "ALIVE":  # (restarting after a death, or being created: not hung)
            return {"fenced": False, "why": f"Ray reports it {state}"}
        self._until[name] = time.monotonic() + self.restart_s
        log.warning("attention worker %s is hung (%s); killing it (Ray restarts it)", name, why)
        ray.kill(actor, no_restart=False)
        self.history.append({"worker": name, "at": time.time(), "reason": why})
        del self.history[:-100]
        return {"fenced": True, "why": why}
