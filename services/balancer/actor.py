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

from .attention_pool import AttentionPool, attention_stats
from .autoscale import AttentionAutoscaler, ExpertAutoscaler, busy_fractions, expert_signals
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
        self.attention_pool = (
            AttentionPool(self.core, cfg.attention, self.core.pool.capacity) if cfg.attention else None
        )
        self.attention_scaler = (
            AttentionAutoscaler(cfg.attention.scale)
            if cfg.attention and cfg.attention.scale.enabled
            else None
        )
        self.pinned = False  # `scale-experts N` pins the pool until `scale-experts auto`
        self._busy_readings: dict[str, tuple[float, float]] = {}  # worker -> (compute s, monotonic)
        self._busy: dict[str, float] = {}  # worker -> busy fraction over the last tick
        self._counters = (
            None  # the last tick's ({worker: (compute s, queue s, calls)}, attention stats, monotonic)
        )
        self.signals = None  # ExpertSignals of the last tick
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
            if self.core.cfg.health_s > 0:
                health = self._overlapping(
                    self.core.cfg.health_s, self.core.check_health, self.core.pool.max_missed
                )
                self._tasks.append(loop.create_task(health))
            if self.autoscaler is not None:
                period = self.autoscaler.cfg.period_s
                self._tasks.append(loop.create_task(self._every(period, self._autoscale)))
            if self.attention_scaler is not None:
                period = self.attention_scaler.cfg.period_s
                self._tasks.append(loop.create_task(self._every(period, self._autoscale_attention)))
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

    @staticmethod
    async def _overlapping(period_s: float, fn, max_running: int) -> None:
        """Start `fn` every `period_s` without waiting for the last to end (at most `max_running`
        at once): a health round waiting on a hung worker's deadline does not delay the next, so
        its missed checks come `period_s` apart."""
        running: set[asyncio.Task] = set()

        async def one() -> None:
            try:
                await fn()
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

        while True:
            await asyncio.sleep(period_s)
            if len(running) < max_running:
                task = asyncio.get_running_loop().create_task(one())
                running.add(task)
                task.add_done_callback(running.discard)

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
        """One autoscaling tick: busy fraction of each worker since the last tick, and the signals
        beside it (queueing, the attention side's expert wait) -> the policy -> at most one worker
        more or less, through the live resize."""
        if self.core.placement is None:
            return
        now, counters, slots = time.monotonic(), {}, {}
        for wid, member in list(self.core.pool.members.items()):
            try:
                stats = await asyncio.to_thread(member.client.stats, 5.0)
            except Exception:  # (dead or slow: the watch tick deals with it)
                continue
            counters[wid] = (stats.compute_seconds, stats.queue_seconds, stats.dispatch_calls)
            slots[wid] = max(1, stats.compute_slots)
        attention = await attention_stats(dict(self.core.attention))
        readings = {w: (c[0] / slots[w], now) for w, c in counters.items()}  # (busy: per slot)
        busy, self._busy_readings = busy_fractions(self._busy_readings, readings), readings
        before, self._counters = self._counters, (counters, attention, now)
        signals = (
            expert_signals(before[0], counters, before[1], attention, now - before[2]) if before else None
        )
        self._busy, self.signals = {w: round(b, 3) for w, b in busy.items()}, signals
        target = self.autoscaler.decide(list(busy.values()), len(self.core.pool.members), now, signals)
        if self.pinned:
            self.autoscaler.last_reason += " (pinned by scale-experts: not acting)"
        if target is not None and not self.pinned:
            log.info("autoscaling the expert pool to %d workers: %s", target, self.autoscaler.last_reason)
            await self.core.scale(target, reason="autoscale")
            self._busy_readings, self._counters = {}, None  # (a new pool: measure afresh)

    async def _autoscale_attention(self) -> None:
        """One tick of the attention pool's autoscaling: each serving worker's KV use and queue ->
        the policy -> at most one worker started or drained (none while one still is)."""
        pool = self.attention_pool
        if self.core.placement is None or pool.busy:
            return
        loads = await pool.measure()
        target = self.attention_scaler.decide(list(loads.values()), len(pool.serving), time.monotonic())
        if target is not None:
            log.info(
                "autoscaling the attention pool to %d workers: %s", target, self.attention_scaler.last_reason
            )
            await pool.resize(target)

    async def attention_workers(self) -> dict | None:
        """Where the routers send requests: {"serving": names, "draining": names}; None while the
        balancer does not know yet (starting, or resuming after a restart)."""
        self._kick()
        if self.core.placement is None or not self.core.attention:
            return None
        if self.attention_pool is None:
            return {"serving": list(self.core.attention), "draining": []}
        return self.attention_pool.listing()

    async def status(self) -> dict:
        self._kick()
        status = self.core.status()
        if self.autoscaler is not None:
            cfg = self.autoscaler.cfg
            status["autoscale"] = {"min": cfg.min_workers, "max": cfg.max_workers, "pinned": self.pinned,
                                   "target_utilization": cfg.target_utilization,
                                   "desired": self.autoscaler.last_desired, "busy_by_worker": self._busy,
                                   "signals": asdict(self.signals) if self.signals else None,
                                   "reason": self.autoscaler.last_reason}  # fmt: skip
        if self.attention_scaler is not None:
            cfg, pool = self.attention_scaler.cfg, self.attention_pool
            status["attention_autoscale"] = {
                "min": cfg.min_workers, "max": cfg.max_workers, "kv_threshold": cfg.kv_threshold,
                "queue_threshold": cfg.queue_threshold, "desired": self.attention_scaler.last_desired,
                "serving": pool.serving, "starting": sorted(pool.starting), "draining": list(pool.draining),
                "loads": {n: asdict(x) for n, x in pool.loads.items()},
                "reason": self.attention_scaler.last_reason, "error": pool.last_error,
            }  # fmt: skip
        return status

    async def worker_stats(self) -> dict:
        self._kick()
        return await self.core.worker_stats()

    async def migration_log(self) -> list[dict]:
        self._kick()
        return [asdict(m) for m in self.core.migrations]

    async def fence_attention(self, name: str, reason: str) -> dict:
        """A router found attention worker `name` hung: killed (and restarted by Ray) unless it
        answers the balancer's own ping (service.py)."""
        self._kick()
        return await self.core.fence_attention(name, reason)

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
        if self.attention_pool is not None:
            self.attention_pool.cancel()
        await self.core.shutdown()
