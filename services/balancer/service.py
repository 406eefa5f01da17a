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

Every `health_s` it checks the pool's health (pool.py: a deadline per check drawn from observed
latency). A dead or hung worker leaves the pool at once (a hung one is killed: fenced) and its
experts are re-planned onto the survivors (a migration like the above, "heal"): steps that needed
it wait, retrying, until the attention workers switch. Every `watch_s` a fresh worker is started
to bring the pool back to its target size (another migration), the current placement is pushed to
attention workers that are behind (a restarted one) and versions nobody uses are released.

A router that finds an attention worker hung (its streams stalled, its pings unanswered) asks
`fence_attention`: the balancer pings it too, within its own measured deadline, and if it does not
answer kills it; Ray restarts it in place (a fresh process, which re-attaches and catches up).

The balancer is a detached actor that Ray restarts; the expert workers are detached too, so they
survive it. A restarted balancer re-attaches to the running workers and attention workers by
name and resumes the placement persisted in Redis (or, with Redis down, the one the attention
workers use), healing whatever died meanwhile. Redis down stops rebalancing, not serving; the
balancer down freezes the placement, not serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import asdict, dataclass, field

import ray
import torch

from services.dataplane.placement import Placement
from services.experts.client import ExpertClient, load_placement, release_version
from services.experts.server import ExpertWorkerConfig, read_model_config
from services.model.config import ModelConfig
from services.model.mtp import served_experts
from services.redis_store import (
    checked_placement,
    connect,
    current_bucket,
    persist_placement,
    read_load_window,
    restore_placement,
)
from services.settings import BalancerSettings, ExpertSettings, SharedSettings, build_config

from .attention_pool import ATTENTION_NAME, AttentionScaling
from .autoscale import AutoscaleConfig
from .fencing import AttentionFence
from .policy import Decision, MigrationRecord, Pool, decide, initial_placement, slots_per_worker
from .pool import ExpertPool
from .status import balancer_status

log = logging.getLogger(__name__)


@dataclass
class BalancerConfig:
    """The balancer's config: its settings and the expert pool's (services/settings.py), as the
    launcher's `ClusterConfig` holds them, and what the launcher decides at start."""

    model: str
    experts: ExpertSettings = field(default_factory=ExpertSettings)  # the pool: size, autoscaling, workers
    settings: BalancerSettings = field(default_factory=BalancerSettings)  # re-placement: period, window, gain
    shared: SharedSettings = field(default_factory=SharedSettings)  # Redis, key prefix, namespace, data plane
    attention: AttentionScaling | None = None  # the attention pool sizes itself (attention_pool.py)
    expert_host: str | None = None  # None: each worker's node IP
    watch_s: float = 0.5  # reconcile / replace period (0: off)
    health_s: float = 0.25  # expert workers' health check period (0: off; checked on the watch tick)
    attention_restart_s: float = 120.0  # a fenced attention worker is not fenced again while it restarts
    switch_timeout_s: float = 30.0  # an attention worker slower than this to switch is retried later
    gc_s: float = 5.0  # how often versions nobody uses are released

    @property
    def period_s(self) -> float:
        """Seconds between rebalancing checks (0: on demand only)."""
        return self.settings.period_s

    @property
    def autoscale(self) -> AutoscaleConfig | None:
        """The expert pool's autoscaling (autoscale.py), or None with min == max: a fixed pool."""
        lo, hi = self.experts.bounds()
        cfg = build_config(AutoscaleConfig, self.experts, min_workers=lo, max_workers=hi)
        return cfg if cfg.enabled else None

    def expert_worker_config(self) -> ExpertWorkerConfig:
        """Each expert worker's config: the expert and shared settings named like its fields."""
        return build_config(
            ExpertWorkerConfig, self.experts, self.shared, model=self.model,
            model_config=read_model_config(self.model),  # their nodes need no checkpoint (peer copy)
            device=self.experts.device, host=self.expert_host,
            shm=self.shared.transport in ("auto", "shm"),  # (grpc: no shared-memory listener at all)
        )  # fmt: skip


