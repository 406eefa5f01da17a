"""Loads and balance of a placement: ``gpu_loads``, ``placement_stats`` (``PlacementStats``) and
``load_lower_bound``, plus the numpy helpers the planners share (``_counts``, ``_slot_loads``,
``_max_gpu``).

The load of a slot is weight[expert] / (replicas of the expert); the load of a GPU is the sum over
its slots. Balancedness is mean / max GPU load (1.0 = perfect).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checks import _as_weight, _check_layout, _check_placement, _is_hierarchical, _old_in_new_layout


@dataclass(frozen=True)
class PlacementStats:
    """Balance of a placement; loads per GPU as in ``gpu_loads``.

    balancedness: mean / max GPU load of the loads summed over layers (1.0 = perfect)
    mean_layer_balancedness / min_layer_balancedness: of the per-layer mean / max GPU load
    layer_balancedness: [L] float64 tensor, per-layer mean / max GPU load
    node_imbalance: max / mean node load of the loads summed over layers (1.0 = perfect)
    mean_layer_node_imbalance: mean over layers of the per-layer max / mean node load
    moved_slots / moved_fraction: slots whose expert differs from ``previous`` (None without one)
    """

    balancedness: float
    mean_layer_balancedness: float
    min_layer_balancedness: float
    layer_balancedness: torch.Tensor
    node_imbalance: float
    mean_layer_node_imbalance: float
    moved_slots: int | None = None
    moved_fraction: float | None = None


def gpu_loads(phy2log: torch.Tensor, weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load of each GPU: the sum over its slots of weight[expert] / (replicas of the expert).

    Args:
        phy2log: [layers, num_replicas]; weight: [layers, logical_experts]; num_gpus divides num_replicas
    Returns:
        [layers, num_gpus] float64
    """
    p, w = _check_placement(phy2log, weight, num_gpus)
    return torch.from_numpy(_slot_loads(p, w).reshape(len(p), num_gpus, -1).sum(-1))


def placement_stats(
    phy2log: torch.Tensor,
    weight: torch.Tensor,
    num_gpus: int,
    num_nodes: int = 1,
    previous_phy2log: torch.Tensor | None = None,
) -> PlacementStats:
    """Balance (per layer and of the sum over layers) and, given ``previous_phy2log``, churn.

    Args:
        phy2log: [layers, num_replicas]; weight: [layers, logical_experts]
        num_gpus, num_nodes: GPU g is on node g // (num_gpus / num_nodes)
        previous_phy2log: [layers, R_old] placement to count moved slots against (slot p vs slot p;
            slots beyond R_old and -1 entries, empty slots, count as moved)
    """
    p, w = _check_placement(phy2log, weight, num_gpus)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int | np.integer) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    gpu = _slot_loads(p, w).reshape(len(p), num_gpus, -1).sum(-1)
    node = gpu.reshape(len(p), num_nodes, -1).sum(-1)
    layer = _ratio(gpu.mean(1), gpu.max(1))
    total_gpu, total_node = gpu.sum(0), node.sum(0)
    moved = fraction = None
    if previous_phy2log is not None:
        old = _old_in_new_layout(previous_phy2log, p.shape)
        moved = int((old != p).sum())
        fraction = moved / p.size
    return PlacementStats(
        balancedness=float(_ratio(total_gpu.mean(), total_gpu.max())),
        mean_layer_balancedness=float(layer.mean()),
        min_layer_balancedness=float(layer.min()),
        layer_balancedness=torch.from_numpy(layer),
        node_imbalance=float(_ratio(total_node.max(), total_node.mean())),
        mean_layer_node_imbalance=float(_ratio(node.max(1), node.mean(1)).mean()),
        moved_slots=moved,
        moved_fraction=fraction,
    )


def load_lower_bound(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """A lower bound, per layer, on the heaviest GPU load of ANY valid placement under the policy that
    ``rebalance_experts`` uses for these arguments (so mean GPU load / bound bounds balancedness).

    The largest of: the mean GPU load; (hierarchical) the lightest possible heaviest node over all
    packings of groups to nodes (G/N each; exact for 1 or 2 groups per node, else the heaviest group
    plus the G/N - 1 lightest others) divided by GPUs per node; and the smallest possible largest
    share of one expert on one GPU: an expert with c replicas puts >= weight / min(c, GPUs per node)
    on some GPU, c <= 1 + redundant slots per node, and at most num_replicas - experts redundant
    replicas in all (water-filling gives the best such allocation).

    Returns:
        [layers] float64
    """
    weight = _as_weight(weight)
    num_layers, num_experts = weight.shape
    _check_layout(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    w = weight.detach().double().cpu().numpy()
    if not _is_hierarchical(num_groups, num_nodes):
        num_groups = num_nodes = 1
    gpus_per_node = num_gpus // num_nodes
    total = w.sum(1)
    bound = total / num_gpus
    if num_nodes > 1:
        per_node = num_groups // num_nodes
        group_w = np.sort(w.reshape(num_layers, num_groups, -1).sum(-1), axis=1)
        if per_node == 1:
            node = group_w[:, -1]
        elif per_node == 2:  # pairing largest with smallest is optimal
            node = (group_w + group_w[:, ::-1]).max(1)
        else:
            node = np.maximum(total / num_nodes, group_w[:, -1] + group_w[:, : per_node - 1].sum(1))
        bound = np.maximum(bound, node / gpus_per_node)
    cap = min(1 + (num_replicas - num_experts) // num_nodes, gpus_per_node)
    cnt = np.ones_like(w)
    rows = np.arange(num_layers)
    for _ in range(num_replicas - num_experts):
        hot = np.where(cnt < cap, w / cnt, -1.0).argmax(1)
        cnt[rows, hot] += cnt[rows, hot] < cap
    bound = np.maximum(bound, (w / cnt).max(1))
    return torch.from_numpy(bound)


def _slot_loads(phy2log: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[L, R] load of each slot: weight of its expert / its number of replicas."""
    num_layers, num_experts = w.shape
    cnt = _counts(phy2log, num_experts)
    return np.take_along_axis(w / np.maximum(cnt, 1), phy2log, 1)


def _counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, R] phy2log -> [L, E] number of replicas per expert."""
    num_layers = phy2log.shape[0]
    flat = (phy2log + (np.arange(num_layers) * num_experts)[:, None]).ravel()
    return np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)


def _max_gpu(phy2log: np.ndarray, w: np.ndarray, num_gpus: int) -> np.ndarray:
    num_layers, num_replicas = phy2log.shape
    return _slot_loads(phy2log, w).reshape(num_layers, num_gpus, -1).sum(-1).max(1)


def _ratio(a, b):
    """a / b, with 0 / 0 = 1 (an all-zero layer is perfectly balanced)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.where(b > 0, a / np.where(b > 0, b, 1.0), 1.0)
