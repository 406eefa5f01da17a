"""The balancer's pure decisions: pool layout, initial placement, hysteresis, scaling."""

import torch

from services.balancer.policy import Pool, decide, initial_placement, slots_per_worker
from services.model.config import ModelConfig

from .hf_oracle import BASE

CFG = ModelConfig.from_hf(
    {**BASE, "model_type": "deepseek_v3", "n_routed_experts": 16, "n_group": 4, "topk_group": 2}
)


def test_pool_groups_workers_by_node_and_picks_eplb_nodes():
    pool = Pool.grouped({"a": "n2", "b": "n1", "c": "n2", "d": "n1"})
    assert pool.workers == ("b", "d", "a", "c") and pool.eplb_nodes == 2
    assert pool.eplb_args(CFG) == (2, 4)
    uneven = Pool.grouped({"a": "n1", "b": "n1", "c": "n2"})
    assert uneven.eplb_nodes == 1  # unequal workers per node: global policy
    three = Pool.grouped({"a": "x", "b": "y", "c": "z"})
    assert three.eplb_args(CFG) == (1, 3)  # 4 groups do not divide over 3 nodes


def test_slots_cover_all_experts_plus_redundancy():
    assert slots_per_worker(CFG, 2, 0) == 8
    assert slots_per_worker(CFG, 3, 2) == 6  # 18 slots, rounded up to 3 x 6
    p = initial_placement(CFG, Pool(("a", "b"), ("n", "n")), 10)
    assert p.version == 1 and p.phy2log.shape == (CFG.num_moe_layers, 20)
    assert p.replicas(16)[1].min() >= 1


def test_decide_migrates_only_for_a_real_gain():
    pool = Pool(("a", "b"), ("n", "n"))
    current = initial_placement(CFG, pool, 10)
    uniform = torch.full((CFG.num_moe_layers, 16), 100)
    keep = decide(CFG, current, uniform, pool, 10, min_gain=0.02)
    assert keep.placement is None
    skewed = uniform.clone()
    for layer in range(CFG.num_moe_layers):  # the experts of worker a's first slots turn hot
        skewed[layer, current.phy2log[layer, :3]] = 3000
    move = decide(CFG, current, skewed, pool, 10, min_gain=0.02)
    assert move.placement is not None and move.placement.version == 2
    assert move.balancedness_after > move.balancedness_before + 0.02
    assert 0 < move.moved_slots < 20


def test_decide_always_replans_a_resized_pool():
    pool = Pool(("a", "b"), ("n", "n"))
    current = initial_placement(CFG, pool, 8)
    grown = Pool(("a", "b", "c"), ("n", "n", "n"))
    d = decide(CFG, current, torch.ones(CFG.num_moe_layers, 16), grown, 8, min_gain=0.5)
    assert d.placement is not None and d.placement.workers == grown.workers and d.placement.num_slots == 24
    assert d.placement.replicas(16)[1].min() >= 1


def _changed_slots(old, new) -> int:
    """(worker, local slot) pairs whose expert differs between two placements, by worker id; every
    slot of a worker new to the pool counts as changed."""
    changed = 0
    for i, worker in enumerate(new.workers):
        now = new.worker_experts(i)
        if worker not in old.workers:
            changed += now.numel()
            continue
        before = old.worker_experts(old.workers.index(worker))
        k = min(before.shape[1], now.shape[1])
        changed += int((now[:, :k] != before[:, :k]).sum()) + now[:, k:].numel()
    return changed


def test_growing_on_a_node_that_sorts_first_is_not_renumbering():
    """Workers on nodes n3, n4 grow by two on n1, n2: Pool.grouped puts the new ones first. The
    survivors keep their experts at their new positions; only the new workers' slots are loaded."""
    pool = Pool.grouped({"a": "n3", "b": "n4"})
    current = initial_placement(CFG, pool, 8)  # hierarchical: 2 groups per node
    grown = Pool.grouped({"a": "n3", "b": "n4", "c": "n1", "d": "n2"})
    assert grown.workers == ("c", "d", "a", "b") and grown.eplb_args(CFG) == (4, 4)
    d = decide(CFG, current, torch.ones(CFG.num_moe_layers, 16), grown, 4, min_gain=0.0)
    new = d.placement
    assert d.moved_slots == _changed_slots(current, new) == CFG.num_moe_layers * 8  # c's and d's slots
    for w in ("a", "b"):  # each survivor keeps one of its two groups, in place
        i, j = new.workers.index(w), current.workers.index(w)
        assert torch.equal(new.worker_experts(i), current.worker_experts(j)[:, :4])
    node_of_slot = torch.arange(16) // 4  # 4 nodes, one worker each
    for layer in range(CFG.num_moe_layers):  # hierarchical: every group on one node
        for g in range(4):
            assert len(node_of_slot[new.phy2log[layer] // 4 == g].unique()) == 1


def test_shrinking_keeps_the_survivors_experts():
    pool = Pool.grouped({"a": "n1", "b": "n2", "c": "n3"})
    current = initial_placement(CFG, pool, 6)
    smaller = Pool.grouped({"b": "n2", "c": "n3"})
    d = decide(CFG, current, torch.ones(CFG.num_moe_layers, 16), smaller, 8, min_gain=0.0)
    assert d.placement.workers == ("b", "c") and d.placement.replicas(16)[1].min() >= 1
    assert d.moved_slots == _changed_slots(current, d.placement)
    assert d.moved_slots <= CFG.num_moe_layers * (2 * 2 + 6)  # a's 6 experts + room, at most
