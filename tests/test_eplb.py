"""Tests for the expert-parallelism load balancer (services/balancer/eplb/).

The baseline is tests/eplb_greedy_reference.py, a port of DeepSeek's published greedy EPLB.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.balancer import eplb
from services.balancer.eplb.greedy import _greedy_plan

from . import eplb_greedy_reference as reference

# The worked example of DeepSeek's EPLB README.
EXAMPLE = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
EXAMPLE_ARGS = (16, 4, 2, 8)  # num_replicas, num_groups, num_nodes, num_gpus
PUBLISHED_PHY2LOG = torch.tensor(
    [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
)
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def lognormal_loads(layers: int, experts: int, seed: int) -> torch.Tensor:
    """Skewed, real-looking token counts: log-normal per expert plus a few hot experts per layer."""
    rng = np.random.default_rng(seed)
    p = np.exp(rng.uniform(0.6, 1.2, (layers, 1)) * rng.standard_normal((layers, experts)))
    hot = rng.integers(0, experts, (layers, 3))
    np.put_along_axis(p, hot, np.take_along_axis(p, hot, 1) * rng.uniform(5, 20, (layers, 3)), 1)
    return torch.from_numpy(np.round(p / p.sum(1, keepdims=True) * 65536))


def drift(weight: torch.Tensor, seed: int, sigma: float = 0.1) -> torch.Tensor:
    """10% load drift: every expert's load times exp(sigma * N(0, 1))."""
    rng = np.random.default_rng(seed)
    return weight * torch.from_numpy(np.exp(sigma * rng.standard_normal(tuple(weight.shape))))


