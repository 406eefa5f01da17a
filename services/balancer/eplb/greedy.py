"""Candidate A: DeepSeek's published greedy, vectorised over layers.

Same float32 arithmetic and tie-breaking as the published ``eplb.py``, so identical placements:
groups packed to nodes, replicas given one by one to the expert with the most tokens per replica,
replicas packed to the GPUs of their node (heaviest first, to the lightest GPU with room). Keeping it
as a candidate is what makes every layer at least as balanced as the published plan.

Numpy, vectorised over rows (layers or layers * nodes): the only Python loops run over items or
steps, each step one array operation for all rows.
"""

from __future__ import annotations

import numpy as np
import torch


def _greedy_packing(w: np.ndarray, num_packs: int, order: np.ndarray, look_ahead: bool = False) -> np.ndarray:
    """The published ``balanced_packing``, vectorised over rows (one step per item, not per row*item).

    Items are taken in ``order`` (heaviest first) and each goes to the lightest pack that still has
    room (the first such pack on ties), pack loads summed in w's dtype in that order. With float32
    ``w``, torch's descending sort as ``order`` and no look-ahead, this makes the reference's
    decisions bit for bit.

    ``look_ahead`` counts each pack's free slots as already holding the mean remaining item: a pack
    that took big items early still has to take as many items as the others, and plain greedy packing
    ignores that (e.g. 1% vs 0.1% over the mean under Zipf(1.5) loads on 24 GPUs).

    Args:
        w: [X, n] item weights
        num_packs: number of packs; n % num_packs == 0
        order: [X, n] item indices by weight, descending

    Returns:
        position: [X, n] slot of each item: pack * (n / num_packs) + rank in pack
    """
    num_rows, n = w.shape
    per_pack = n // num_packs
    if per_pack == 1:  # as the reference: item i -> pack i
        return np.broadcast_to(np.arange(n), (num_rows, n)).copy()
    sorted_w = np.take_along_axis(w, order, 1).T.copy()  # [n, X]: item j of every row is contiguous
    if look_ahead:  # [n, X, 1] mean of the items after item j
        after = sorted_w[::-1].cumsum(0)[::-1] - sorted_w
        mean_after = (after / np.maximum(n - 1 - np.arange(n), 1)[:, None])[:, :, None]
    base = np.arange(num_rows) * num_packs
    load = np.zeros(num_rows * num_packs, dtype=w.dtype)  # inf once a pack is full
    free = np.full(
        num_rows * num_packs, per_pack - 1, dtype=w.dtype if look_ahead else np.int64
    )  # after this item
    load_2d, free_2d = load.reshape(num_rows, num_packs), free.reshape(num_rows, num_packs)
    packs, left = np.empty((n, num_rows), dtype=np.int64), np.empty((n, num_rows), dtype=free.dtype)
    for j in range(n):
        pack = (load_2d + free_2d * mean_after[j] if look_ahead else load_2d).argmin(1)
        flat = pack + base
        f = free[flat]
        packs[j], left[j] = pack, f
        free[flat] = f - 1
        load[flat] += np.where(f == 0, np.inf, sorted_w[j])
    position = packs.T * per_pack + (per_pack - 1 - left.T).astype(np.int64)
    out = np.empty_like(position)
    np.put_along_axis(out, order, position, 1)
    return out


def _torch_order(w: np.ndarray) -> np.ndarray:
    """Descending order of each row exactly as the reference computes it (torch sort of float32)."""
    return torch.from_numpy(w).float().sort(-1, descending=True).indices.numpy()


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Inverse of each row of a [X, n] permutation."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), 1)
    return inv


def _greedy_plan(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """The published greedy hierarchical policy (candidate A), identical placements to the reference.

    Args:
        weight: [L, E] float32 loads
    Returns:
        phy2log: [L, num_replicas] int64 (numpy)
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes

    # Step 1: groups -> nodes. log2mlog: logical expert -> position in node-major order.
    group_w = weight.unflatten(-1, (num_groups, group_size)).sum(-1).numpy()
    group_pos = _greedy_packing(group_w, num_nodes, _torch_order(group_w))
    log2mlog = ((group_pos * group_size)[:, :, None] + np.arange(group_size)).reshape(num_layers, num_experts)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicas within each node: one more replica to the max tokens-per-replica, repeatedly
    # (numpy float32, same arithmetic and first-index tie-breaking as the reference's torch ops).
    w_mlog = np.take_along_axis(weight.numpy(), mlog2log, 1).reshape(-1, experts_per_node)  # [L*N, E/N]
    rows = np.arange(len(w_mlog))
    phy2mlog = np.tile(np.arange(slots_per_node), (len(w_mlog), 1))
    mlogcnt = np.ones(w_mlog.shape, dtype=np.int64)
    for i in range(experts_per_node, slots_per_node):
        hot = (w_mlog / mlogcnt.astype(np.float32)).argmax(1)
        phy2mlog[:, i] = hot
        mlogcnt[rows, hot] += 1

    # Step 3: replicas -> GPUs of the node.
    w_phy = np.take_along_axis(w_mlog / mlogcnt.astype(np.float32), phy2mlog, 1)
    pphy2phy = _inverse(_greedy_packing(w_phy, num_gpus // num_nodes, _torch_order(w_phy)))
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(num_layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * experts_per_node)[:, None]).reshape(num_layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, 1)
