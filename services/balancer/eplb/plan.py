"""The from-scratch plan: ``rebalance_experts``.

Per layer it builds candidate A (``greedy``, the published greedy) and candidate B (``improve``) and
keeps the one whose heaviest GPU is lighter (``_plan``). Finally nodes and GPUs are relabelled per
layer (``_spread_labels``; this changes no layer's loads) so that heavy GPUs of successive layers
land on different devices, which balances the loads summed over layers.
"""

from __future__ import annotations

import numpy as np
import torch

from .checks import _as_weight, _check_layout, _is_hierarchical
from .greedy import _greedy_plan, _inverse
from .improve import _improved_plan
from .stats import _counts, _max_gpu, _slot_loads


def _serpentine(rank: np.ndarray, n: int, layer: np.ndarray) -> np.ndarray:
    """Position for the item of load rank ``rank`` (0 = heaviest) among n, in layer ``layer``:
    reversed on odd layers and shifted every two layers, so heavy items of successive layers land on
    different positions."""
    flipped = np.where(layer % 2 == 0, rank, n - 1 - rank)
    return (flipped + layer // 2) % n


def _spread_labels(phy2log: np.ndarray, w: np.ndarray, num_nodes: int, num_gpus: int, hierarchical: bool):
    """Relabel nodes and GPUs per layer (no layer's balance changes) so the sum over layers is balanced.

    Hierarchical: nodes, and GPUs within each node, are placed by ``_serpentine`` of their load rank.
    Global: GPUs are dealt to nodes in snake order of load (balances node loads), then as above.
    """
    num_layers, num_replicas = phy2log.shape
    per_gpu = num_replicas // num_gpus
    gpus_per_node = num_gpus // num_nodes
    layer = np.arange(num_layers)[:, None]
    gpu = _slot_loads(phy2log, w).reshape(num_layers, num_gpus, per_gpu).sum(-1)
    if hierarchical:
        node_load = gpu.reshape(num_layers, num_nodes, gpus_per_node).sum(-1)
        node_pos = _serpentine(_inverse(np.argsort(-node_load, 1, kind="stable")), num_nodes, layer)
        in_node = gpu.reshape(num_layers * num_nodes, gpus_per_node)
        gpu_rank = _inverse(np.argsort(-in_node, 1, kind="stable")).reshape(num_layers, num_nodes, -1)
        gpu_pos = _serpentine(gpu_rank, gpus_per_node, layer[:, :, None])
        new_gpu = (node_pos[:, :, None] * gpus_per_node + gpu_pos).reshape(num_layers, num_gpus)
    else:
        rank = _inverse(np.argsort(-gpu, 1, kind="stable"))
        tier, i = rank // num_nodes, rank % num_nodes
        node = np.where(tier % 2 == 0, i, num_nodes - 1 - i)
        node = (node + layer) % num_nodes
        new_gpu = node * gpus_per_node + _serpentine(tier, gpus_per_node, layer)
    new_slot = (new_gpu[:, :, None] * per_gpu + np.arange(per_gpu)).reshape(num_layers, num_replicas)
    out = np.empty_like(phy2log)
    np.put_along_axis(out, new_slot, phy2log, 1)
    return out


def _log2phy(phy2log: np.ndarray, num_experts: int, width: int) -> np.ndarray:
    """[L, R] -> [L, E, width] slots of each expert (ascending), padded with -1."""
    num_layers, num_replicas = phy2log.shape
    order = np.argsort(phy2log, axis=1, kind="stable")  # slots grouped by expert, ascending
    experts = np.take_along_axis(phy2log, order, 1)
    cnt = _counts(phy2log, num_experts)
    start = np.cumsum(cnt, 1) - cnt
    rank = np.arange(num_replicas) - np.take_along_axis(start, experts, 1)
    out = np.full((num_layers, num_experts, width), -1, dtype=np.int64)
    out[np.arange(num_layers)[:, None], experts, rank] = order
    return out


def _plan(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """From-scratch placement [L, R] (numpy) for loads ``weight`` [L, E]; see the module docstring.

    Candidate A (the published greedy) runs on float32 loads like the reference; everything else,
    including the choice between the candidates, uses float64.
    """
    hierarchical = _is_hierarchical(num_groups, num_nodes)
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    w = weight.double().numpy()
    greedy = _greedy_plan(weight.float(), num_replicas, groups, nodes, num_gpus)
    improved = _improved_plan(w, num_replicas, groups, nodes, num_gpus)
    better = _max_gpu(improved, w, num_gpus) <= _max_gpu(greedy, w, num_gpus)
    best = np.where(better[:, None], improved, greedy)
    return _spread_labels(best, w, num_nodes, num_gpus, hierarchical)


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical experts (replicas of the logical experts) on ``num_gpus`` GPUs.

    Hierarchical policy when ``num_groups % num_nodes == 0``: each expert group goes to one node
    (all replicas of its experts stay on that node), replicas are made within the node and packed to
    its GPUs. Otherwise the global policy: replicas over all experts, packed to all GPUs.

    Args:
        weight: [layers, logical_experts] load of each expert (e.g. tokens), non-negative
        num_replicas: number of physical experts, a multiple of num_gpus and >= logical_experts
        num_groups: number of expert groups, dividing logical_experts
        num_nodes: number of server nodes, dividing num_gpus
        num_gpus: number of GPUs

    Returns:
        phy2log: [layers, num_replicas] int64, the logical expert of each physical slot
        log2phy: [layers, logical_experts, num_replicas - logical_experts + 1] int64, the physical
            slots of each logical expert (ascending), padded with -1
        logcnt: [layers, logical_experts] int64, number of replicas of each logical expert

    Raises:
        ValueError: naming the violated constraint (shape, sign, divisibility, too few replicas).
    """
    weight = _as_weight(weight)
    num_layers, num_experts = weight.shape
    _check_layout(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log = _plan(weight.detach().cpu(), num_replicas, num_groups, num_nodes, num_gpus)
    logcnt = _counts(phy2log, num_experts)
    log2phy = _log2phy(phy2log, num_experts, num_replicas - num_experts + 1)
    return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
