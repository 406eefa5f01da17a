"""Expert-parallelism load balancer (EPLB) for DeepSeek-V3-style MoE layers.

Same contract as DeepSeek's published ``eplb.py`` (``rebalance_experts``), vectorised over layers
(the only Python loops run over items or steps, each step one array operation for all layers) and
better balanced. Per layer it builds two candidates and keeps the one whose heaviest GPU is lighter:

A. The published greedy itself (same float32 arithmetic and tie-breaking, identical placements):
   groups packed to nodes, replicas given one by one to the expert with the most tokens per
   replica, replicas packed to the GPUs of their node (heaviest first, to the lightest GPU with room).
   Keeping it as a candidate is what makes every layer at least as balanced as the published plan.
B. The same steps, each improved:
   - the group packing is refined by swapping groups between the heaviest node and the others;
   - an expert gets at most one replica per GPU of its node (a second one on a GPU cannot lower that
     GPU's load), replicas bigger than half a GPU's share are kept to at most one per GPU
     (``_spread_big_replicas``), and nearly uniform loads split evenly over GPUs (``_even_split``);
   - the greedy packing counts each GPU's free slots as holding the mean remaining replica (GPUs that
     took big replicas early must still take as many as the others);
   - then local search swaps two replicas between the heaviest GPU of a node and a lighter one while
     that lowers the heaviest GPU (``_refine_swaps``; swaps keep every constraint), stopping where the
     layer's max cannot go lower anyway;
   - the node that makes a layer's heaviest GPU, if clearly above its lower bound, also tries a few
     other replica counts for its two hottest experts (``_other_counts``) and keeps the best.
Finally nodes and GPUs are relabelled per layer (this changes no layer's loads) so that heavy GPUs of
successive layers land on different devices, which balances the loads summed over layers.

``replan`` moves from a current placement to one for new loads (or a resized cluster), keeping most
slots in place; see its docstring. Everything here is a pure function: torch tensors in and out,
numpy inside (cheaper per operation than torch for arrays this small).

Shapes: ``weight [layers, logical_experts]`` (e.g. tokens per expert, non-negative);
``phy2log [layers, num_replicas]`` (physical slot -> logical expert); ``log2phy [layers,
logical_experts, num_replicas - logical_experts + 1]`` (slots of each expert, padded with -1);
``logcnt [layers, logical_experts]``. Slot p is on GPU p // (num_replicas / num_gpus), GPU g on node
g // (num_gpus / num_nodes). The load of a slot is weight[expert] / logcnt[expert]; the load of a
GPU is the sum over its slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DEFAULT_TOLERANCE",
    "PlacementStats",
    "Replan",
    "gpu_loads",
    "load_lower_bound",
    "placement_stats",
    "rebalance_experts",
    "replan",
]


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _as_weight(weight) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        weight = torch.as_tensor(weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [layers, logical_experts], got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(
            f"weight must have at least one layer and one expert, got shape {tuple(weight.shape)}"
        )
    if weight.is_complex() or weight.dtype == torch.bool:
        raise ValueError(f"weight must be real numbers, got dtype {weight.dtype}")
    w = weight.detach().cpu().double()
    if not torch.isfinite(w).all():
        raise ValueError("weight must be finite (found inf or nan)")
    if (w < 0).any():
        raise ValueError("weight must be non-negative (found a negative load)")
    if (w > torch.finfo(torch.float32).max).any():
        raise ValueError("weight must fit in float32 (the published algorithm's precision); rescale it")
    return weight


def _check_layout(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    for name, value in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_replicas < num_experts:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_experts}): "
            "every expert needs at least one replica"
        )
    if num_experts % num_groups:
        raise ValueError(f"logical experts ({num_experts}) must be a multiple of num_groups ({num_groups})")


def _is_hierarchical(num_groups: int, num_nodes: int) -> bool:
    """The published rule: hierarchical policy when groups split evenly over nodes, else global."""
    return num_groups % num_nodes == 0


# --------------------------------------------------------------------------------------------------
# Building blocks (numpy, vectorised over rows = layers or layers * nodes)
# --------------------------------------------------------------------------------------------------


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


def _replicate(w: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Replica counts: start at one each, then repeatedly one more for the expert with the most tokens
    per replica among those below ``cap`` replicas.

    Args:
        w: [X, m] expert loads; num_slots >= m; cap * m >= num_slots
    Returns:
        cnt: [X, m] int64, each row sums to num_slots
    """
    num_rows, m = w.shape
    cnt = np.ones((num_rows, m), dtype=np.int64)
    rows = np.arange(num_rows)
    per_replica = np.where(cap > 1, w.astype(np.float64), -1.0)  # -1: at cap
    for _ in range(num_slots - m):
        hot = per_replica.argmax(1)
        cnt[rows, hot] += 1
        per_replica[rows, hot] = np.where(cnt[rows, hot] < cap, w[rows, hot] / cnt[rows, hot], -1.0)
    return cnt