def max_gpu(phy2log: torch.Tensor, weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    return eplb.gpu_loads(phy2log, weight, num_gpus).max(1).values


def check_valid(phy2log, log2phy, logcnt, weight, num_replicas, num_groups, num_nodes, num_gpus):
    """Structural invariants of a placement."""
    layers, experts = weight.shape
    assert phy2log.shape == (layers, num_replicas) and phy2log.dtype == torch.int64
    assert logcnt.shape == (layers, experts) and logcnt.dtype == torch.int64
    assert log2phy.shape == (layers, experts, num_replicas - experts + 1) and log2phy.dtype == torch.int64
    assert phy2log.min() >= 0 and phy2log.max() < experts
    # logcnt = counts, every expert replicated at least once, each GPU exactly its slots (by shape)
    counts = torch.stack([torch.bincount(row, minlength=experts) for row in phy2log])
    assert torch.equal(logcnt, counts)
    assert logcnt.min() >= 1
    # log2phy lists exactly the slots of each expert, ascending, then -1
    for layer in range(layers):
        for e in range(experts):
            slots = torch.nonzero(phy2log[layer] == e).flatten()
            row = log2phy[layer, e]
            assert torch.equal(row[: len(slots)], slots)
            assert (row[len(slots) :] == -1).all()
    if num_groups % num_nodes == 0:  # hierarchical: each group (so each expert) on a single node
        node_of_slot = torch.arange(num_replicas) // (num_replicas // num_nodes)
        group_of_slot = phy2log // (experts // num_groups)
        for layer in range(layers):
            for g in range(num_groups):
                assert len(torch.unique(node_of_slot[group_of_slot[layer] == g])) == 1


# --------------------------------------------------------------------------------------------------
# The worked example
# --------------------------------------------------------------------------------------------------


def test_reference_port_reproduces_published_example():
    phy2log, log2phy, logcnt = reference.rebalance_experts(EXAMPLE, *EXAMPLE_ARGS)
    assert torch.equal(phy2log, PUBLISHED_PHY2LOG)
    loads = eplb.gpu_loads(phy2log, EXAMPLE, 8).sum(0)
    assert loads.max() == 294.5 and loads.min() == 245.5


def test_worked_example_at_least_as_balanced_as_published():
    phy2log, log2phy, logcnt = eplb.rebalance_experts(EXAMPLE, *EXAMPLE_ARGS)
    check_valid(phy2log, log2phy, logcnt, EXAMPLE, *EXAMPLE_ARGS)
    summed = eplb.gpu_loads(phy2log, EXAMPLE, 8).sum(0)  # per GPU, over both layers
    assert summed.max() <= 294.5 and summed.min() >= 245.5
    # and per layer never worse than the published placement
    assert (max_gpu(phy2log, EXAMPLE, 8) <= max_gpu(PUBLISHED_PHY2LOG, EXAMPLE, 8)).all()


# --------------------------------------------------------------------------------------------------
# Properties on random layouts and loads
# --------------------------------------------------------------------------------------------------


@st.composite
def problems(draw, max_layers: int = 3):
    """(weight, num_replicas, num_groups, num_nodes, num_gpus), both policies, ties and zeros likely."""
    num_nodes = draw(st.integers(1, 4))
    num_gpus = num_nodes * draw(st.integers(1, 4))
    if draw(st.booleans()):
        num_groups = num_nodes * draw(st.integers(1, 3))  # hierarchical
    else:
        num_groups = draw(st.integers(1, 6))
    experts = num_groups * draw(st.integers(1, 4))
    per_gpu = -(-experts // num_gpus) + draw(st.integers(0, 3))
    layers = draw(st.integers(1, max_layers))
    if draw(st.booleans()):
        values = st.integers(0, draw(st.sampled_from([3, 1000])))
    else:
        values = st.floats(0, 1e4, allow_nan=False, allow_subnormal=False)
    flat = draw(st.lists(values, min_size=layers * experts, max_size=layers * experts))
    weight = torch.tensor(flat, dtype=torch.float64).view(layers, experts)
    return weight, per_gpu * num_gpus, num_groups, num_nodes, num_gpus


@PROPERTY_SETTINGS
@given(problems())
def test_placement_is_valid_and_never_worse_than_greedy(problem):
    weight, num_replicas, num_groups, num_nodes, num_gpus = problem
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    check_valid(phy2log, log2phy, logcnt, weight, num_replicas, num_groups, num_nodes, num_gpus)
    ours = max_gpu(phy2log, weight, num_gpus)
    greedy = max_gpu(
        reference.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)[0],
        weight,
        num_gpus,
    )
    assert (ours <= greedy * (1 + 1e-9) + 1e-9).all()
    bound = eplb.load_lower_bound(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert (bound <= ours * (1 + 1e-9) + 1e-9).all()  # the bound is sound


@PROPERTY_SETTINGS
@given(problems())
def test_greedy_candidate_is_exactly_the_reference(problem):
    """Candidate A of our planner is the published greedy, vectorised: identical placements."""
    weight, num_replicas, num_groups, num_nodes, num_gpus = problem
    groups, nodes = (num_groups, num_nodes) if num_groups % num_nodes == 0 else (1, 1)
    ours = _greedy_plan(weight.float(), num_replicas, groups, nodes, num_gpus)
    ref = reference.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)[0]
    assert np.array_equal(ours, ref.numpy())


def test_better_than_greedy_under_skew():
    """At a small DeepSeek-like scale under skew the plan is strictly better than the greedy."""
    weight = lognormal_loads(6, 64, seed=3)
    args = (80, 8, 4, 16)
    ours = max_gpu(eplb.rebalance_experts(weight, *args)[0], weight, 16)
    greedy = max_gpu(reference.rebalance_experts(weight, *args)[0], weight, 16)
    assert (ours <= greedy + 1e-9).all() and ours.sum() < 0.99 * greedy.sum()


# --------------------------------------------------------------------------------------------------
# Replanning
# --------------------------------------------------------------------------------------------------


def check_replan(result: eplb.Replan, current, weight, num_replicas, num_groups, num_nodes, num_gpus):
    check_valid(
        result.phy2log, result.log2phy, result.logcnt, weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    scratch = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)[0]
    limit = max_gpu(scratch, weight, num_gpus) * (1 + result.tolerance)
    assert (max_gpu(result.phy2log, weight, num_gpus) <= limit * (1 + 1e-9)).all()
    # the moves turn the current placement into the new one
    old = torch.full_like(result.phy2log, -1)
    n = min(num_replicas, current.shape[1])
    old[:, :n] = current[:, :n]
    layer, slot, before, after = result.moves.T
    assert torch.equal(old[layer, slot], before)
    applied = old.clone()
    applied[layer, slot] = after
    assert torch.equal(applied, result.phy2log)
    assert result.stats.moved_slots == len(result.moves)


@pytest.mark.parametrize("args", [(288, 8, 4, 32), (320, 8, 8, 64), (288, 8, 3, 24)])
def test_replan_after_drift_moves_few_slots(args):
    weight = lognormal_loads(8, 256, seed=5)
    current = eplb.rebalance_experts(weight, *args)[0]
    new_weight = drift(weight, seed=6)
    result = eplb.replan(current, new_weight, *args)
    check_replan(result, current, new_weight, *args)
    assert result.tolerance == eplb.DEFAULT_TOLERANCE
    assert result.stats.moved_fraction <= 0.15
    assert result.scratch_stats.moved_fraction > 0.5  # what the from-scratch plan would churn


def test_replan_without_change_moves_nothing():
    weight = lognormal_loads(4, 64, seed=7)
    current = eplb.rebalance_experts(weight, 80, 8, 4, 16)[0]
    result = eplb.replan(current, weight, 80, 8, 4, 16)
    assert len(result.moves) == 0 and torch.equal(result.phy2log, current)


def test_replan_with_zero_tolerance_matches_scratch_balance():
    weight = lognormal_loads(4, 64, seed=8)
    current = eplb.rebalance_experts(weight, 80, 8, 4, 16)[0]
    new_weight = drift(weight, seed=9)
    result = eplb.replan(current, new_weight, 80, 8, 4, 16, tolerance=0.0)
    check_replan(result, current, new_weight, 80, 8, 4, 16)


@pytest.mark.parametrize(
    "old_args, new_args",
    [
        ((96, 8, 4, 8), (144, 8, 3, 12)),  # 8 -> 12 GPUs, 4 -> 3 nodes (global policy after)
        ((96, 8, 4, 8), (96, 8, 3, 12)),  # same slots over more GPUs
        ((96, 8, 2, 8), (128, 8, 4, 16)),  # hierarchical -> hierarchical, twice the nodes
        ((128, 8, 4, 16), (96, 8, 2, 8)),  # shrink
    ],
)
def test_replan_after_resizing_keeps_many_slots(old_args, new_args):
    weight = lognormal_loads(4, 64, seed=10)
    current = eplb.rebalance_experts(weight, *old_args)[0]
    result = eplb.replan(current, weight, *new_args)
    check_replan(result, current, weight, *new_args)
    common = min(old_args[0], new_args[0])
    kept = (result.phy2log[:, :common] == current[:, :common]).float().mean()
    scratch = eplb.rebalance_experts(weight, *new_args)[0]
    kept_scratch = (scratch[:, :common] == current[:, :common]).float().mean()
    assert kept >= 0.3 and kept > kept_scratch


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_layers=2), st.integers(0, 2**16))
def test_replan_properties(problem, seed):
    weight, num_replicas, num_groups, num_nodes, num_gpus = problem
    current = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)[0]
    new_weight = drift(weight, seed, sigma=0.3)
    result = eplb.replan(current, new_weight, num_replicas, num_groups, num_nodes, num_gpus)
    check_replan(result, current, new_weight, num_replicas, num_groups, num_nodes, num_gpus)


