"""Candidate B: the published greedy's steps, each improved.

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

The building blocks (replica counts, packing, swaps) are also used by the incremental re-plan.
Numpy, vectorised over rows (layers or layers * nodes).
"""

from __future__ import annotations

import numpy as np

from .greedy import _greedy_packing, _inverse


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