def _spread_big_replicas(w: np.ndarray, cnt: np.ndarray, num_gpus: int, cap: int) -> np.ndarray:
    """Adjust replica counts so that at most num_gpus replicas are "big" (more than half of the
    target T = max(mean GPU load, largest replica)): two big replicas on one GPU exceed T, and with
    more big replicas than GPUs some GPU must hold two. While there are too many, one big expert
    whose replicas stay <= T with one replica fewer gives a replica to the expert with the most tokens
    per replica whose replicas then are small.

    Args:
        w: [X, m] expert loads of a node (or of all experts, global policy)
        cnt: [X, m] replica counts (rows sum to the node's slots)
        num_gpus: GPUs the replicas are packed to
        cap: most replicas per expert
    Returns:
        cnt: [X, m] adjusted copy
    """
    cnt = cnt.copy()
    rows = np.arange(len(w))
    target = np.maximum(w.sum(1) / num_gpus, (w / cnt).max(1))[:, None]
    for _ in range(num_gpus):
        size = w / cnt
        big = size > target / 2
        need = (cnt * big).sum(1) > num_gpus
        shrink = np.where(big & (cnt > 1) & (w <= target * (cnt - 1)), w / np.maximum(cnt - 1, 1), np.inf)
        grow = np.where((w <= target / 2 * (cnt + 1)) & (cnt < cap), size, -1.0)
        give = shrink.argmin(1)
        grow[rows, give] = -1.0
        take = grow.argmax(1)
        ok = need & np.isfinite(shrink[rows, give]) & (grow[rows, take] >= 0)
        if not ok.any():
            break
        cnt[rows[ok], give[ok]] -= 1
        cnt[rows[ok], take[ok]] += 1
    return cnt


def _even_split(w: np.ndarray, cnt: np.ndarray, num_gpus: int, cap: int) -> np.ndarray:
    """Replica counts for rows of nearly equal loads (max <= 1.5 x mean) that split evenly over GPUs.

    On such rows the greedy gives two replicas to the r heaviest experts (r = redundant slots); if
    2r is not a multiple of num_gpus, some GPUs get more half-size replicas than others and cannot
    balance. Instead the n heaviest experts get c replicas each, with n * (c - 1) = r and n * c a
    multiple of num_gpus (smallest such c), e.g. 256 experts on 24 GPUs x 12 slots: 16 x 3 replicas
    rather than 32 x 2.

    Args:
        w: [X, m] loads; cnt: [X, m] greedy counts (rows sum to S); cap: most replicas per expert
    Returns:
        cnt: [X, m] (a copy if changed)
    """
    num_rows, m = w.shape
    redundant = int(cnt[0].sum()) - m
    rows = (w.max(1) <= 1.5 * w.mean(1)) & ((cnt * (cnt > 1)).sum(1) % num_gpus != 0)
    splits = [
        c
        for c in range(2, cap + 1)
        if redundant % (c - 1) == 0 and redundant // (c - 1) <= m and redundant // (c - 1) * c % num_gpus == 0
    ]
    if redundant == 0 or not splits or not rows.any():
        return cnt
    c, n = splits[0], redundant // (splits[0] - 1)
    heaviest = np.argsort(-w[rows], axis=1, kind="stable")[:, :n]
    even = np.ones((len(heaviest), m), dtype=np.int64)
    even[np.arange(len(heaviest))[:, None], heaviest] = c
    cnt = cnt.copy()
    cnt[rows] = even
    return cnt


