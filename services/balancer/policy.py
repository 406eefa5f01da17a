"""What the balancer decides, as pure functions: the EPLB layout of the expert pool, the initial
placement, and whether a re-placement is worth its moves (hysteresis); `MigrationRecord`, what a
re-placement did.

The expert pool is a list of expert workers in slot order, each on a Ray node. EPLB's
"GPUs" are the workers and its "nodes" the Ray nodes: worker w holds slots [w*S, (w+1)*S) and
the hierarchical policy keeps every expert group on one node. That needs the workers grouped
by node with the same count on each node; otherwise the global policy is used (num_nodes = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.dataplane.placement import Placement
from services.model.config import ModelConfig

from .eplb import placement_stats, rebalance_experts, replan


@dataclass(frozen=True)
class Pool:
    """Expert workers in slot order and the node each runs on."""

    workers: tuple[str, ...]
    nodes: tuple[str, ...]

    @classmethod
    def grouped(cls, worker_nodes: dict[str, str]) -> Pool:
        """Order workers so that each node's workers are contiguous (stable within a node)."""
        order = sorted(worker_nodes, key=lambda w: (worker_nodes[w], list(worker_nodes).index(w)))
        return cls(tuple(order), tuple(worker_nodes[w] for w in order))

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def eplb_nodes(self) -> int:
        """Nodes for EPLB: the Ray nodes if every node holds the same number of workers."""
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n] = counts.get(n, 0) + 1
        return len(counts) if len(set(counts.values())) == 1 else 1

    def eplb_args(self, cfg: ModelConfig) -> tuple[int, int]:
        """(num_nodes, num_gpus) for EPLB, dropping to the global policy when the groups do not
        divide over the nodes."""
        nodes = self.eplb_nodes
        if cfg.n_group % nodes:
            nodes = 1
        return nodes, self.num_workers


def slots_per_worker(cfg: ModelConfig, num_workers: int, redundant_experts: int) -> int:
    """Slots each worker holds per MoE layer: room for all experts plus `redundant_experts`
    replicas in total, rounded up to fill every worker equally."""
    total = cfg.n_routed_experts + max(0, redundant_experts)
    return -(-total // num_workers)


def initial_placement(
    cfg: ModelConfig, pool: Pool, slots: int, loads: torch.Tensor | None = None
) -> Placement:
    """Version-1 placement: EPLB over `loads` [num_moe_layers, E] (uniform when None)."""
    weight = loads.double() if loads is not None else torch.ones(cfg.num_moe_layers, cfg.n_routed_experts)
    nodes, gpus = pool.eplb_args(cfg)
    phy2log, _, _ = rebalance_experts(weight, slots * gpus, cfg.n_group, nodes, gpus)
    return Placement(1, phy2log, pool.workers)


def current_in_pool(current: Placement, pool: Pool, slots: int) -> torch.Tensor:
    """The current placement in the slot layout of `pool` with `slots` slots per worker:
    [num_moe_layers, pool.num_workers * slots], -1 for an empty slot.

    Each worker that stays keeps its experts at its new position (its first `slots` local slots
    when it gets fewer than before); a worker new to the pool starts empty. Without this, a new
    worker that sorts before the others (`Pool.grouped` orders workers by node) would shift every
    later worker's slots, and slot-by-slot comparison would see moves that are only renumbering.
    """
    out = torch.full((current.num_moe_layers, pool.num_workers * slots), -1, dtype=torch.long)
    keep = min(slots, current.slots_per_worker)
    for i, worker in enumerate(pool.workers):
        if worker in current.workers:
            j = current.workers.index(worker)
            out[:, i * slots : i * slots + keep] = current.worker_experts(j)[:, :keep]
    return out


@dataclass
class Decision:
    placement: Placement | None  # None: keep the current one
    balancedness_before: float
    balancedness_after: float
    moved_slots: int
    reason: str

    def info(self) -> dict:
        """For status: the new version (None: kept), why, the balancedness and the moves."""
        return {"version": self.placement.version if self.placement else None, "reason": self.reason,
                "balancedness_before": self.balancedness_before, "balancedness_after": self.balancedness_after,
                "moved_slots": self.moved_slots}  # fmt: skip


def decide(
    cfg: ModelConfig,
    current: Placement,
    loads: torch.Tensor,
    pool: Pool,
    slots: int,
    min_gain: float,
    force: bool = False,
) -> Decision:
    """A new placement for `loads` [num_moe_layers, E] over `pool`, if worth it.

    When the pool is unchanged, migrate only if balancedness (mean/max worker load, summed over
    layers) improves by more than `min_gain` (hysteresis against thrashing on noise). A changed
    pool (scaling) always gets a new placement. `replan` keeps as many slots in place as it can,
    comparing against the current placement seen in the new pool's layout (`current_in_pool`), so
    `moved_slots` counts the slots whose worker must load a different expert.
    """
    nodes, gpus = pool.eplb_args(cfg)
    weight = loads.double()
    if not bool(weight.any()):
        weight = torch.ones_like(weight)
    same_pool = current.workers == pool.workers and current.num_slots == slots * gpus
    before = placement_stats(current.phy2log, weight, gpus, nodes).balancedness if same_pool else float("nan")
    plan = replan(current_in_pool(current, pool, slots), weight, slots * gpus, cfg.n_group, nodes, gpus)
    after = plan.stats.balancedness
    moved = int(plan.moves.shape[0])
    if same_pool and not force:
        if moved == 0:
            return Decision(None, before, before, 0, "placement already optimal")
        if after - before <= min_gain:
            return Decision(None, before, after, moved, f"gain {after - before:.4f} <= {min_gain}")
    new = Placement(current.version + 1, plan.phy2log, pool.workers)
    return Decision(new, before, after, moved, "scaled pool" if not same_pool else "balance gain")


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
    peak_extra_bytes: int = 0  # the most any expert worker held beyond its rows while loading
