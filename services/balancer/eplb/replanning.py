"""Incremental re-plan: ``replan`` moves from a current placement to one for new loads (or a resized
cluster), keeping most slots in place; see its docstring.

Candidates: incremental plans (groups kept on their nodes, replica counts kept or chosen anew, current
slots kept where the counts allow, then swaps) and the from-scratch plan relabelled to keep as many
slots as possible (``_relabel_like``). Per layer the one moving the fewest slots within
``tolerance`` of the from-scratch plan's heaviest GPU wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .checks import _as_weight, _check_current, _check_layout, _is_hierarchical, _old_in_new_layout
from .greedy import _inverse
from .improve import _expand, _refine_swaps, _replicate, _spread_big_replicas
from .plan import _log2phy, _plan
from .stats import PlacementStats, _counts, _max_gpu, placement_stats


@dataclass(frozen=True)
class Replan:
    """Result of ``replan``.

    phy2log, log2phy, logcnt: the new placement (as ``rebalance_experts``)
    moves: [M, 4] int64 rows (layer, slot, old logical expert or -1, new logical expert), one per
        slot whose expert changes
    stats: PlacementStats of the new placement (moved_* vs the current placement)
    scratch_stats: PlacementStats of the from-scratch plan as ``rebalance_experts`` returns it
        (moved_*: what adopting it unchanged would move)
    fallback_layers: [L] bool tensor, layers that took the from-scratch plan (relabelled) because
        the incremental plans were not within tolerance of it or moved more
    tolerance: the X used: each layer's heaviest GPU <= (1 + X) * the from-scratch plan's
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    moves: torch.Tensor
    stats: PlacementStats
    scratch_stats: PlacementStats
    fallback_layers: torch.Tensor
    tolerance: float


DEFAULT_TOLERANCE = 0.02
"""Default X of ``replan``: per layer, the heaviest GPU may exceed the from-scratch plan's by 2%."""