def _expand(cnt: np.ndarray) -> np.ndarray:
    """[X, m] replica counts (rows with equal sums S) -> [X, S] expert index of each replica."""
    num_rows, m = cnt.shape
    return np.repeat(np.tile(np.arange(m), num_rows), cnt.ravel()).reshape(num_rows, -1)


def _best_swaps(w: np.ndarray, loads: np.ndarray, rows: np.ndarray, heavy: np.ndarray, light: np.ndarray):
    """Best swap between pack ``heavy`` and pack ``light`` of each given row and pair: the one that
    brings the pair's loads closest together. ``gain`` is how much the pair's max comes down (<= 0:
    no swap helps).

    Args:
        w: [X, P, k] item loads; loads: [X, P] pack loads; rows: [n]
        heavy: [n, 1] or [n, m] packs; light: [n, m] packs (m pairs per row)
    Returns:
        gain, a, b: [n, m] gain and the item index in the heavy / light pack
    """
    n, m = light.shape
    per_pack = w.shape[2]
    r = rows[:, None]
    half_gap = (loads[r, heavy] - loads[r, light]) / 2
    # moving d = a - b from heavy to light; the pair's max drops by half_gap - |d - half_gap|
    miss = (w[r, heavy] - half_gap[:, :, None])[:, :, :, None] - w[r, light][:, :, None, :]
    miss = np.abs(miss, out=miss).reshape(n * m, -1)
    best = miss.argmin(1)
    gain = half_gap - miss[np.arange(n * m), best].reshape(n, m)
    best = best.reshape(n, m)
    return gain, best // per_pack, best % per_pack


def _swap(w, ids, loads, rows, p, a, q, b) -> None:
    """Swap item a of pack p with item b of pack q in each given row (in place; rows distinct per call
    or packs disjoint)."""
    wa, wb = w[rows, p, a], w[rows, q, b]
    w[rows, p, a], w[rows, q, b] = wb, wa
    ia, ib = ids[rows, p, a], ids[rows, q, b]
    ids[rows, p, a], ids[rows, q, b] = ib, ia
    loads[rows, p] += wb - wa
    loads[rows, q] += wa - wb


def _good_enough(w: np.ndarray) -> np.ndarray:
    """[X, P, k] packs -> [X] heaviest pack load that needs no refining: within 0.01% of the mean pack
    load, or the largest item (a pack holding it cannot be lighter)."""
    return np.maximum(w.sum(-1).mean(1) * (1 + 1e-4), w.max((1, 2)))


