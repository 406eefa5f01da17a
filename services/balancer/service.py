"""The balancer: owns the expert pool and the placement, re-places experts while serving goes on.

Every `period_s` (and on demand) it sums the last `window_buckets` load buckets from Redis, asks
`policy.decide` for a better placement and, when one is worth it, migrates in two phases:

  (a) LoadSlots(new version) on every expert worker: they read the moved experts (checkpoint
      mmap) while still serving the old version. Any failure aborts: the new version is
      released where it loaded and the old placement keeps serving.
  (b) persist the new placement in Redis, then tell every attention worker; each switches at
      its next step boundary and answers once no step of its uses the old version.
  (c) ReleaseSlots(old version) on every expert worker; workers leaving the pool stop now.

Redis down stops rebalancing, not serving; the balancer down freezes the placement, not serving.
A restarted balancer resumes the placement persisted in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field

import ray
import torch

from services.experts.client import ExpertClient, load_placement, release_version
from services.experts.server import ExpertWorkerConfig, read_model_config
from services.experts.worker import ExpertWorker
from services.model.config import ModelConfig
from services.model.placement import Placement
from services.redis_store import (
    connect,
    current_bucket,
    persist_placement,
    read_load_window,
    restore_placement,
)
from services.settings import SharedSettings, expert_worker_name

from .eplb import gpu_loads, placement_stats
from .policy import Decision, Pool, decide, initial_placement, slots_per_worker

log = logging.getLogger(__name__)


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
    detached: bool = False  # expert workers outlive the process that started the cluster


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
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_dir(cfg.model)
        # expert workers get config.json from here: their nodes need no checkpoint (peer copy)
        self.model_config_json = read_model_config(cfg.model)
        self.shared = cfg.shared
        self.redis = connect(cfg.shared.redis_url) if cfg.shared.redis_url else None
        self.workers: dict[str, ray.actor.ActorHandle] = {}  # worker id -> actor
        self.addresses: dict[str, str] = {}  # worker id -> host:port
        self.nodes: dict[str, str] = {}  # worker id -> Ray node id
        self.attention: dict[str, ray.actor.ActorHandle] = {}
        self.placement: Placement | None = None
        self.slots = 0
        self.migrations: list[MigrationRecord] = []
        self.last_decision: Decision | None = None
        self.last_loads: torch.Tensor | None = None
        self._next_worker = 0
        self._lock = asyncio.Lock()

    # ---- expert pool --------------------------------------------------------------------
    async def _start_worker(self) -> str:
        wid = f"expert-{self._next_worker}"
        self._next_worker += 1
        wcfg = ExpertWorkerConfig(model=self.cfg.model, dtype=self.cfg.expert_dtype,
                                  num_threads=self.cfg.expert_threads, host=self.cfg.expert_host,
                                  model_config=self.model_config_json)  # fmt: skip
        actor = ExpertWorker.options(
            name=expert_worker_name(wid),
            namespace=self.shared.namespace,
            resources=self.cfg.expert_resources or None,
            lifetime="detached" if self.cfg.detached else None,
        ).remote(wcfg)
        self.addresses[wid] = await actor.start.remote()
        self.nodes[wid] = await actor.node_id.remote()
        self.workers[wid] = actor
        return wid

    async def _stop_worker(self, wid: str) -> None:
        actor = self.workers.pop(wid)
        self.addresses.pop(wid, None)
        self.nodes.pop(wid, None)
        try:
            await actor.stop.remote()
        finally:
            ray.kill(actor)

    def pool(self) -> Pool:
        return Pool.grouped({w: self.nodes[w] for w in self.workers})

    async def start(self) -> dict:
        """Start the expert workers and load the first placement (or the persisted one).
        Idempotent: a running balancer answers with its current placement."""
        if self.placement is not None:
            return self.placement_info()
        await asyncio.gather(*[self._start_worker() for _ in range(self.cfg.expert_workers)])
        pool = self.pool()
        self.slots = slots_per_worker(self.model_cfg, pool.num_workers, self.cfg.redundant_experts)
        persisted = self._persisted()
        if persisted is not None and persisted.num_slots == self.slots * pool.num_workers:
            # resume: the same layout on this (re)started pool, under a new version
            placement = Placement(persisted.version + 1, persisted.phy2log, pool.workers)
        else:
            placement = initial_placement(self.model_cfg, pool, self.slots)
            if persisted is not None:
                placement = Placement(persisted.version + 1, placement.phy2log, pool.workers)
        await asyncio.to_thread(load_placement, placement, self.addresses, self.model_cfg.moe_layers)
        self.placement = placement
        self._persist(placement)
        return self.placement_info()

    def _persisted(self) -> Placement | None:
        if self.redis is None:
            return None
        try:
            d = restore_placement(self.redis, self.shared.key_prefix)
        except Exception as e:  # Redis down: start fresh
            log.warning("cannot read the persisted placement: %s", e)
            return None
        if d is None or len(d["phy2log"]) != self.model_cfg.num_moe_layers:
            return None
        return Placement(int(d["version"]), torch.tensor(d["phy2log"]), tuple(d["workers"]))

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

    async def rebalance(self, force: bool = False, loads: torch.Tensor | None = None) -> dict:
        """Re-plan for the recent loads (or `loads` [num_moe_layers, E]) and migrate if worth it."""
        async with self._lock:
            if loads is None:
                loads = self.read_loads()
            if loads is None:
                return {"migrated": False, "reason": "no load data (Redis unavailable)"}
            self.last_loads = loads
            decision = decide(
                self.model_cfg, self.placement, loads, self.pool(), self.slots, self.cfg.min_gain, force
            )
            self.last_decision = decision
            if decision.placement is None:
                return {
                    "migrated": False,
                    "reason": decision.reason,
                    "balancedness": decision.balancedness_before,
                }
            record = await self._migrate(decision)
            return {"migrated": record.ok, **asdict(record)}

    async def scale(self, num_workers: int) -> dict:
        """Grow or shrink the expert pool to `num_workers`, migrating experts off removed workers
        before they stop."""
        if num_workers < 1:
            raise ValueError("the expert pool needs at least one worker")
        async with self._lock:
            current = len(self.workers)
            if num_workers > current:
                await asyncio.gather(*[self._start_worker() for _ in range(num_workers - current)])
                leaving: list[str] = []
            else:
                leaving = list(self.workers)[num_workers:]
            staying = {w: self.nodes[w] for w in self.workers if w not in leaving}
            pool = Pool.grouped(staying)
            self.slots = max(
                slots_per_worker(self.model_cfg, pool.num_workers, self.cfg.redundant_experts),
                -(-self.model_cfg.n_routed_experts // pool.num_workers),
            )
            loads = self.last_loads if self.last_loads is not None else self.read_loads()
            if loads is None:
                loads = torch.ones(self.model_cfg.num_moe_layers, self.model_cfg.n_routed_experts)
            decision = decide(
                self.model_cfg, self.placement, loads, pool, self.slots, self.cfg.min_gain, force=True
            )
            record = await self._migrate(decision, leaving)
            return {"workers": len(self.workers), **asdict(record)}

    async def _migrate(self, decision: Decision, leaving: list[str] = ()) -> MigrationRecord:
        new, old = decision.placement, self.placement
        t0 = time.monotonic()
        started_at = time.time()
        record = MigrationRecord(new.version, decision.reason, decision.balancedness_before,
                                 decision.balancedness_after, decision.moved_slots, 0, 0.0, 0.0, 0.0, False,
                                 started_at=started_at)  # fmt: skip
        addresses = {w: self.addresses[w] for w in new.workers}
        try:  # (a) load the new version everywhere, old keeps serving; experts a node's
            # checkpoint lacks are copied from the workers of the current pool (they hold v)
            peers = list(self.addresses.values())
            replies = await asyncio.to_thread(
                load_placement, new, addresses, self.model_cfg.moe_layers, peers=peers
            )
            record.bytes_read = sum(r.bytes_read for r in replies)
            record.bytes_from_peers = sum(r.bytes_from_peers for r in replies)
        except Exception as e:
            await asyncio.to_thread(release_version, new.version, list(addresses.values()))
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
        results = await asyncio.gather(
            *[a.set_placement.remote(new.to_dict(), addresses) for a in self.attention.values()],
            return_exceptions=True,
        )
        record.switch_s = time.monotonic() - t1
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:  # keep the old version loaded: some attention worker may still use it
            record.error = f"{len(failed)} attention workers did not switch: {failed[0]}"
        else:  # (c) nobody uses the old version any more
            await asyncio.to_thread(
                release_version, old.version, [self.addresses[w] for w in old.workers if w in self.addresses]
            )
        for w in leaving:
            await self._stop_worker(w)
        record.ok = not failed
        record.total_s = time.monotonic() - t0
        self.migrations.append(record)
        log.info("migration to v%d: %s", new.version, asdict(record))
        return record

    # ---- reporting ----------------------------------------------------------------------
    def status(self) -> dict:
        p = self.placement
        pool = self.pool()
        nodes, gpus = pool.eplb_args(self.model_cfg)
        loads = self.last_loads
        stats = worker_load = None
        if p is not None and loads is not None and bool(loads.any()) and p.workers == pool.workers:
            stats = placement_stats(p.phy2log, loads.double(), gpus, nodes)
            worker_load = gpu_loads(p.phy2log, loads.double(), gpus).sum(0).tolist()
        return {
            "version": p.version if p else 0,
            "workers": [
                {
                    "id": w,
                    "address": self.addresses[w],
                    "node": self.nodes[w],
                    "slots": list(p.worker_slots(i)),
                    "load": worker_load[i] if worker_load else None,
                }
                for i, w in enumerate(p.workers if p else [])
            ],  # fmt: skip
            "slots_per_worker": self.slots,
            "phy2log": p.phy2log.tolist() if p else [],
            "loads": loads.tolist() if loads is not None else None,
            "balancedness": stats.balancedness if stats else None,
            "balancedness_per_layer": stats.layer_balancedness.tolist() if stats else None,
            "migrations": sum(1 for m in self.migrations if m.ok),
            "last_migration": asdict(self.migrations[-1]) if self.migrations else None,
            "last_decision": _decision_info(self.last_decision),
            "attention_workers": list(self.attention),
        }

    async def worker_stats(self) -> dict:
        """Per expert worker: token counts per local slot of the current version (their own counters)."""

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
        for w in list(self.workers):
            await self._stop_worker(w)


def _decision_info(d: Decision | None) -> dict | None:
    if d is None:
        return None
    return {"version": d.placement.version if d.placement else None, "reason": d.reason,
            "balancedness_before": d.balancedness_before, "balancedness_after": d.balancedness_after,
            "moved_slots": d.moved_slots}  # fmt: skip


@ray.remote(num_cpus=0, max_concurrency=100)
class Balancer:
    def __init__(self, cfg: BalancerConfig):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.core = BalancerCore(cfg)
        self._task: asyncio.Task | None = None

    async def start(self) -> dict:
        info = await self.core.start()
        if self.core.cfg.period_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._periodic())
        return info

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.core.cfg.period_s)
            try:
                result = await self.core.rebalance()
                log.info("periodic rebalance: %s", {k: result.get(k) for k in ("migrated", "reason")})
            except Exception:
                log.exception("periodic rebalance failed")

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

    async def shutdown(self) -> None:
        if self._task:
            self._task.cancel()
        await self.core.shutdown()