# --------------------------------------------------------------------------------------------------
# Metrics and errors
# --------------------------------------------------------------------------------------------------


def test_gpu_loads_and_stats():
    phy2log = torch.tensor([[0, 1, 1, 2]])  # expert 1 has two replicas
    weight = torch.tensor([[4.0, 6.0, 2.0]])
    assert torch.equal(eplb.gpu_loads(phy2log, weight, 2), torch.tensor([[7.0, 5.0]], dtype=torch.float64))
    stats = eplb.placement_stats(
        phy2log, weight, num_gpus=2, num_nodes=2, previous_phy2log=torch.tensor([[0, 1, 2]])
    )
    assert stats.balancedness == pytest.approx(6 / 7) and stats.mean_layer_balancedness == pytest.approx(
        6 / 7
    )
    assert stats.node_imbalance == pytest.approx(7 / 6)
    assert stats.moved_slots == 2 and stats.moved_fraction == 0.5  # slot 2 changed, slot 3 is new


@pytest.mark.parametrize(
    "weight, args, message",
    [
        (torch.ones(12), (16, 4, 2, 8), "2-D"),
        (-EXAMPLE, (16, 4, 2, 8), "non-negative"),
        (EXAMPLE.float().fill_(float("nan")), (16, 4, 2, 8), "finite"),
        (EXAMPLE, (16, 4, 2, 6), r"num_replicas \(16\) must be a multiple of num_gpus \(6\)"),
        (EXAMPLE, (16, 4, 3, 8), r"num_gpus \(8\) must be a multiple of num_nodes \(3\)"),
        (EXAMPLE, (8, 4, 2, 8), "every expert needs at least one replica"),
        (EXAMPLE, (16, 5, 2, 8), r"must be a multiple of num_groups \(5\)"),
        (EXAMPLE, (16, 4, 0, 8), "num_nodes must be >= 1"),
        (EXAMPLE, (16.0, 4, 2, 8), "num_replicas must be an int"),
    ],
)
def test_errors_name_the_failed_constraint(weight, args, message):
    with pytest.raises(ValueError, match=message):
        eplb.rebalance_experts(weight, *args)