def _refine_swaps(
    w: np.ndarray,
    ids: np.ndarray,
    target: np.ndarray | None = None,
    pair_rounds: int = 4,
    partners: int = 4,
    max_iters: int = 500,
) -> np.ndarray:
    """Local search on packings, in place: swap items between packs to lower the heaviest pack.

    1. ``pair_rounds`` rounds that pair the i-th heaviest with the i-th lightest pack of each row and
       make the best swap of every pair (brings the pair's loads closest together), if it helps.
    2. Then, repeatedly, the best swap between the heaviest pack and one of the ``partners`` lightest
       packs (or, if none helps, any pack), while that lowers the heaviest pack.

    A row stops when no swap lowers its heaviest pack, or once that is <= ``target`` (default:
    ``_good_enough``, so no pointless swaps are made).

    Args:
        w: [X, P, k] item loads per pack (float64), modified in place
        ids: [X, P, k] item labels, moved along with w
        target: optional [X] load at which a row is good enough
    Returns:
        swaps: [X] number of swaps made per row
    """
    num_rows, num_packs, per_pack = w.shape
    swaps = np.zeros(num_rows, dtype=np.int64)
    if num_packs < 2:
        return swaps
    loads = w.sum(-1)
    eps = 1e-7 * loads.mean(1)  # ignore gains below 0.1 ppm of the mean pack load
    if target is None:
        target = _good_enough(w)

    def unfinished(rows):
        return rows[loads[rows].max(1) > target[rows]]

    half = num_packs // 2
    active = unfinished(np.arange(num_rows))
    for _ in range(pair_rounds):
        if len(active) == 0:
            break
        order = np.argsort(loads[active], axis=1)
        heavy, light = order[:, : num_packs - half - 1 : -1], order[:, :half]
        gain, a, b = _best_swaps(w, loads, active, heavy, light)
        ok = gain > eps[active, None]
        r, i = np.nonzero(ok)
        _swap(w, ids, loads, active[r], heavy[r, i], a[r, i], light[r, i], b[r, i])
        np.add.at(swaps, active[r], 1)
        active = unfinished(active[ok.any(1)])

    def heaviest_swap(rows, light):
        """Best swap of the heaviest pack of each row with one of ``light`` [n, m] (may include it):
        (found, heavy pack, item in it, light pack, item in it), each [n]."""
        heavy = loads[rows].argmax(1)
        gain, a, b = _best_swaps(w, loads, rows, heavy[:, None], light)
        gain[light == heavy[:, None]] = -np.inf
        j = gain.argmax(1)
        i = np.arange(len(rows))
        return gain[i, j] > eps[rows], heavy, a[i, j], light[i, j], b[i, j]

    active = unfinished(np.arange(num_rows))
    for _ in range(max_iters):
        if len(active) == 0:
            break
        if partners + 1 < num_packs:  # the lightest packs first; if none of them helps, any pack
            light = np.argpartition(loads[active], partners, axis=1)[:, :partners]
            found = heaviest_swap(active, light)
            stuck = ~found[0]
            if stuck.any():
                every_pack = np.broadcast_to(np.arange(num_packs), (int(stuck.sum()), num_packs))
                for x, y in zip(found, heaviest_swap(active[stuck], every_pack), strict=True):
                    x[stuck] = y
        else:
            found = heaviest_swap(active, np.broadcast_to(np.arange(num_packs), (len(active), num_packs)))
        ok, heavy, a, q, b = found
        active = active[ok]
        _swap(w, ids, loads, active, heavy[ok], a[ok], q[ok], b[ok])
        swaps[active] += 1
        active = unfinished(active)
    return swaps


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


def _desc_order(w: np.ndarray) -> np.ndarray:
    """[X, n] indices of each row by weight, descending (stable)."""
    return np.argsort(-w, axis=1, kind="stable")


