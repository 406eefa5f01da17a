"""The balancer: owns the expert pool and the placement, re-places experts while serving goes on,
and heals the pool when an expert worker dies.

Every `period_s` (and on demand) it sums the last `window_buckets` load buckets from Redis, asks
`policy.decide` for a better placement and, when one is worth it, migrates in two phases:

  (a) LoadSlots(new version) on every expert worker: they read the moved experts (checkpoint
      mmap, or peers) while still serving the old version. Any failure aborts: the new version
      is released where it loaded and the old placement keeps serving.
  (b) persist the new placement in Redis, then tell every attention worker; each switches at
      its next step boundary and answers once no step of its uses the old version.
  (c) ReleaseSlots(old version) on every expert worker; workers leaving the pool stop now.

Every `watch_s` it checks the pool's health (pool.py). A dead worker leaves the pool at once and
its experts are re-planned onto the survivors (a migration like the above, "heal"): steps that
needed it wait, retrying, until the attention workers switch. A fresh worker is then started to
bring the pool back to its target size (another migration). The same tick pushes the current
placement to attention workers that are behind (a restarted one) and releases versions nobody
uses any more.

The balancer is a detached actor that Ray restarts; the expert workers are detached too, so they
survive it. A restarted balancer re-attaches to the running workers and attention workers by
name and resumes the placement persisted in Redis (or, with Redis down, the one the attention
workers use), healing whatever died meanwhile. Redis down stops rebalancing, not serving; the
balancer down freezes the placement, not serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field

import ray
import torch

from services.experts.client import ExpertClient, load_placement, release_version
from services.experts.server import ExpertWorkerConfig, read_model_config
from services.model.config import ModelConfig
from services.model.placement import Placement
from services.redis_store import (
    connect,
    current_bucket,
    persist_placement,
    read_load_window,
    restore_placement,
)
from services.settings import SharedSettings

from .eplb import gpu_loads, placement_stats
from .policy import Decision, Pool, decide, initial_placement, slots_per_worker
from .pool import ExpertPool

log = logging.getLogger(__name__)

_ATTENTION_NAME = re.compile(r"^moe-attn-\d+$")


@dataclass
class BalancerConfig:
    model: str
    expert_workers: int = 2
    redundant_experts: int = 0  # extra slots per MoE layer, over all workers
    shared: SharedSettings = field(default_factory=SharedSettings)  # Redis, key prefix, namespace
    period_s: float = 30.0  # 0: rebalance only on demand
    window_buckets: int = 15  # load window: the last N buckets of shared.bucket_seconds
    min_gain: float = 0.02  # balancedness gain needed to migrate (hysteresis)
    expert_dtype: str = "float32"
    expert_threads: int = 1
    expert_resources: dict[str, float] = field(default_factory=dict)  # e.g. {"expert_node": 0.01}
    expert_host: str | None = None  # None: each worker's node IP
    watch_s: float = 0.5  # health check / reconcile period (0: off)
    switch_timeout_s: float = 30.0  # an attention worker slower than this to switch is retried later


@dataclass
class MigrationRecord:
    version: int
    reason: str
    balancedness_before: float
    balancedness_after: float
    moved_slots: int
    bytes_read: int  # expert weights read from checkpoints
    load_s: float
    switch_s: float
    total_s: float
    ok: bool
    error: str | None = None
    started_at: float = 0.0  # wall clock (time.time())
    bytes_from_peers: int = 0  # expert weights copied from other expert workers


class BalancerCore:
    """The balancer's logic over Ray handles; the actor below only schedules it."""

    def __init__(self, cfg: BalancerConfig):
        self.cfg, self.shared = cfg, cfg.shared
        self.model_cfg = ModelConfig.from_dir(cfg.model)
        self.redis = connect(cfg.shared.redis_url) if cfg.shared.redis_url else None
        worker_cfg = ExpertWorkerConfig(
            model=cfg.model, dtype=cfg.expert_dtype, num_threads=cfg.expert_threads, host=cfg.expert_host,
            model_config=read_model_config(cfg.model),  # their nodes need no checkpoint (peer copy)
        )  # fmt: skip
        self.pool = ExpertPool(cfg.shared, worker_cfg, cfg.expert_resources)
        self.target_workers = cfg.expert_workers
        self.attention: dict[str, ray.actor.ActorHandle] = {}
        self.attention_state: dict[str, dict] = {}  # name -> its last `ready` answer (or why none)
        self.placement: Placement | None = None
        self.slots = 0
        self.migrations: list[MigrationRecord] = []
        self.heals = 0
        self.resumed = False  # this balancer re-attached to a running pool
        self.last_decision: Decision | None = None
        self.last_loads: torch.Tensor | None = None
        self._stale_versions: set[int] = set()  # loaded on workers, maybe still used by someone
        self._replacing: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    @property
    def addresses(self) -> dict[str, str]:
        return self.pool.addresses

    def eplb_pool(self, workers: list[str] | None = None) -> Pool:
        nodes = self.pool.nodes
        return Pool.grouped({w: nodes[w] for w in (workers if workers is not None else nodes)})

    def _slots_for(self, num_workers: int) -> int:
        return max(
            slots_per_worker(self.model_cfg, num_workers, self.cfg.redundant_experts),
            -(-self.model_cfg.n_routed_experts // num_workers),
        )

    # ---- start / resume -----------------------------------------------------------------
    async def start(self) -> dict:
        """Start the expert pool and load the first placement, or re-attach to a running pool
        (a restarted balancer). Idempotent: a running balancer answers with its placement."""
        async with self._lock:
            if self.placement is None:
                self._find_attention()
                adopted = await self.pool.adopt_running()
                if adopted and await self._resume(adopted):
                    self.resumed = True
                else:
                    await self._fresh_start()
            return self.placement_info()

    async def _fresh_start(self) -> None:
        await self.pool.stop_all()
        await asyncio.gather(*[self.pool.start_worker() for _ in range(self.target_workers)])
        pool = self.eplb_pool()
        self.slots = slots_per_worker(self.model_cfg, pool.num_workers, self.cfg.redundant_experts)
        persisted = self._persisted()
        if persisted is not None and persisted.num_slots == self.slots * pool.num_workers:
            # the same layout on this (re)started pool, under a new version
            placement = Placement(persisted.version + 1, persisted.phy2log, pool.workers)
        else:
            placement = initial_placement(self.model_cfg, pool, self.slots)
            if persisted is not None:
                placement = Placement(persisted.version + 1, placement.phy2log, pool.workers)
        await asyncio.to_thread(load_placement, placement, self.addresses, self.model_cfg.moe_layers)
        self.placement = placement
        self._persist(placement)
        if self.attention:  # a restarted balancer that found no worker alive
            await self._switch_attention(placement)

    async def _resume(self, adopted: list[str]) -> bool:
        """Take over the running `adopted` workers and the placement they serve; False if there is
        no placement to resume (then the caller starts afresh)."""
        placement = self._persisted() or await self._placement_from_attention()
        if placement is None:
            return False
        for wid in adopted:
            stats = await asyncio.to_thread(self.pool.members[wid].client.stats, 10.0)
            versions = set(stats.loaded_versions)
            if wid not in placement.workers or placement.version not in versions:
                await self.pool.stop_worker(wid)  # not part of this placement (an unfinished change)
            else:
                self._stale_versions |= versions - {placement.version}
        self.placement, self.slots = placement, placement.slots_per_worker
        self.target_workers = len(placement.workers)
        log.info("resumed placement v%d over %s (missing: %s)", placement.version, self.pool.workers,
                 [w for w in placement.workers if w not in self.pool.members])  # fmt: skip
        return True

    def _find_attention(self) -> None:
        for info in ray.util.list_named_actors(all_namespaces=True):
            if info["namespace"] == self.shared.namespace and _ATTENTION_NAME.match(info["name"]):
                self.attention.setdefault(
                    info["name"], ray.get_actor(info["name"], namespace=info["namespace"])
                )

    async def _placement_from_attention(self) -> Placement | None:
        best = None
        for actor in self.attention.values():
            try:
                d = await asyncio.wait_for(actor.placement.remote(), 10)
            except Exception:
                continue
            if d is not None and (best is None or d["version"] > best["version"]):
                best = d
        return None if best is None else Placement.from_dict(best)

    def _persisted(self) -> Placement | None:
        if self.redis is None:
            return None
        try:
            d = restore_placement(self.redis, self.shared.key_prefix)
        except Exception as e:  # Redis down
            log.warning("cannot read the persisted placement: %s", e)
            return None
        if d is None or len(d["phy2log"]) != self.model_cfg.num_moe_layers:
            return None
        return Placement.from_dict(d)

    def _persist(self, placement: Placement) -> None:
        if self.redis is None:
            return
        try:
            persist_placement(self.redis, self.shared.key_prefix, placement.to_dict())
        except Exception as e:
            log.warning("cannot persist placement v%d: %s", placement.version, e)

    def placement_info(self) -> dict:
        return {"placement": self.placement.to_dict(), "addresses": dict(self.addresses)}

    def register_attention(self, names: list[str]) -> None:
        for n in names:
            self.attention[n] = ray.get_actor(n, namespace=self.shared.namespace)

    # ---- health: the watch tick ---------------------------------------------------------
    async def watch(self) -> None:
        """One tick: drop dead workers, heal the placement, catch attention workers up, start
        replacements for the dead."""
        if self.placement is None:
            return
        for wid, why in (await self.pool.check()).items():
            log.warning("expert worker %s is dead (%s)", wid, why)
            self.pool.remove_dead(wid, why)
        if any(w not in self.pool.members for w in self.placement.workers):
            await self.heal()
        if not self._lock.locked():
            await self._reconcile()
        replacing = self._replacing is not None and not self._replacing.done()
        if len(self.pool.members) < self.target_workers and not replacing and not self._lock.locked():
            self._replacing = asyncio.get_running_loop().create_task(
                self.scale(self.target_workers, reason="replace dead workers")
            )

    async def heal(self) -> MigrationRecord | None:
        """Re-plan the experts of workers that left the pool onto the live ones (onto a new pool
        when none is left)."""
        async with self._lock:
            dead = [w for w in self.placement.workers if w not in self.pool.members]
            if not dead:
                return None
            if self.pool.members:
                pool = self.eplb_pool()
                self.slots = self._slots_for(pool.num_workers)
                decision = decide(self.model_cfg, self.placement, self._loads(), pool, self.slots,
                                  self.cfg.min_gain, force=True)  # fmt: skip
                decision.reason = f"heal: {', '.join(dead)} died"
            else:
                await asyncio.gather(*[self.pool.start_worker() for _ in range(self.target_workers)])
                pool = self.eplb_pool()
                self.slots = slots_per_worker(self.model_cfg, pool.num_workers, self.cfg.redundant_experts)
                fresh = initial_placement(self.model_cfg, pool, self.slots, self._loads())
                new = Placement(self.placement.version + 1, fresh.phy2log, pool.workers)
                decision = Decision(
                    new, float("nan"), float("nan"), new.num_slots, "heal: every expert worker died"
                )
            record = await self._migrate(decision)
            if record.ok:
                self.heals += 1
                now = time.time()
                for d in self.pool.dead:
                    if d.worker_id in dead and d.healed_s is None:
                        d.healed_s = now - d.detected_at
            return record

    async def _reconcile(self) -> None:
        """Push the placement to attention workers that are behind; release versions nobody uses."""
        version = self.placement.version
        behind = []
        for name, actor in list(self.attention.items()):
            try:
                state = self.attention_state[name] = await asyncio.wait_for(actor.ready.remote(), 2.0)
            except Exception as e:  # dead or restarting: it catches up when it answers again
                self.attention_state[name] = {"state": "unavailable", "error": type(e).__name__}
                behind.append(name)
                continue
            if state["placement_version"] != version:
                behind.append(name)
                await self._switch_attention(self.placement, {name: actor})
        if not behind and self._stale_versions:
            stale, self._stale_versions = self._stale_versions, set()
            for v in sorted(stale - {version}):
                await self._release(v, list(self.addresses.values()))

    async def _switch_attention(self, placement: Placement, attention: dict | None = None) -> list[str]:
        """Tell attention workers to route with `placement`; the names that did not switch."""
        attention = self.attention if attention is None else attention
        addresses = {w: self.addresses[w] for w in placement.workers}
        results = await asyncio.gather(
            *[asyncio.wait_for(a.set_placement.remote(placement.to_dict(), addresses), self.cfg.switch_timeout_s)
              for a in attention.values()],
            return_exceptions=True,
        )  # fmt: skip
        return [n for n, r in zip(attention, results, strict=True) if isinstance(r, BaseException)]

    async def _release(self, version: int, addresses: list[str]) -> None:
        try:
            await asyncio.to_thread(release_version, version, addresses)
        except Exception as e:  # a worker that died meanwhile holds nothing
            log.warning("releasing v%d: %s", version, e)

    # ---- loads and rebalancing ----------------------------------------------------------
    def read_loads(self) -> torch.Tensor | None:
        if self.redis is None:
            return None
        shared, m = self.shared, self.model_cfg
        try:
            loads = read_load_window(self.redis, shared.key_prefix, current_bucket(shared.bucket_seconds),
                                     self.cfg.window_buckets, m.num_moe_layers, m.n_routed_experts)  # fmt: skip
        except Exception as e:
            log.warning("cannot read loads from Redis: %s", e)
            return None
        self.last_loads = loads
        return loads

    def _loads(self) -> torch.Tensor:
        """The latest loads (uniform without any)."""
        loads = self.last_loads if self.last_loads is not None else self.read_loads()
        return (
            loads
            if loads is not None
            else torch.ones(self.model_cfg.num_moe_layers, self.model_cfg.n_routed_experts)
        )

    async def rebalance(self, force: bool = False, loads: torch.Tensor | None = None) -> dict:
        """Re-plan for the recent loads (or `loads` [num_moe_layers, E]) and migrate if worth it."""
        async with self._lock:
            if loads is None:
                loads = self.read_loads()
            if loads is None:
                return {"migrated": False, "reason": "no load data (Redis unavailable)"}
            self.last_loads = loads
            if any(w not in self.pool.members for w in self.placement.workers):
                return {"migrated": False, "reason": "a dead worker is being healed"}
            decision = decide(self.model_cfg, self.placement, loads, self.eplb_pool(list(self.placement.workers)),
                              self.slots, self.cfg.min_gain, force)  # fmt: skip
            self.last_decision = decision
            if decision.placement is None:
                return {
                    "migrated": False,
                    "reason": decision.reason,
                    "balancedness": decision.balancedness_before,
                }
            record = await self._migrate(decision)
            return {"migrated": record.ok, **asdict(record)}

    async def scale(self, num_workers: int, reason: str = "scaled pool") -> dict:
        """Grow or shrink the expert pool to `num_workers` (also its target from now on, which the
        balancer restores after a worker dies), migrating experts off removed workers before they
        stop. New workers start outside the lock: serving and healing go on meanwhile."""
        if num_workers < 1:
            raise ValueError("the expert pool needs at least one worker")
        self.target_workers = num_workers
        grow = num_workers - len(self.pool.members)
        await asyncio.gather(*[self.pool.start_worker() for _ in range(max(0, grow))])
        async with self._lock:
            members = self.pool.workers
            leaving = members[num_workers:]
            staying = members[:num_workers]
            pool = self.eplb_pool(staying)
            self.slots = self._slots_for(pool.num_workers)
            decision = decide(self.model_cfg, self.placement, self._loads(), pool, self.slots,
                              self.cfg.min_gain, force=True)  # fmt: skip
            decision.reason = reason
            record = await self._migrate(decision, leaving)
            return {"workers": len(self.pool.members), **asdict(record)}

    async def _migrate(self, decision: Decision, leaving: list[str] = ()) -> MigrationRecord:
        new, old = decision.placement, self.placement
        t0 = time.monotonic()
        record = MigrationRecord(new.version, decision.reason, decision.balancedness_before,
                                 decision.balancedness_after, decision.moved_slots, 0, 0.0, 0.0, 0.0, False,
                                 started_at=time.time())  # fmt: skip
        addresses = {w: self.addresses[w] for w in new.workers}
        try:  # (a) load the new version everywhere, old keeps serving; experts a node's
            # checkpoint lacks are copied from the live workers of the current pool (they hold v)
            replies = await asyncio.to_thread(
                load_placement, new, addresses, self.model_cfg.moe_layers, peers=list(self.addresses.values())
            )
            record.bytes_read = sum(r.bytes_read for r in replies)
            record.bytes_from_peers = sum(r.bytes_from_peers for r in replies)
        except Exception as e:
            await self._release(new.version, list(addresses.values()))
            record.error = f"load failed, kept v{old.version}: {e}"
            record.total_s = time.monotonic() - t0
            self.migrations.append(record)
            log.warning(record.error)
            return record
        record.load_s = time.monotonic() - t0
        # (b) persist and switch attention workers at their step boundaries
        self._persist(new)
        self.placement = new
        t1 = time.monotonic()
        failed = await self._switch_attention(new)
        record.switch_s = time.monotonic() - t1
        live_old = [self.addresses[w] for w in old.workers if w in self.addresses]
        if failed:  # keep the old version loaded: those attention workers may still use it
            record.error = f"attention workers {failed} did not switch yet (the watch tick retries)"
            self._stale_versions.add(old.version)
        else:  # (c) nobody uses the old version any more
            await self._release(old.version, live_old)
        for w in leaving:
            await self.pool.stop_worker(w)
        record.ok = True
        record.total_s = time.monotonic() - t0
        self.migrations.append(record)
        log.info("migration to v%d: %s", new.version, asdict(record))
        return record

    # ---- reporting ----------------------------------------------------------------------
    def status(self) -> dict:
        p = self.placement
        loads = self.last_loads
        stats = worker_load = None
        if (
            p is not None
            and loads is not None
            and bool(loads.any())
            and set(p.workers) <= set(self.pool.members)
        ):
            nodes, gpus = self.eplb_pool(list(p.workers)).eplb_args(self.model_cfg)
            stats = placement_stats(p.phy2log, loads.double(), gpus, nodes)
            worker_load = gpu_loads(p.phy2log, loads.double(), gpus).sum(0).tolist()
        serving = set(p.workers) if p else set()
        return {
            "version": p.version if p else 0,
            "workers": [
                {
                    "id": w,
                    "state": "serving" if w in self.pool.members else "dead",
                    "address": self.addresses.get(w, "-"),
                    "node": self.pool.nodes.get(w, "-"),
                    "slots": list(p.worker_slots(i)),
                    "load": worker_load[i] if worker_load else None,
                }
                for i, w in enumerate(p.workers if p else [])
            ]
            + [
                {
                    "id": w,
                    "state": "joining",
                    "address": self.addresses[w],
                    "node": self.pool.nodes[w],
                    "slots": [],
                    "load": None,
                }
                for w in self.pool.workers
                if w not in serving
            ],  # fmt: skip
            "target_workers": self.target_workers,
            "dead_workers": [asdict(d) for d in self.pool.dead],
            "heals": self.heals,
            "resumed": self.resumed,
            "slots_per_worker": self.slots,
            "phy2log": p.phy2log.tolist() if p else [],
            "loads": loads.tolist() if loads is not None else None,
            "balancedness": stats.balancedness if stats else None,
            "balancedness_per_layer": stats.layer_balancedness.tolist() if stats else None,
            "migrations": sum(1 for m in self.migrations if m.ok),
            "last_migration": asdict(self.migrations[-1]) if self.migrations else None,
            "last_decision": _decision_info(self.last_decision),
            "attention_workers": list(self.attention),
            "attention": {n: self.attention_state.get(n, {}) for n in self.attention},
        }

    async def worker_stats(self) -> dict:
        """Per expert worker: token counts per local slot of each loaded version (their own counters)."""

        def read(address: str):
            client = ExpertClient(address)
            try:
                return client.stats()
            finally:
                client.close()

        out = {}
        for w, address in self.addresses.items():
            reply = await asyncio.to_thread(read, address)
            out[w] = {v.version: {ls.layer: list(ls.tokens) for ls in v.layers} for v in reply.versions}
        return out

    async def shutdown(self) -> None:
        if self._replacing is not None:
            self._replacing.cancel()
        await self.pool.stop_all()


def _decision_info(d: Decision | None) -> dict | None:
    if d is None:
        return None
    return {"version": d.placement.version if d.placement else None, "reason": d.reason,
            "balancedness_before": d.balancedness_before, "balancedness_after": d.balancedness_after,
            "moved_slots": d.moved_slots}  # fmt: skip


@ray.remote(num_cpus=0, max_concurrency=100)
class Balancer:
    """Start it detached with `max_restarts=-1`: a restarted balancer resumes by itself."""

    def __init__(self, cfg: BalancerConfig):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.core = BalancerCore(cfg)
        self._tasks: list[asyncio.Task] = []
        if ray.get_runtime_context().was_current_actor_reconstructed:
            log.warning("balancer restarted: re-attaching to the running pool")
            ray.get_runtime_context().current_actor.start.remote()

    async def start(self) -> dict:
        info = await self.core.start()
        if not self._tasks:
            loop = asyncio.get_running_loop()
            if self.core.cfg.period_s > 0:
                self._tasks.append(loop.create_task(self._every(self.core.cfg.period_s, self._rebalance)))
            if self.core.cfg.watch_s > 0:
                self._tasks.append(loop.create_task(self._every(self.core.cfg.watch_s, self.core.watch)))
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
        return self.core.placement_info()

    async def register_attention(self, names: list[str]) -> None:
        self.core.register_attention(names)

    async def rebalance(self, force: bool = False, loads: list | None = None) -> dict:
        return await self.core.rebalance(force, None if loads is None else torch.tensor(loads))

    async def scale_experts(self, num_workers: int) -> dict:
        return await self.core.scale(num_workers)

    async def status(self) -> dict:
        return self.core.status()

    async def worker_stats(self) -> dict:
        return await self.core.worker_stats()

    async def migration_log(self) -> list[dict]:
        return [asdict(m) for m in self.core.migrations]

    async def pid(self) -> int:
        return os.getpid()

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.core.shutdown()
