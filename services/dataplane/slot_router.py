"""Slot routing: which physical slot, on which expert worker, computes each (token, choice) pair.

Pure torch, no transport: the dispatch client (`dispatch.RemoteExperts`) asks a `SlotRouter` for
a `Route` and sends each worker its share; after a worker failed it asks for a resend route that
avoids the dead workers. One router serves one placement (a new placement gets a new router).

Per MoE layer of a step, for topk_idx [T, K] logical experts:
  - a layer where every logical expert has one slot: a table lookup (expert -> its slot);
  - a layer with replicas: round-robin over an expert's replicas, continuing across calls (the
    j-th pair for expert e takes replica (pairs already sent to e + j) % replicas), so replicas
    share e's load evenly however few tokens each call brings (EPLB's model of a replicated
    expert), deterministic;
  - replicas on dead workers are skipped; an expert with no live replica keeps them on the first
    send (the failure then surfaces as a failed RPC) and raises `ExpertUnavailableError` on a resend.
Slot p of the placement lives on worker p // S at local slot p % S.
"""

from __future__ import annotations

import functools

import torch

from services.dataplane.placement import Placement


class ExpertDispatchError(RuntimeError):
    """A Dispatch was refused (bad request, unknown placement version) or answered wrongly."""


class ExpertUnavailableError(ExpertDispatchError):
    """Some routed experts have no replica on a live worker."""


class Route:
    """Where the pairs of one dispatch go: `slot` [T, K] int64, each pair's global slot (-1: not
    routed), on workers of `slots_per_worker` slots each. Derived on first use: `local_slot` [T,
    K] int32 (the slot on its worker; meaningless where not routed) and `shares`: (worker index,
    pairs [T, K] bool it computes) for each worker that gets any."""

    def __init__(self, slot: torch.Tensor, slots_per_worker: int):
        self.slot, self.slots_per_worker = slot, slots_per_worker

    @functools.cached_property
    def local_slot(self) -> torch.Tensor:
        return self.slot.remainder(self.slots_per_worker).to(torch.int32)

    @functools.cached_property
    def shares(self) -> list[tuple[int, torch.Tensor]]:
        worker = self.slot.div(self.slots_per_worker, rounding_mode="floor")  # -1 (no slot) stays -1
        named = torch.bincount(worker.view(-1) + 1).tolist()[1:]
        return [(w, worker == w) for w, n in enumerate(named) if n]

    def pairs(self, w: int) -> torch.Tensor:
        """[T, K] bool: the pairs worker w computes."""
        return self.slot.div(self.slots_per_worker, rounding_mode="floor") == w