def _improved_plan(w: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """Candidate B (see the module docstring).

    Args:
        w: [L, E] float64 loads
    Returns:
        phy2log: [L, num_replicas]
    """
    num_layers, num_experts = w.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes

    group_w = w.reshape(num_layers, num_groups, group_size).sum(-1)
    node_groups = _inverse(_greedy_packing(group_w, num_nodes, _desc_order(group_w)))
    node_groups = node_groups.reshape(num_layers, num_nodes, groups_per_node)
    if 1 < groups_per_node < num_groups:
        loads = np.take_along_axis(group_w, node_groups.reshape(num_layers, -1), 1).reshape(node_groups.shape)
        _refine_swaps(loads, node_groups)
    mlog2log = (node_groups[..., None] * group_size + np.arange(group_size)).reshape(num_layers, num_experts)

    w_mlog = np.take_along_axis(w, mlog2log, 1).reshape(-1, experts_per_node)  # [L*N, E/N]
    cap = max(gpus_per_node, -(-slots_per_node // experts_per_node))
    cnt = _replicate(w_mlog, slots_per_node, cap)
    counts = _even_split(w_mlog, _spread_big_replicas(w_mlog, cnt, gpus_per_node, cap), gpus_per_node, cap)
    # A node's heaviest GPU cannot go below row_bound, so no node of a layer needs to go below the
    # largest row_bound of the layer's nodes: refining further would not change the layer's max.
    row_bound = np.maximum(w_mlog.sum(1) / gpus_per_node, (w_mlog / cnt).max(1))
    ids, top = _pack_rows(
        w_mlog, counts, gpus_per_node, np.repeat(row_bound.reshape(num_layers, -1).max(1), num_nodes)
    )

    # The node that makes a layer's heaviest GPU, if clearly above its own lower bound, tries other
    # replica counts (packed and refined the same way, down to the layer's next heaviest node at
    # most) and keeps the best.
    by_layer = np.sort(top.reshape(num_layers, num_nodes), axis=1)
    runner_up = by_layer[:, -2] if num_nodes > 1 else np.zeros(num_layers)
    worst = np.arange(num_layers) * num_nodes + top.reshape(num_layers, num_nodes).argmax(1)
    keep = top[worst] > row_bound[worst] * (1 + 1e-2)
    worst, runner_up = worst[keep], runner_up[keep]
    origin, variants = _other_counts(w_mlog[worst], cnt[worst], gpus_per_node, cap)
    if len(origin):
        v_ids, v_top = _pack_rows(w_mlog[worst[origin]], variants, gpus_per_node, runner_up[origin])
        order = np.lexsort((v_top, origin))  # by row, best first
        rows, first_of_row = np.unique(origin[order], return_index=True)
        best = order[first_of_row]
        better = v_top[best] < top[worst[rows]]
        ids[worst[rows[better]]] = v_ids[best[better]]

    phy2mlog = ids.reshape(num_layers, num_nodes, -1) + (np.arange(num_nodes) * experts_per_node)[:, None]
    return np.take_along_axis(mlog2log, phy2mlog.reshape(num_layers, -1), 1)


def _pack_rows(
    w: np.ndarray, cnt: np.ndarray, num_gpus: int, floor: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pack each row's replicas to num_gpus GPUs greedily, then refine by swaps (until the heaviest
    GPU is within 0.01% of the mean, or <= floor, or no swap helps).

    Args:
        w: [X, m] expert loads; cnt: [X, m] replica counts (rows sum to S, a multiple of num_gpus)
        floor: [X] heaviest GPU load below which a row needs no refining
    Returns:
        ids: [X, num_gpus, S / num_gpus] expert (index into the row) in each slot
        top: [X] load of the heaviest GPU
    """
    num_rows = len(w)
    item = _expand(cnt)  # [X, S] expert of each replica
    item_w = np.take_along_axis(w / cnt, item, 1)
    layout = _inverse(_greedy_packing(item_w, num_gpus, _desc_order(item_w), look_ahead=True))
    ids = np.take_along_axis(item, layout, 1).reshape(num_rows, num_gpus, -1)
    loads = np.take_along_axis(item_w, layout, 1).reshape(ids.shape)
    _refine_swaps(loads, ids, np.maximum(_good_enough(loads), floor))
    return ids, loads.sum(-1).max(1)


# (replicas more for the hottest expert, for the second hottest) tried by _other_counts
_COUNT_DELTAS = ((-1, -1), (-2, 0), (-1, 0), (-1, 1))


def _other_counts(w: np.ndarray, cnt: np.ndarray, num_gpus: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Alternative replica counts for rows with a big replica (>= 1/4 of the mean GPU load), which is
    what usually keeps a node from packing evenly: the hottest two experts get ``_COUNT_DELTAS`` more
    replicas (within 1..cap); the other experts make up the difference (the one with the fewest
    tokens per remaining replica loses one, or the one with the most tokens per replica gains one).

    Args:
        w: [X, m] expert loads; cnt: [X, m] replica counts (rows sum to S); cap: most replicas
    Returns:
        origin: [V] row of each variant; variants: [V, m] counts (rows sum to S)
    """
    hot_rows = np.flatnonzero((w / cnt).max(1) >= w.sum(1) / num_gpus / 4)
    w, cnt = w[hot_rows], cnt[hot_rows]
    total = cnt.sum(1)
    rows = np.arange(len(hot_rows))
    hot = np.argsort(-w, axis=1, kind="stable")[:, :2]
    others = np.ones(w.shape, dtype=bool)
    others[rows[:, None], hot] = False
    origin, out = [], []
    for deltas in _COUNT_DELTAS:
        c = cnt.copy()
        for j in range(hot.shape[1]):  # fewer than two experts: just the one
            c[rows, hot[:, j]] = np.clip(c[rows, hot[:, j]] + deltas[j], 1, cap)
        for _ in range(sum(abs(d) for d in deltas)):
            diff = total - c.sum(1)
            gain = np.where(others & (c < cap), w / c, -1.0).argmax(1)
            lose = np.where(others & (c > 1), w / np.maximum(c - 1, 1), np.inf).argmin(1)
            up, down = (diff > 0) & (c[rows, gain] < cap), (diff < 0) & (c[rows, lose] > 1)
            c[rows[up], gain[up]] += 1
            c[rows[down], lose[down]] -= 1
        ok = c.sum(1) == total
        origin.append(hot_rows[ok])
        out.append(c[ok])
    return np.concatenate(origin), np.concatenate(out)


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


def _max_gpu(phy2log: np.ndarray, w: np.ndarray, num_gpus: int) -> np.ndarray:
    num_layers, num_replicas = phy2log.shape
    return _slot_loads(phy2log, w).reshape(num_layers, num_gpus, -1).sum(-1).max(1)


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


# --------------------------------------------------------------------------------------------------
# Replanning helpers
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


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


def _ratio(a, b):
    """a / b, with 0 / 0 = 1 (an all-zero layer is perfectly balanced)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.where(b > 0, a / np.where(b > 0, b, 1.0), 1.0)


def _as_placement(phy2log, name: str) -> np.ndarray:
    if not isinstance(phy2log, torch.Tensor):
        phy2log = torch.as_tensor(phy2log)
    if phy2log.dim() != 2:
        raise ValueError(f"{name} must be 2-D [layers, num_replicas], got shape {tuple(phy2log.shape)}")
    if phy2log.dtype.is_floating_point or phy2log.is_complex() or phy2log.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer expert ids, got dtype {phy2log.dtype}")
    return phy2log.detach().cpu().numpy().astype(np.int64)


def _check_placement(phy2log, weight, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a placement against loads; return numpy (phy2log, float64 weight)."""
    weight = _as_weight(weight)
    p = _as_placement(phy2log, "phy2log")
    num_layers, num_experts = weight.shape
    if p.shape[0] != num_layers:
        raise ValueError(f"phy2log has {p.shape[0]} layers but weight has {num_layers}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int | np.integer) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
    if p.shape[1] % num_gpus:
        raise ValueError(f"num_replicas ({p.shape[1]}) must be a multiple of num_gpus ({num_gpus})")
    if p.size and (p.min() < 0 or p.max() >= num_experts):
        raise ValueError(f"phy2log holds expert ids outside [0, {num_experts})")
    return p, weight.detach().double().cpu().numpy()


def _check_current(current, num_layers: int, num_experts: int) -> np.ndarray:
    p = _as_placement(current, "current_phy2log")
    if p.shape[0] != num_layers:
        raise ValueError(f"current_phy2log has {p.shape[0]} layers but weight has {num_layers}")
    if p.shape[1] < 1:
        raise ValueError("current_phy2log has no slots")
    if p.min() < -1 or p.max() >= num_experts:
        raise ValueError(f"current_phy2log holds expert ids outside [0, {num_experts}) (or -1: empty slot)")
    return p


def _old_in_new_layout(previous, shape: tuple[int, int]) -> np.ndarray:
    """Previous placement [L, R_old] seen in a layout of R slots: slot p keeps p, missing slots -1."""
    prev = _as_placement(previous, "previous_phy2log") if not isinstance(previous, np.ndarray) else previous
    if prev.shape[0] != shape[0]:
        raise ValueError(f"previous placement has {prev.shape[0]} layers, expected {shape[0]}")
    old = np.full(shape, -1, dtype=np.int64)
    n = min(shape[1], prev.shape[1])
    old[:, :n] = prev[:, :n]
    return old
