"""Expert placement: which logical expert every physical slot of every MoE layer holds, and
which expert worker holds the slot.

Slots are numbered like EPLB's physical experts: with W workers of S slots each, slot p lives
on worker p // S at local index p % S, for every MoE layer. A placement has a version that only
grows; workers and attention workers agree on a version before it serves traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    version: int
    phy2log: torch.Tensor  # [num_moe_layers, num_slots] int64 logical expert held by each slot
    workers: tuple[str, ...]  # worker id per worker index (W entries); num_slots % W == 0

    def __post_init__(self):
        if self.phy2log.dim() != 2:
            raise ValueError("phy2log must be [num_moe_layers, num_slots]")
        if not self.workers or self.phy2log.shape[1] % len(self.workers):
            raise ValueError(f"{self.phy2log.shape[1]} slots do not divide over {len(self.workers)} workers")

    @property
    def num_moe_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_worker(self) -> int:
        return self.num_slots // len(self.workers)

    def worker_slots(self, worker: int) -> range:
        """The global slots of `worker` (the same in every MoE layer)."""
        s = self.slots_per_worker
        return range(worker * s, (worker + 1) * s)

    def worker_experts(self, worker: int) -> torch.Tensor:
        """[num_moe_layers, S] logical experts held by `worker`, in local slot order."""
        s = self.slots_per_worker
        return self.phy2log[:, worker * s : (worker + 1) * s]

    def worker_layout(self, worker: int, moe_layers) -> dict[int, list[int]]:
        """{decoder layer: logical expert per local slot} of `worker` (what its LoadSlots names);
        `moe_layers`: the decoder layer of each MoE layer."""
        experts = self.worker_experts(worker)
        return {layer: experts[n].tolist() for n, layer in enumerate(moe_layers)}

    def replicas(self, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy [layers, num_logical, max_replicas] padded with -1, logcnt [layers, num_logical])."""
        L, P = self.phy2log.shape
        logcnt = torch.zeros(L, num_logical, dtype=torch.long)
        logcnt.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))
        if bool((logcnt == 0).any()):
            layer, expert = (logcnt == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} of MoE layer {layer} has no slot")
        max_rep = int(logcnt.max())
        log2phy = torch.full((L, num_logical, max_rep), -1, dtype=torch.long)
        order = torch.argsort(self.phy2log, dim=1, stable=True)  # slots grouped by logical expert
        sorted_log = torch.gather(self.phy2log, 1, order)
        start = torch.cumsum(logcnt, 1) - logcnt  # first position of each expert in `order`
        rank = torch.arange(P).expand(L, P) - torch.gather(start, 1, sorted_log)
        log2phy[torch.arange(L)[:, None].expand(L, P), sorted_log, rank] = order
        return log2phy, logcnt

    def to_dict(self) -> dict:
        return {"version": self.version, "phy2log": self.phy2log.tolist(), "workers": list(self.workers)}

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        return cls(int(d["version"]), torch.tensor(d["phy2log"], dtype=torch.long), tuple(d["workers"]))

    @classmethod
    def round_robin(
        cls,
        num_layers: int,
        num_logical: int,
        workers: tuple[str, ...],
        slots_per_worker: int,
        version: int = 1,
    ) -> Placement:
        """Slot p holds logical expert p % num_logical (replicas wrap around)."""
        num_slots = len(workers) * slots_per_worker
        if num_slots < num_logical:
            raise ValueError(f"{num_slots} slots cannot hold {num_logical} logical experts")
        phy2log = (torch.arange(num_slots) % num_logical).expand(num_layers, num_slots).clone()
        return cls(version, phy2log, tuple(workers))