class SlotRouter:
    """Maps logical experts to physical slots of one `placement` (over `num_experts` logical
    experts), keeping the replica rotation state across calls."""

    def __init__(self, placement: Placement, num_experts: int):
        self.placement, self.num_experts = placement, num_experts
        # log2phy [L, E, R] slots of each expert (-1 padded), logcnt [L, E] replicas
        self.log2phy, self.logcnt = placement.replicas(num_experts)
        self.replicated = (self.logcnt > 1).any(-1).tolist()  # per MoE layer: some expert has replicas
        self.sole_slot = list(self.log2phy[..., 0])  # per MoE layer [E]: first (or only) slot
        self.sent = torch.zeros(placement.num_moe_layers, num_experts, dtype=torch.long)  # rotation
        self._live: dict[frozenset[int], tuple[torch.Tensor, torch.Tensor]] = {}

    def first(
        self, moe_layer: int, topk_idx: torch.Tensor, counts: torch.Tensor, dead: frozenset[int]
    ) -> Route:
        """Route every pair of topk_idx [T, K] (counts [E] = its bincount), avoiding `dead`
        workers where an expert has a live replica."""
        experts = topk_idx.reshape(-1)
        if not dead and not self.replicated[moe_layer]:  # the usual case: a lookup
            chosen = self.sole_slot[moe_layer].index_select(0, experts)
        else:
            chosen = self._choose(moe_layer, experts, counts, dead, strict=False)
        return self._split(chosen.view(topk_idx.shape))

    def check_live(self, moe_layer: int, topk_idx: torch.Tensor, failed: frozenset[int]) -> None:
        """Raise ExpertUnavailableError when an expert of topk_idx [T, K] has every replica on
        the `failed` workers (nothing to send it to)."""
        if failed:
            self._check_live(moe_layer, topk_idx.reshape(-1), failed)

    def resend(
        self, moe_layer: int, topk_idx: torch.Tensor, pairs: torch.Tensor, dead: frozenset[int]
    ) -> Route:
        """Route the pairs [T, K] bool of topk_idx [T, K] again, on live workers only; raises
        ExpertUnavailableError when a pair's expert has no replica off the `dead` workers."""
        experts = topk_idx[pairs]
        counts = torch.bincount(experts, minlength=self.num_experts)
        slot = torch.full(topk_idx.shape, -1, dtype=torch.long)
        slot[pairs] = self._choose(moe_layer, experts, counts, dead, strict=True)
        return self._split(slot)

    def _choose(
        self, moe_layer: int, experts: torch.Tensor, counts: torch.Tensor, dead: frozenset[int], strict: bool
    ) -> torch.Tensor:
        """Global slot [N] for each pair's logical expert in `experts` [N] (counts: its bincount)."""
        if strict and dead:
            self._check_live(moe_layer, experts, dead)
        log2phy, logcnt = self._live_replicas(dead)
        log2phy, logcnt = log2phy[moe_layer], logcnt[moe_layer]
        if not self.replicated[moe_layer]:  # one slot per expert: nothing to choose, no rotation
            return log2phy[experts, 0]
        sent = self.sent[moe_layer]
        rank = sent[experts] + replica_rank(experts, counts)
        sent += counts
        return log2phy[experts, rank % logcnt[experts]]

    def _check_live(self, moe_layer: int, experts: torch.Tensor, dead: frozenset[int]) -> None:
        """ExpertUnavailableError when an expert of `experts` [N] has every replica on `dead` workers
        (its first replica after `_live_replicas` is then on a dead one)."""
        slots = self._live_replicas(dead)[0][moe_layer][experts, 0]
        stranded = torch.isin(slots // self.placement.slots_per_worker, torch.tensor(sorted(dead)))
        if bool(stranded.any()):
            lost = sorted(set(experts[stranded].tolist()))
            raise ExpertUnavailableError(
                f"MoE layer {moe_layer}: logical experts {lost} have no replica on a live worker "
                f"(placement version {self.placement.version}, failed workers "
                f"{[self.placement.workers[w] for w in sorted(dead)]})"
            )

    def _live_replicas(self, dead: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy [L, E, R], logcnt [L, E]) with replicas on `dead` workers moved behind the live
        ones and not counted; an expert with no live replica keeps all of its replicas."""
        if not dead:
            return self.log2phy, self.logcnt
        if dead not in self._live:
            log2phy, logcnt = self.log2phy, self.logcnt
            worker = torch.where(log2phy >= 0, log2phy // self.placement.slots_per_worker, -1)
            live = (log2phy >= 0) & ~torch.isin(worker, torch.tensor(sorted(dead)))
            live_cnt = live.sum(-1)
            order = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)
            self._live[dead] = (
                torch.where((live_cnt > 0)[..., None], torch.gather(log2phy, -1, order), log2phy),
                torch.where(live_cnt > 0, live_cnt, logcnt),
            )
        return self._live[dead]

    def _split(self, slot: torch.Tensor) -> Route:
        return Route(slot, self.placement.slots_per_worker)


def replica_rank(experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each entry of `experts` [N], how many earlier entries name the same expert
    ([3, 5, 3, 3] -> [0, 0, 1, 2]); counts = bincount(experts) over all experts."""
    order = torch.argsort(experts, stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(experts)
    rank[order] = torch.arange(experts.numel()) - first[experts[order]]
    return rank