def replan(
    current_phy2log: torch.Tensor,
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Replan:
    """A placement for new loads (or a resized cluster) that keeps most slots of the current one.

    Slot p of the new layout is compared with slot p of the current one (slots beyond the current
    num_replicas start empty). A current entry of -1 is an empty slot (e.g. on a worker that joins
    the pool): it must be filled and never counts as kept. Per layer, the plan with the fewest moved slots among these whose
    heaviest GPU is within ``tolerance`` of the from-scratch plan's (``rebalance_experts``) is taken:

    - incremental: groups stay on the node holding most of their slots (hierarchical policy),
      replica counts stay as they are ("sticky") or are chosen anew, current slots are kept where
      the counts allow, missing replicas fill the freed slots (heaviest to the lightest GPU), then
      swaps between the heaviest GPU and others until within tolerance;
    - the same with the groups on the from-scratch plan's nodes and its replica counts;
    - the from-scratch plan itself, relabelled (nodes, GPUs within nodes, slots within GPUs
      permuted; this changes no load) to keep as many slots as possible. Always within tolerance.

    Args:
        current_phy2log: [layers, R_old] current placement (any R_old, e.g. before resizing);
            -1 marks an empty slot
        weight: [layers, logical_experts] new loads
        num_replicas, num_groups, num_nodes, num_gpus: the new layout, as for ``rebalance_experts``
        tolerance: X >= 0; each layer's heaviest GPU stays <= (1 + X) * the from-scratch plan's

    Returns:
        Replan
    """
    weight = _as_weight(weight)
    num_layers, num_experts = weight.shape
    _check_layout(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    current = _check_current(current_phy2log, num_layers, num_experts)

    w = weight.detach().cpu().double().numpy()
    hierarchical = _is_hierarchical(num_groups, num_nodes)
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    scratch = _plan(weight.detach().cpu(), num_replicas, num_groups, num_nodes, num_gpus)
    limit = _max_gpu(scratch, w, num_gpus) * (1 + tolerance)
    old = _old_in_new_layout(current, scratch.shape)

    relabelled = _relabel_like(scratch, old, nodes, num_gpus, num_experts)
    scratch_groups = _group_nodes_of(relabelled, num_experts, groups, nodes)
    if nodes > 1:
        kept_groups = _overlap_group_nodes(old, num_experts, groups, nodes)
    else:
        kept_groups = scratch_groups
    args = (limit, groups, nodes, num_gpus)
    candidates = [
        _incremental(old, w, kept_groups, "sticky", *args),
        _incremental(old, w, kept_groups, "fresh", *args),
        _incremental(old, w, scratch_groups, _counts(scratch, num_experts), *args),
    ]
    candidates = [_align_slots(c, old, num_replicas // num_gpus) for c in candidates] + [relabelled]
    moved = np.stack([(c != old).sum(1) for c in candidates])  # [C, L]
    fits = np.stack([_max_gpu(c, w, num_gpus) <= limit * (1 + 1e-9) for c in candidates])
    fits[-1] = True  # same loads as the from-scratch plan, up to rounding
    choice = np.where(fits, moved, np.iinfo(np.int64).max).argmin(0)
    phy2log = np.stack(candidates)[choice, np.arange(num_layers)]

    layer, slot = np.nonzero(phy2log != old)
    moves = np.stack([layer, slot, old[layer, slot], phy2log[layer, slot]], 1)
    new_t = torch.from_numpy(phy2log)
    return Replan(
        phy2log=new_t,
        log2phy=torch.from_numpy(_log2phy(phy2log, num_experts, num_replicas - num_experts + 1)),
        logcnt=torch.from_numpy(_counts(phy2log, num_experts)),
        moves=torch.from_numpy(moves.astype(np.int64)),
        stats=placement_stats(new_t, weight, num_gpus, num_nodes, torch.from_numpy(current)),
        scratch_stats=placement_stats(
            torch.from_numpy(scratch), weight, num_gpus, num_nodes, torch.from_numpy(current)
        ),
        fallback_layers=torch.from_numpy(choice == len(candidates) - 1),
        tolerance=float(tolerance),
    )


def _greedy_match(score: np.ndarray) -> np.ndarray:
    """Greedy maximum-score matching per row: repeatedly pair the (a, b) with the highest score.

    Args:
        score: [X, n, n] score of putting item a at position b
    Returns:
        dest: [X, n] position of each item (a permutation per row)
    """
    num_rows, n, _ = score.shape
    rows = np.arange(num_rows)
    score = score.astype(np.float64).copy()
    dest = np.empty((num_rows, n), dtype=np.int64)
    for _ in range(n):
        best = score.reshape(num_rows, -1).argmax(1)
        a, b = best // n, best % n
        dest[rows, a] = b
        score[rows, a, :] = -1.0
        score[rows, :, b] = -1.0
    return dest


def _histogram(phy2log: np.ndarray, num_bins: int, num_experts: int) -> np.ndarray:
    """[L, R] placement -> [L, num_bins, E] replicas of each expert in each contiguous bin of slots
    (bins: GPUs or nodes). Entries of -1 (empty slots) are not counted."""
    num_layers, num_replicas = phy2log.shape
    bins = np.broadcast_to(np.arange(num_replicas) // (num_replicas // num_bins), phy2log.shape)
    index = (np.arange(num_layers)[:, None] * num_bins + bins) * (num_experts + 1) + phy2log + 1
    hist = np.bincount(index.ravel(), minlength=num_layers * num_bins * (num_experts + 1))
    return hist.reshape(num_layers, num_bins, num_experts + 1)[:, :, 1:]


def _move_bins(phy2log: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """Move contiguous bins of slots: bin i of each layer goes to position dest[layer, i]."""
    num_layers, num_replicas = phy2log.shape
    per_bin = num_replicas // dest.shape[1]
    slot = (dest[:, :, None] * per_bin + np.arange(per_bin)).reshape(num_layers, num_replicas)
    out = np.empty_like(phy2log)
    np.put_along_axis(out, slot, phy2log, 1)
    return out


def _align_slots(new: np.ndarray, old: np.ndarray, per_gpu: int) -> np.ndarray:
    """Reorder the slots within each GPU so that as many slots as possible keep their old expert.

    Args:
        new, old: [L, R] placements (old may hold -1)
    Returns:
        [L, R] ``new`` with each GPU's slots permuted
    """
    shape = new.shape
    new, old = new.reshape(-1, per_gpu), old.reshape(-1, per_gpu)
    rows = np.arange(len(new))
    out = np.full_like(new, -1)
    used = np.zeros(new.shape, dtype=bool)
    for j in range(per_gpu):  # slot j keeps its old expert if the GPU still has a replica of it
        match = (new == old[:, j : j + 1]) & ~used
        found = match.any(1)
        i = match.argmax(1)
        out[rows[found], j] = new[rows[found], i[found]]
        used[rows[found], i[found]] = True
    # the remaining replicas fill the remaining slots, in order
    free_slots = np.argsort(out >= 0, axis=1, kind="stable")
    left_items = np.argsort(used, axis=1, kind="stable")
    fill = np.arange(per_gpu) < (~used).sum(1, keepdims=True)
    r = np.broadcast_to(rows[:, None], fill.shape)
    out[r[fill], free_slots[fill]] = new[r[fill], left_items[fill]]
    return out.reshape(shape)


def _relabel_like(new: np.ndarray, old: np.ndarray, num_nodes: int, num_gpus: int, num_experts: int):
    """Permute nodes, GPUs within nodes and slots within GPUs of ``new`` (no layer's loads change) to
    keep as many slots of ``old`` as possible. num_nodes == 1 for the global policy (any GPU order).

    Args:
        new: [L, R] placement; old: [L, R] previous placement (-1: no previous expert)
    Returns:
        [L, R] relabelled ``new``
    """
    num_layers, num_replicas = new.shape
    gpus_per_node = num_gpus // num_nodes
    if num_nodes > 1:  # nodes: most replicas in common
        overlap = _histogram(new, num_nodes, num_experts) @ _histogram(old, num_nodes, num_experts).transpose(
            0, 2, 1
        )
        new = _move_bins(new, _greedy_match(overlap))
    # GPUs within each node
    h_new = _histogram(new, num_gpus, num_experts).reshape(num_layers * num_nodes, gpus_per_node, -1)
    h_old = _histogram(old, num_gpus, num_experts).reshape(num_layers * num_nodes, gpus_per_node, -1)
    dest = _greedy_match(h_new @ h_old.transpose(0, 2, 1))  # = replicas in common unless duplicated
    dest = dest.reshape(num_layers, num_nodes, -1) + (np.arange(num_nodes) * gpus_per_node)[:, None]
    new = _move_bins(new, dest.reshape(num_layers, num_gpus))
    return _align_slots(new, old, num_replicas // num_gpus)


def _overlap_group_nodes(old: np.ndarray, num_experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """Node for each expert group (G/N groups per node) keeping most of the group's current slots.

    Args:
        old: [L, R] current placement in the new slot layout (-1: no expert)
    Returns:
        group_node: [L, G]
    """
    num_layers, num_replicas = old.shape
    per_node = num_groups // num_nodes
    group_of = np.where(old >= 0, old // (num_experts // num_groups), -1)
    hist = _histogram(group_of, num_nodes, num_groups).transpose(0, 2, 1).astype(np.float64)  # [L, G, N]
    rows = np.arange(num_layers)
    group_node = np.empty((num_layers, num_groups), dtype=np.int64)
    room = np.full((num_layers, num_nodes), per_node)
    for _ in range(num_groups):
        best = hist.reshape(num_layers, -1).argmax(1)
        g, n = best // num_nodes, best % num_nodes
        group_node[rows, g] = n
        hist[rows, g, :] = -1.0
        room[rows, n] -= 1
        hist[rows[room[rows, n] == 0], :, n[room[rows, n] == 0]] = -1.0
    return group_node


def _sticky_counts(have: np.ndarray, w: np.ndarray, total: int, cap: int) -> np.ndarray:
    """Replica counts close to the current ones: ``have`` (at least 1), then made to sum to ``total``
    by taking replicas from the experts with the fewest tokens per remaining replica or giving them to
    the experts with the most tokens per replica.

    Args:
        have: [X, m] replicas an expert has now in the row; w: [X, m] loads
    Returns:
        cnt: [X, m], rows sum to total
    """
    rows = np.arange(len(w))
    cnt = np.maximum(have, 1)
    for _ in range(int(np.abs(cnt.sum(1) - total).max())):
        diff = total - cnt.sum(1)
        gain = np.where(cnt < cap, w / cnt, -1.0).argmax(1)
        lose = np.where(cnt > 1, w / np.maximum(cnt - 1, 1), np.inf).argmin(1)
        cnt[rows[diff > 0], gain[diff > 0]] += 1
        cnt[rows[diff < 0], lose[diff < 0]] -= 1
    return cnt


def _keep_and_fill(ids: np.ndarray, w: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """Turn the current slots of a node into a placement with replica counts ``cnt``, moving few.

    Experts with more replicas than ``cnt`` free the surplus ones on their heaviest GPUs; then the
    missing replicas, heaviest first, go to free slots on the lightest GPUs that have one.

    Args:
        ids: [X, P, k] expert (index into the row) in each slot, -1 for a free slot
        w: [X, m] expert loads; cnt: [X, m] wanted replica counts (rows sum to P * k)
    Returns:
        [X, P, k] filled copy of ids
    """
    num_rows, num_packs, per_pack = ids.shape
    m = w.shape[1]
    rows = np.arange(num_rows)[:, None]
    flat = ids.reshape(num_rows, -1).copy()
    size = w / cnt  # load of one replica
    have = _counts(np.where(flat >= 0, flat, m), m + 1)[:, :m]
    surplus = np.maximum(have - cnt, 0)
    if surplus.any():
        slot_w = np.where(flat >= 0, size[rows, np.maximum(flat, 0)], 0.0)
        gpu_rank = _inverse(
            np.argsort(-slot_w.reshape(num_rows, num_packs, -1).sum(-1), axis=1, kind="stable")
        )
        key = np.where(flat >= 0, flat * num_packs + np.repeat(gpu_rank, per_pack, axis=1), -1)
        order = np.argsort(key, axis=1, kind="stable")  # slots by expert, heaviest GPU first
        experts = np.take_along_axis(flat, order, 1)
        pos = np.arange(flat.shape[1])
        start = np.maximum.accumulate(np.where(np.diff(experts, prepend=-2) != 0, pos, 0), axis=1)
        drop = (experts >= 0) & (pos - start < surplus[rows, np.maximum(experts, 0)])
        flat[np.broadcast_to(rows, drop.shape)[drop], order[drop]] = -1
    missing = cnt - np.minimum(have, cnt)
    num_free = (flat < 0).sum(1)
    if num_free.max() > 0:
        pad = num_free.max() - num_free  # padding entries (expert m) are never placed
        items = _expand(np.concatenate([missing, pad[:, None]], 1))
        item_w = np.where(items < m, np.take_along_axis(np.pad(size, ((0, 0), (0, 1))), items, 1), -1.0)
        order = np.argsort(-item_w, axis=1, kind="stable")
        items, item_w = np.take_along_axis(items, order, 1), np.take_along_axis(item_w, order, 1)
        slots = flat.reshape(num_rows, num_packs, per_pack)
        gpu_load = np.where(slots >= 0, size[rows[:, :, None], np.maximum(slots, 0)], 0.0).sum(-1)
        free = (slots < 0).sum(-1)
        r = rows[:, 0]
        for t in range(items.shape[1]):
            real = items[:, t] < m
            g = np.where(free > 0, gpu_load, np.inf).argmin(1)
            j = (slots[r, g] < 0).argmax(1)
            rr, gg = r[real], g[real]
            slots[rr, gg, j[real]] = items[real, t]
            gpu_load[rr, gg] += item_w[real, t]
            free[rr, gg] -= 1
    return flat.reshape(ids.shape)


def _incremental(
    old: np.ndarray,
    w: np.ndarray,
    group_node: np.ndarray,
    counts: str | np.ndarray,
    limit: np.ndarray,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> np.ndarray:
    """A placement for loads w that keeps most of ``old``: groups on ``group_node``, replica counts
    ``counts`` ("sticky": close to the current ones, "fresh": chosen anew, or an [L, E] array), the
    current slots kept where the counts allow, then swaps between GPUs of a node until each layer's
    heaviest GPU is <= limit (or no swap helps).

    Args:
        old: [L, R] current placement in the new slot layout (-1: empty slot)
        w: [L, E] loads; group_node: [L, G] node of each group (zeros for the global policy)
        limit: [L] heaviest GPU load at which to stop swapping
    Returns:
        phy2log: [L, R]
    """
    num_layers, num_replicas = old.shape
    num_experts = w.shape[1]
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    cap = max(gpus_per_node, -(-slots_per_node // experts_per_node))

    node_groups = np.argsort(group_node, axis=1, kind="stable")  # groups in node order
    mlog2log = (node_groups[..., None] * group_size + np.arange(group_size)).reshape(num_layers, num_experts)
    log2mlog = _inverse(mlog2log)
    w_mlog = np.take_along_axis(w, mlog2log, 1).reshape(-1, experts_per_node)  # [L*N, E/N]

    # current slots as node-local expert indices; a slot whose expert now lives on another node is free
    mlog = np.take_along_axis(log2mlog, np.maximum(old, 0), 1)
    here = (old >= 0) & (mlog // experts_per_node == np.arange(num_replicas) // slots_per_node)
    local = np.where(here, mlog % experts_per_node, -1).reshape(num_layers * num_nodes, gpus_per_node, -1)

    if isinstance(counts, np.ndarray):
        cnt = np.take_along_axis(counts, mlog2log, 1).reshape(w_mlog.shape)
    elif counts == "sticky":
        have = _counts(
            np.where(local >= 0, local, experts_per_node).reshape(len(w_mlog), -1), experts_per_node + 1
        )
        cnt = _sticky_counts(have[:, :experts_per_node], w_mlog, slots_per_node, cap)
    else:
        cnt = _replicate(w_mlog, slots_per_node, cap)
        cnt = _spread_big_replicas(w_mlog, cnt, gpus_per_node, cap)

    ids = _keep_and_fill(local, w_mlog, cnt)
    loads = np.take_along_axis(w_mlog / cnt, ids.reshape(len(ids), -1), 1).reshape(ids.shape)
    _refine_swaps(loads, ids, target=np.repeat(limit, num_nodes), pair_rounds=0)
    phy2mlog = ids.reshape(num_layers, num_nodes, -1) + (np.arange(num_nodes) * experts_per_node)[:, None]
    return np.take_along_axis(mlog2log, phy2mlog.reshape(num_layers, -1), 1)


def _group_nodes_of(phy2log: np.ndarray, num_experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """[L, R] hierarchical placement -> [L, G] node of each group (that of its first expert)."""
    num_layers, num_replicas = phy2log.shape
    node = np.empty((num_layers, num_experts), dtype=np.int64)
    np.put_along_axis(node, phy2log, np.arange(num_replicas) // (num_replicas // num_nodes), 1)
    return node[:, :: num_experts // num_groups]
