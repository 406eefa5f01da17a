"""The balancer's status (`moe-cluster status`, `/v1/experts`, the dashboard): the placement,
each expert worker's state and load, heals, migrations, the attention workers and the deadlines
its health checks use now."""

from __future__ import annotations

import time
from dataclasses import asdict

from .eplb import gpu_loads, placement_stats


def balancer_status(core) -> dict:
    """`core`: the BalancerCore (service.py) whose state is reported."""
    p = core.placement
    loads = core.last_loads
    stats = worker_load = None
    if p is not None and loads is not None and bool(loads.any()) and set(p.workers) <= set(core.pool.members):
        nodes, gpus = core.eplb_pool(list(p.workers)).eplb_args(core.model_cfg)
        stats = placement_stats(p.phy2log, loads.double(), gpus, nodes)
        worker_load = gpu_loads(p.phy2log, loads.double(), gpus).sum(0).tolist()
    serving = set(p.workers) if p else set()
    return {
        "version": p.version if p else 0,
        "workers": [
            {
                "id": w,
                "state": "serving" if w in core.pool.members else "dead",
                "address": core.addresses.get(w, "-"),
                "node": core.pool.nodes.get(w, "-"),
                "slots": list(p.worker_slots(i)),
                "load": worker_load[i] if worker_load else None,
            }
            for i, w in enumerate(p.workers if p else [])
        ]
        + [
            {
                "id": w,
                "state": "joining",
                "address": core.addresses[w],
                "node": core.pool.nodes[w],
                "slots": [],
                "load": None,
            }
            for w in core.pool.workers
            if w not in serving
        ],  # fmt: skip
        "target_workers": core.target_workers,
        "pending_workers": {w: round(time.time() - t, 1) for w, t in core.pool.pending.items()},
        "requested": {"workers": core.pool.requested_workers, "bundle": core.pool.bundle},
        "dead_workers": [asdict(d) for d in core.pool.dead],
        "heals": core.heals,
        "resumed": core.resumed,
        "slots_per_worker": core.slots,
        "phy2log": p.phy2log.tolist() if p else [],
        "loads": loads.tolist() if loads is not None else None,
        "balancedness": stats.balancedness if stats else None,
        "balancedness_per_layer": stats.layer_balancedness.tolist() if stats else None,
        "migrations": sum(1 for m in core.migrations if m.ok),
        "last_migration": asdict(core.migrations[-1]) if core.migrations else None,
        "recent_migrations": [asdict(m) for m in core.migrations[-8:]],
        "last_decision": core.last_decision.info() if core.last_decision else None,
        "attention_workers": list(core.attention),
        "attention": {n: core.attention_state.get(n, {}) for n in core.attention},
        "attention_fenced": core.fence.history[-10:],
        "deadlines": {
            "expert_health_s": round(core.pool.health_deadlines.timeout_s(1), 3),
            "attention_ping_s": round(core.fence.pings.timeout_s(1), 3),
        },  # fmt: skip
    }
