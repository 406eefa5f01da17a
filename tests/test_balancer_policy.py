"""The balancer's pure decisions: pool layout, initial placement, hysteresis, scaling."""

import torch

from services.balancer.policy import Pool, decide, initial_placement, slots_per_worker
from services.model.config import ModelConfig

from .hf_oracle import BASE

CFG = ModelConfig.from_hf({**BASE, "model_type": "deepseek_v3", "n_routed_experts": 16, "n_group": 4, "topk_group": 2})


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