def test_replan_errors():
    current = eplb.rebalance_experts(EXAMPLE, *EXAMPLE_ARGS)[0]
    with pytest.raises(ValueError, match="layers"):
        eplb.replan(current[:1], EXAMPLE, *EXAMPLE_ARGS)
    with pytest.raises(ValueError, match="outside"):
        eplb.replan(current + 12, EXAMPLE, *EXAMPLE_ARGS)
    with pytest.raises(ValueError, match="tolerance"):
        eplb.replan(current, EXAMPLE, *EXAMPLE_ARGS, tolerance=-0.1)
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        eplb.gpu_loads(current, EXAMPLE, 3)


# --------------------------------------------------------------------------------------------------
# Empty slots (-1) in the current placement: workers joining the pool
# --------------------------------------------------------------------------------------------------


def test_replan_fills_empty_slots_and_keeps_the_rest():
    """Two workers on two nodes grow to four on four nodes; the new workers come first in the slot
    order, so the survivors' experts sit at new positions and the new workers' slots are -1."""
    weight = torch.ones(3, 16)
    current = eplb.rebalance_experts(weight, 16, 4, 2, 2)[0]  # 2 workers x 8 slots
    old = torch.full((3, 16), -1, dtype=torch.long)
    old[:, 8:12], old[:, 12:16] = current[:, 0:4], current[:, 8:12]  # survivors keep 4 of 8 each
    result = eplb.replan(old, weight, 16, 4, 4, 4)
    check_replan(result, old, weight, 16, 4, 4, 4)
    assert (result.phy2log[:, 8:] == old[:, 8:]).all()  # the survivors keep everything they can
    assert len(result.moves) == 3 * 8 and (result.moves[:, 2] == -1).all()  # only empty slots filled
    assert result.stats.moved_slots == 3 * 8


def test_replan_never_counts_an_empty_slot_as_kept():
    weight = lognormal_loads(2, 64, seed=11)
    current = eplb.rebalance_experts(weight, 80, 8, 4, 16)[0]
    holes = current.clone()
    holes[:, ::3] = -1  # every third slot lost its expert
    result = eplb.replan(holes, weight, 80, 8, 4, 16)
    check_replan(result, holes, weight, 80, 8, 4, 16)
    filled = result.phy2log[:, ::3]
    assert (filled >= 0).all() and len(result.moves) >= filled.numel()
    everything_empty = eplb.replan(torch.full_like(current, -1), weight, 80, 8, 4, 16)
    check_replan(everything_empty, torch.full_like(current, -1), weight, 80, 8, 4, 16)
    assert everything_empty.stats.moved_slots == current.numel()


def test_replan_rejects_ids_below_minus_one():
    current = eplb.rebalance_experts(EXAMPLE, *EXAMPLE_ARGS)[0]
    with pytest.raises(ValueError, match="outside"):
        eplb.replan(current - 2, EXAMPLE, *EXAMPLE_ARGS)
