"""The pure slot router: logical experts -> physical slots on live workers, no server anywhere."""

import pytest
import torch

from services.dataplane.placement import Placement
from services.dataplane.slot_router import ExpertUnavailableError, SlotRouter, replica_rank

E, K = 8, 2


def _topk(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def _global_slots(router: SlotRouter, route) -> torch.Tensor:
    """[T, K] global slot of every routed pair (-1: none), rebuilt from the route's shares."""
    S = router.placement.slots_per_worker
    slot = torch.full(route.local_slot.shape, -1, dtype=torch.long)
    for w, pairs in route.shares:
        slot[pairs] = w * S + route.local_slot[pairs].long()
    return slot


def _first(router, topk, dead=frozenset(), layer=0):
    return router.first(layer, topk, torch.bincount(topk.view(-1), minlength=E), dead)


def test_without_replicas_every_pair_goes_to_its_experts_only_slot():
    placement = Placement(1, torch.stack([torch.randperm(E), torch.arange(E)]), ("a", "b"))
    router = SlotRouter(placement, E)
    topk = _topk(16)
    for layer in (0, 1):
        route = _first(router, topk, layer=layer)
        slot = _global_slots(router, route)
        assert torch.equal(placement.phy2log[layer][slot], topk)  # each slot holds its expert
        shares = torch.stack([p for _, p in route.shares])
        assert torch.equal(shares.sum(0), torch.ones_like(topk))  # every pair exactly once


def test_replicas_share_an_experts_pairs_evenly_across_calls():
    # 12 slots on 3 workers: experts 0-3 have two replicas each (slots e and 8 + e)
    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    router = SlotRouter(Placement(1, phy2log, ("a", "b", "c")), E)
    per_slot = torch.zeros(12, dtype=torch.long)
    for seed in range(40):  # one token per call: rotation must continue across calls
        topk = torch.tensor([[seed % 4, 4 + seed % 4]])
        slot = _global_slots(router, _first(router, topk))
        assert torch.equal(phy2log[0][slot], topk)
        per_slot += torch.bincount(slot.view(-1), minlength=12)
    assert per_slot[:4].tolist() == per_slot[8:].tolist() == [5] * 4  # replicas alternate


def test_dead_workers_are_avoided_and_a_resend_without_a_live_replica_fails_clearly():
    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])  # worker 2 holds replicas 0-3
    router = SlotRouter(Placement(3, phy2log, ("a", "b", "c")), E)
    topk = torch.tensor([[0, 1], [2, 3]])
    route = _first(router, topk, dead=frozenset({0}))  # 0-3 live on worker 2 only
    assert [w for w, _ in route.shares] == [2]
    assert torch.equal(phy2log[0][_global_slots(router, route)], topk)

    resend = router.resend(0, topk, torch.tensor([[True, False], [False, True]]), frozenset({0}))
    slot = _global_slots(router, resend)
    assert slot[0, 1] == slot[1, 0] == -1 and {int(slot[0, 0]), int(slot[1, 1])} == {8, 11}

    lonely = torch.tensor([[4, 5]])  # experts 4-5 live on worker 1 only
    with pytest.raises(ExpertUnavailableError, match=r"logical experts \[4, 5\] have no replica"):
        router.resend(0, lonely, torch.ones(1, 2, dtype=torch.bool), frozenset({1}))
    # the first send keeps them on their dead worker: its RPC fails, then the resend says why
    assert [w for w, _ in _first(router, lonely, dead=frozenset({1})).shares] == [1]


def test_replica_rank_numbers_repeats_in_order():
    experts = torch.tensor([3, 5, 3, 3, 5, 0])
    assert replica_rank(experts, torch.bincount(experts, minlength=6)).tolist() == [0, 0, 1, 2, 1, 0]


@pytest.mark.parametrize("T", [1, 5, 40])
def test_packed_requests_equal_the_torch_ones(T):
    """cpu_kernels.dispatch_rows / pack_share (the dispatch client's CPU path) give each worker the
    rows, local slots (-1 elsewhere) and weights (0 elsewhere) the torch ops give."""
    from services.dataplane.slot_router import Route
    from services.model.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    g = torch.Generator().manual_seed(T)
    S, W, K, H = 8, 3, 6, 16
    slot = torch.randint(-1, S * W, (T, K), generator=g)
    x, weight = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    route = Route(slot, S)
    counts = cpu_kernels.dispatch_rows(slot, S, W)
    assert counts == [int(route.pairs(w).any(1).sum()) for w in range(W)]
    for w, n in enumerate(counts):
        hidden, local, weights = torch.empty(n, H), torch.empty(n, K, dtype=torch.int32), torch.empty(n, K)
        rows = cpu_kernels.pack_share(x, slot, weight, S, w, hidden, local, weights)
        mine = route.pairs(w)
        want_rows = mine.any(1).nonzero().view(-1)
        assert torch.equal(rows, want_rows) and torch.equal(hidden, x[want_rows])
        assert torch.equal(local, torch.where(mine, route.local_slot, -1)[want_rows])
        assert torch.equal(weights, torch.where(mine, weight, 0.0)[want_rows])
