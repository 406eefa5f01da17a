"""The balancer's Ray actor: schedules `BalancerCore` (service.py): the periodic rebalance and
the watch tick, and, after Ray restarted it, the resume."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict

import ray
import torch

from .autoscale import ExpertAutoscaler, busy_fractions
from .service import BalancerConfig, BalancerCore

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=100)
class Balancer:
    """Start it detached with `max_restarts=-1`: a restarted balancer resumes by itself."""

    def __init__(self, cfg: BalancerConfig):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.core = BalancerCore(cfg)
        self._tasks: list[asyncio.Task] = []
        self.autoscaler = ExpertAutoscaler(cfg.autoscale) if cfg.autoscale and cfg.autoscale.enabled else None
        self.pinned = False  # `scale-experts N` pins the pool until `scale-experts auto`
        self._busy_readings: dict[str, tuple[float, float]] = {}  # worker -> (compute s, monotonic)
        self._busy: dict[str, float] = {}  # worker -> busy fraction over the last tick
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._resuming: asyncio.Task | None = None
        if self._restarted:
            log.warning("balancer restarted: re-attaching to the running pool")
            threading.Thread(target=self._call_resume, name="balancer-resume", daemon=True).start()

    @staticmethod
    def _call_resume() -> None:
        """Call this actor's `resume` until a call gets through: a call sent while Ray still counts
        the actor as restarting can fail, and a restarted balancer that never resumes serves
        nothing (seen on a loaded machine: version 0, no workers, for good)."""
        handle = ray.get_runtime_context().current_actor
        while True:
            try:
                ray.get(handle.resume.remote())
                return
            except Exception as e:  # noqa: BLE001 (not yet reachable: try again)
                log.warning("resume call failed (%s); calling again", e)
                time.sleep(1.0)

    def _kick(self) -> None:
        """After a restart, start the resume, once: on the `resume` call, or on whichever call
        comes first."""
        if self._restarted and self._resuming is None:
            self._resuming = asyncio.get_running_loop().create_task(self._resume())

    async def resume(self) -> None:
        if not self._restarted:  # (a balancer that was never restarted has nothing to resume)
            return
        self._kick()
        await asyncio.shield(self._resuming)

    async def _resume(self) -> None:
        """After a restart: start (re-attach), retrying with backoff until it works."""
        delay = 0.5
        while True:
            try:
                await self.start()
                return
            except Exception:
                log.exception("resuming failed; retrying in %.1fs", delay)
                await asyncio.sleep(delay)
                delay = min(10.0, delay * 2)

    async def start(self) -> dict:
        info = await self.core.start()
        if not self._tasks:
            loop = asyncio.get_running_loop()
            if self.core.cfg.period_s > 0:
                self._tasks.append(loop.create_task(self._every(self.core.cfg.period_s, self._rebalance)))
            if self.core.cfg.watch_s > 0:
                self._tasks.append(loop.create_task(self._every(self.core.cfg.watch_s, self.core.watch)))
            if self.autoscaler is not None:
                period = self.autoscaler.cfg.period_s
                self._tasks.append(loop.create_task(self._every(period, self._autoscale)))
        return info

    async def _rebalance(self) -> None:
        result = await self.core.rebalance()
        log.info("periodic rebalance: %s", {k: result.get(k) for k in ("migrated", "reason")})

    @staticmethod
    async def _every(period_s: float, fn) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await fn()
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

    async def placement(self) -> dict:
        self._kick()
        if self.core.placement is None:
            raise RuntimeError("the balancer is starting: no placement yet")
        return self.core.placement_info()

    async def register_attention(self, names: list[str]) -> None:
        self._kick()
        self.core.register_attention(names)

    async def rebalance(self, force: bool = False, loads: list | None = None) -> dict:
        self._kick()
        return await self.core.rebalance(force, None if loads is None else torch.tensor(loads))

    async def scale_experts(self, num_workers: int | None) -> dict:
        """Resize the pool to `num_workers` and pin it there (autoscaling paused); None hands the
        pool back to the autoscaler."""
        self._kick()
        if num_workers is None:
            self.pinned = False
            return {
                "ok": True,
                "workers": len(self.core.pool.members),
                "autoscale": self.autoscaler is not None,
            }
        self.pinned = True
        return await self.core.scale(num_workers)

    async def _autoscale(self) -> None:
        """One autoscaling tick: busy fraction of each worker since the last tick -> the policy ->
        at most one worker more or less, through the live resize."""
        if self.core.placement is None:
            return
        now, readings = time.monotonic(), {}
        for wid, member in list(self.core.pool.members.items()):
            try:
                stats = await asyncio.to_thread(member.client.stats, 5.0)
            except Exception:  # (dead or slow: the watch tick deals with it)
                continue
            readings[wid] = (stats.compute_seconds, now)
        busy, self._busy_readings = busy_fractions(self._busy_readings, readings), readings
        self._busy = {w: round(b, 3) for w, b in busy.items()}
        target = self.autoscaler.decide(list(busy.values()), len(self.core.pool.members), now)
        if self.pinned:
            self.autoscaler.last_reason += " (pinned by scale-experts: not acting)"
        if target is not None and not self.pinned:
            log.info("autoscaling the expert pool to %d workers: %s", target, self.autoscaler.last_reason)
            await self.core.scale(target, reason="autoscale")
            self._busy_readings = {}  # (a new pool: measure afresh)

    async def status(self) -> dict:
        self._kick()
        status = self.core.status()
        if self.autoscaler is not None:
            cfg = self.autoscaler.cfg
            status["autoscale"] = {"min": cfg.min_workers, "max": cfg.max_workers, "pinned": self.pinned,
                                   "target_utilization": cfg.target_utilization,
                                   "desired": self.autoscaler.last_desired, "busy_by_worker": self._busy,
                                   "reason": self.autoscaler.last_reason}  # fmt: skip
        return status

    async def worker_stats(self) -> dict:
        self._kick()
        return await self.core.worker_stats()

    async def migration_log(self) -> list[dict]:
        self._kick()
        return [asdict(m) for m in self.core.migrations]

    async def pid(self) -> int:
        self._kick()
        return os.getpid()

    async def data_plane_secret(self) -> str | None:
        """The cluster's data-plane secret, for services (re)started beside this balancer (a Ray
        client can read any actor's arguments anyway: Ray access is cluster access)."""
        self._kick()
        return self.core.shared.secret

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.core.shutdown()