class BalancerCore:
    """The balancer's logic over Ray handles; the actor below only schedules it."""

    def __init__(self, cfg: BalancerConfig):
        self.cfg, self.shared = cfg, cfg.shared
        # the MoE layers the pool serves: with speculation the MTP module's too (placed, counted, re-placed)
        self.model_cfg = served_experts(ModelConfig.from_dir(cfg.model), cfg.shared.speculative_tokens > 0)
        self.redis = connect(cfg.shared.redis_url) if cfg.shared.redis_url else None
        self.pool = ExpertPool(cfg.shared, cfg.expert_worker_config(), dict(cfg.experts.resources),
                               num_gpus=cfg.experts.gpus)  # fmt: skip
        self.target_workers = cfg.experts.workers
        self.attention: dict[str, ray.actor.ActorHandle] = {}
        self.attention_state: dict[str, dict] = {}  # name -> its last `ready` answer (or why none)
        self.placement: Placement | None = None
        self.slots = 0
        self.migrations: list[MigrationRecord] = []
        self.heals = 0
        self.resumed = False  # this balancer re-attached to a running pool
        self.last_decision: Decision | None = None
        self.last_loads: torch.Tensor | None = None
        self._retiring: set[str] = set()  # left the pool; stopped once no attention worker uses them
        self._gc_due = 0.0  # next release of unused versions (monotonic)
        self._heal_after = self._heal_backoff = 0.0
        self._scale_after = self._scale_backoff = 0.0
        self._replacing: asyncio.Task | None = None
        self.fence = AttentionFence(cfg.attention_restart_s)  # hung attention workers (fencing.py)
        self._lock = asyncio.Lock()
        self._scale_lock = asyncio.Lock()  # one resize at a time, from its first start to its end

    @property
    def addresses(self) -> dict[str, str]:
        return self.pool.addresses

    def eplb_pool(self, workers: list[str] | None = None) -> Pool:
        nodes = self.pool.nodes
        return Pool.grouped({w: nodes[w] for w in (workers if workers is not None else nodes)})

    def _slots_for(self, num_workers: int) -> int:
        return max(
            slots_per_worker(self.model_cfg, num_workers, self.cfg.experts.redundant_experts),
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
        error = await self.pool.ensure(self.target_workers)
        if not self.pool.members:
            raise RuntimeError(f"no expert worker started: {error}")
        pool = self.eplb_pool()
        self.slots = slots_per_worker(self.model_cfg, pool.num_workers, self.cfg.experts.redundant_experts)
        persisted = self._persisted()
        if persisted is not None and persisted.num_slots == self.slots * pool.num_workers:
            # the same layout on this (re)started pool, under a new version
            placement = Placement(persisted.version + 1, persisted.phy2log, pool.workers)
        else:
            placement = initial_placement(self.model_cfg, pool, self.slots)
            if persisted is not None:
                placement = Placement(persisted.version + 1, placement.phy2log, pool.workers)
        await self._load(placement, self.addresses)
        self.placement = placement
        self._persist(placement)
        if self.attention:  # a restarted balancer that found no worker alive
            await self._switch_attention(placement, self._addresses_of(placement))

    async def _load(self, placement: Placement, addresses: dict[str, str], peers: list[str] = ()) -> list:
        """LoadSlots of `placement` on its workers (with the cluster's secret), off the event loop."""
        load = functools.partial(load_placement, peers=peers, secret=self.shared.secret)
        return await asyncio.to_thread(load, placement, addresses, self.model_cfg.moe_layers)

    async def _resume(self, adopted: list[str]) -> bool:
        """Take over the running `adopted` workers and the placement they serve; False if there is
        none to resume (then the caller starts afresh).

        The candidates are the placement persisted in Redis and the one the attention workers
        route with (either can be ahead: the balancer may have died between persisting and
        switching, or a persist may have failed); the newest one the workers hold wins. Adopted
        workers outside it stay in the pool (they are placed by the next scale)."""
        held = {}
        for wid in adopted:
            try:
                stats = await asyncio.to_thread(self.pool.members[wid].client.stats, 10.0)
                held[wid] = set(stats.loaded_versions)
            except Exception as e:
                log.warning("adopted expert worker %s did not answer Stats (%s); dropping it", wid, e)
                self.pool.remove_dead(wid, f"no Stats on resume: {e}")
        candidates = [p for p in (self._persisted(), await self._placement_from_attention()) if p is not None]
        usable = [p for p in candidates if any(p.version in held.get(w, ()) for w in p.workers)]
        if not usable:
            return False
        placement = max(usable, key=lambda p: p.version)
        self.placement, self.slots = placement, placement.slots_per_worker
        self.target_workers = max(self.cfg.experts.workers, len(placement.workers))
        self._persist(placement)
        self._gc_due = 0.0  # release the versions nobody uses at the first chance
        log.info("resumed placement v%d over %s (missing: %s)", placement.version, self.pool.workers,
                 [w for w in placement.workers if w not in self.pool.members])  # fmt: skip
        return True

    def _find_attention(self) -> None:
        for info in ray.util.list_named_actors(all_namespaces=True):
            if info["namespace"] == self.shared.namespace and ATTENTION_NAME.match(info["name"]):
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
        """The placement persisted in Redis, if one this model can use: Redis down, nothing there
        or a malformed one (logged) is None, never an error (anyone who can write to Redis could
        leave garbage there)."""
        if self.redis is None:
            return None
        try:
            d = restore_placement(self.redis, self.shared.key_prefix)
        except Exception as e:  # Redis down, or not JSON
            log.warning("cannot read the persisted placement: %s", e)
            return None
        if d is None:
            return None
        try:
            return Placement.from_dict(checked_placement(d, self.model_cfg.num_moe_layers,
                                                         self.model_cfg.n_routed_experts))  # fmt: skip
        except ValueError as e:
            log.warning("ignoring the malformed placement persisted in Redis: %s", e)
            return None

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
    async def check_health(self) -> None:
        """Check the expert workers (each within its measured deadline); the dead and the hung
        leave the pool (a hung one is killed) and their experts are re-placed at once."""
        if self.placement is None:
            return
        for wid, why in (await self.pool.check()).items():
            if wid not in self.pool.members:  # (an overlapping round fenced it already)
                continue
            log.warning(
                "expert worker %s is %s; fencing it", wid, why if why.startswith("hung") else f"dead ({why})"
            )
            self.pool.remove_dead(wid, why)
        await self._heal_if_needed()

    async def _heal_if_needed(self) -> None:
        if (
            any(w not in self.pool.members for w in self.placement.workers)
            and time.monotonic() >= self._heal_after
            and not self._lock.locked()  # (a heal or migration under way: the next tick)
        ):
            record = await self.heal()
            if record is not None and not record.ok:  # back off: 0.5, 1, 2, ... 10 s
                self._heal_backoff = min(10.0, max(0.5, self._heal_backoff * 2))
                self._heal_after = time.monotonic() + self._heal_backoff
            else:
                self._heal_backoff = 0.0

    async def watch(self) -> None:
        """One tick: heal what the health checks found (with `health_s` 0, check here), catch
        attention workers up, release versions nobody uses, start replacements for the dead."""
        if self.placement is None:
            return
        if self.cfg.health_s > 0:
            await self._heal_if_needed()
        else:
            await self.check_health()
        if not self._lock.locked():
            await self._reconcile()
        replacing = self._replacing is not None and not self._replacing.done()
        unplaced = any(w not in self.placement.workers for w in self.pool.members)
        short = len(self.pool.members) < self.target_workers
        if (
            (short or unplaced)
            and not replacing
            and not self._lock.locked()
            and not self._scale_lock.locked()  # a resize starting workers: they are not short
            and time.monotonic() >= self._scale_after
        ):
            self._replacing = asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        """Bring the pool to its target size (after deaths); backs off when that fails."""
        try:
            result = await self.scale(self.target_workers, reason="replace dead workers", replacing=True)
            ok = result.get("ok", False)
        except Exception as e:
            log.warning("replacing dead expert workers failed: %s", e)
            ok = False
        self._scale_backoff = 0.0 if ok else min(30.0, max(1.0, self._scale_backoff * 2))
        self._scale_after = time.monotonic() + self._scale_backoff

    async def heal(self) -> MigrationRecord | None:
        """Re-plan the experts of workers that left the pool onto the live ones (the placed ones
        when any is left, onto a new pool when none is)."""
        async with self._lock:
            dead = [w for w in self.placement.workers if w not in self.pool.members]
            if not dead:
                return None
            survivors = [w for w in self.placement.workers if w in self.pool.members]
            if survivors:
                pool = self.eplb_pool(survivors)
                decision = decide(self.model_cfg, self.placement, self._loads(), pool,
                                  self._slots_for(pool.num_workers), self.cfg.settings.min_gain, force=True)  # fmt: skip
                decision.reason = f"heal: {', '.join(dead)} died"
            else:
                if not self.pool.members:
                    await self.pool.ensure(self.target_workers)
                if not self.pool.members:
                    return None  # (no node has room yet: the next watch tick tries again)
                pool = self.eplb_pool()
                slots = slots_per_worker(self.model_cfg, pool.num_workers, self.cfg.experts.redundant_experts)
                fresh = initial_placement(self.model_cfg, pool, slots, self._loads())
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
        """Push the placement to attention workers that are behind; forget the ones Ray reports
        dead for good; once every one routes with the current placement, release the versions
        nobody uses any more (every `gc_s`) and stop workers that left the pool."""
        version, everyone_current = self.placement.version, True
        attention = list(self.attention.items())
        answers = await asyncio.gather(*[self.fence.ping(name, actor, max(2.0, self.fence.pings.timeout_s(1)))
                                         for name, actor in attention], return_exceptions=True)  # fmt: skip
        for (name, actor), state in zip(attention, answers, strict=True):
            if isinstance(state, ray.exceptions.ActorDiedError):  # gone for good (killed, or out of restarts)
                log.warning("attention worker %s is gone; forgetting it", name)
                self.attention.pop(name)
                self.attention_state.pop(name, None)
                continue
            if isinstance(state, BaseException):  # restarting: it catches up when it answers again
                self.attention_state[name] = {"state": "unavailable", "error": type(state).__name__}
                everyone_current = False
                continue
            self.attention_state[name] = state
            if state["placement_version"] != version:
                everyone_current = False
                await self._switch_attention(
                    self.placement, self._addresses_of(self.placement), {name: actor}
                )
        if not everyone_current or self._lock.locked():
            return
        async with self._lock:  # no migration may be loading a version meanwhile
            for wid in list(self._retiring):
                self._retiring.discard(wid)
                if wid in self.pool.members and wid not in self.placement.workers:
                    await self.pool.stop_worker(wid)
            if time.monotonic() >= self._gc_due:
                self._gc_due = time.monotonic() + self.cfg.gc_s
                await self._release_unused()

    async def fence_attention(self, name: str, reason: str) -> dict:
        """A router found attention worker `name` hung: fenced unless it answers (fencing.py)."""
        actor = self.attention.get(name)
        if actor is None:
            return {"fenced": False, "why": "not an attention worker of this cluster"}
        return await self.fence.fence(name, actor, reason)

    async def _release_unused(self) -> None:
        """ReleaseSlots for every version an expert worker holds but the placement is not."""
        version = self.placement.version
        members = list(self.pool.members.values())
        timeout_s = 2 * self.pool.health_deadlines.timeout_s(1)
        stats = await asyncio.gather(*[asyncio.to_thread(m.client.stats, timeout_s) for m in members],
                                     return_exceptions=True)  # fmt: skip
        for member, st in zip(members, stats, strict=True):
            if isinstance(st, BaseException):  # (dead or hung: the health checks deal with it)
                continue
            for v in st.loaded_versions:
                if v != version:
                    await self._release(v, [member.address])

    def _addresses_of(self, placement: Placement) -> dict[str, str]:
        return {w: self.addresses[w] for w in placement.workers if w in self.addresses}

    async def _switch_attention(
        self, placement: Placement, addresses: dict[str, str], attention: dict | None = None
    ) -> list[str]:
        """Tell attention workers to route with `placement` (its workers at `addresses`); the names
        that did not switch."""
        attention = self.attention if attention is None else attention
        results = await asyncio.gather(
            *[asyncio.wait_for(a.set_placement.remote(placement.to_dict(), addresses), self.cfg.switch_timeout_s)
              for a in attention.values()],
            return_exceptions=True,
        )  # fmt: skip
        return [n for n, r in zip(attention, results, strict=True) if isinstance(r, BaseException)]

    async def _release(self, version: int, addresses: list[str]) -> None:
        try:
            await asyncio.to_thread(release_version, version, addresses, secret=self.shared.secret)
        except Exception as e:  # a worker that died meanwhile holds nothing; the others were released
            log.warning("releasing v%d: %s", version, e)

    # ---- loads and rebalancing ----------------------------------------------------------
    def read_loads(self) -> torch.Tensor | None:
        if self.redis is None:
            return None
        shared, m = self.shared, self.model_cfg
        try:
            loads = read_load_window(self.redis, shared.key_prefix, current_bucket(shared.bucket_seconds),
                                     self.cfg.settings.window_buckets, m.num_moe_layers, m.n_routed_experts)  # fmt: skip
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
                              self.slots, self.cfg.settings.min_gain, force)  # fmt: skip
            self.last_decision = decision
            if decision.placement is None:
                return {
                    "migrated": False,
                    "reason": decision.reason,
                    "balancedness": decision.balancedness_before,
                }
            record = await self._migrate(decision)
            return {"migrated": record.ok, **asdict(record)}

    async def scale(self, num_workers: int, reason: str = "scaled pool", replacing: bool = False) -> dict:
        """Grow or shrink the expert pool to `num_workers` (also its target from now on, which the
        balancer restores after a worker dies), migrating experts off removed workers before they
        stop. New workers start outside the migration lock: serving and healing go on meanwhile;
        resizes run one at a time. If the migration fails, the new workers that got no slot are
        stopped again. `replacing`: restoring the target after deaths; a worker that does not
        start leaves the target as it is (the watch tick tries again, backing off)."""
        if num_workers < 1:
            raise ValueError("the expert pool needs at least one worker")
        async with self._scale_lock:
            self.target_workers, before = num_workers, len(self.pool.members)
            error = await self.pool.ensure(num_workers)  # (asks Ray's autoscaler for the machines)
            if error is not None:  # some did not start: resize to those that did, if any; a resize
                # also stops asking for more (a later scale or autoscaling tick asks again)
                log.warning("the expert pool cannot grow to %d workers: %s", num_workers, error)
                num_workers = max(before, len(self.pool.members))
                if not replacing:
                    self.target_workers = num_workers
                    await asyncio.to_thread(self.pool.request_capacity, num_workers)
                if num_workers <= before:
                    return {"ok": False, "workers": before, "error": error}
            async with self._lock:
                members = self.pool.workers
                leaving, staying = members[num_workers:], members[:num_workers]
                pool = self.eplb_pool(staying)
                decision = decide(self.model_cfg, self.placement, self._loads(), pool,
                                  self._slots_for(pool.num_workers), self.cfg.settings.min_gain, force=True)  # fmt: skip
                decision.reason = reason
                record = await self._migrate(decision, leaving)
                if not record.ok:
                    for wid in staying:
                        if wid in self.pool.members and wid not in self.placement.workers:
                            await self.pool.stop_worker(wid)
                return {"workers": len(self.pool.members), **asdict(record)}

    async def _migrate(self, decision: Decision, leaving: list[str] = ()) -> MigrationRecord:
        new, old = decision.placement, self.placement
        t0 = time.monotonic()
        record = MigrationRecord(new.version, decision.reason, decision.balancedness_before,
                                 decision.balancedness_after, decision.moved_slots, 0, 0.0, 0.0, 0.0, False,
                                 started_at=time.time())  # fmt: skip
        self.migrations.append(record)
        del self.migrations[:-200]
        addresses = {w: self.addresses[w] for w in new.workers}
        try:  # (a) load the new version everywhere, old keeps serving; experts a node's
            # checkpoint lacks are copied from the live workers of the current pool (they hold v)
            replies = await self._load(new, addresses, peers=list(self.addresses.values()))
            record.bytes_read = sum(r.bytes_read for r in replies)
            record.bytes_from_peers = sum(r.bytes_from_peers for r in replies)
            record.peak_extra_bytes = max((r.peak_extra_bytes for r in replies), default=0)
            died = [w for w in new.workers if w not in self.pool.members]
            if died:
                raise RuntimeError(f"{died} died while loading")
        except Exception as e:
            await self._release(new.version, [a for w, a in addresses.items() if w in self.pool.members])
            record.error = f"load failed, kept v{old.version}: {e}"
            record.total_s = time.monotonic() - t0
            log.warning(record.error)
            return record
        record.load_s = time.monotonic() - t0
        # (b) persist and switch attention workers at their step boundaries
        self._persist(new)
        self.placement, self.slots = new, new.slots_per_worker
        t1 = time.monotonic()
        failed = await self._switch_attention(new, addresses)
        record.switch_s = time.monotonic() - t1
        if failed:  # they may still route with the old version: the watch tick catches them up,
            # then releases it and stops the leaving workers
            record.error = f"attention workers {failed} did not switch yet (the watch tick retries)"
            self._retiring.update(leaving)
        else:  # (c) nobody uses the old version any more
            await self._release(old.version, [self.addresses[w] for w in old.workers if w in self.addresses])
            for w in leaving:
                await self.pool.stop_worker(w)
        record.ok = True
        record.total_s = time.monotonic() - t0
        log.info("migration to v%d: %s", new.version, asdict(record))
        return record

    # ---- reporting ----------------------------------------------------------------------
    def status(self) -> dict:
        return balancer_status(self)

    async def worker_stats(self) -> dict:
        """Per expert worker: token counts per local slot of each loaded version (their own counters)."""

        def read(address: str):
            client = ExpertClient(address, secret=self.shared.secret)
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
        await self.pool.stop_all(release_capacity=True)
