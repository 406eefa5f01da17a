"""An expert worker's weights, in place: one set of expert rows per MoE layer, shared by every
loaded placement version, each version mapping its slots to rows.

A re-plan used to build every changed layer of the new version as a fresh stacked tensor while
the old version served from its own: up to two copies of the worker's experts. Here the rows of a
layer (`LayerRows`: w13 [P, 2I, H], w2 [P, H, I], FP8 scales when kept) stay where they are; a new
version reuses every row that already holds one of its experts, writes only the experts it lacks
into rows no loaded version reads, and appends rows only when there are not enough of those. After
the old version is released its rows become free for the next re-plan. Rows in use are never
written, so serving goes on from the same tensors while a version loads (vLLM's EPLB rearranges in
place with a bounded buffer; this is the same idea at the granularity of a row).

Pure planning here (`plan_rows`); SlotStore does the reads, writes and locking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerRows:
    """One MoE layer's rows: `tensors` [w13 [P, 2I, H], w2 [P, H, I]] (+ [w13_scale, w2_scale]
    [P, ...] for FP8 kept), and `expert` [P]: the logical expert each row holds (-1: none, or
    being written)."""

    tensors: list[torch.Tensor]
    expert: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.expert)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def plan_rows(
    expert: list[int], in_use: set[int], layout: list[int]
) -> tuple[list[int], dict[int, int], int]:
    """Rows for a new version's slots of one layer.

    expert [P]: the logical expert of each row (-1: none); in_use: the rows a loaded (or still
    draining) version reads; layout [S]: the logical expert of each of the new version's slots.
    Returns (row [S] of each slot, {logical expert: row} to write, rows to append). An expert
    already in some row is mapped to it (a row holds its expert until it is written, and rows in
    use are never written; a row in use is preferred). Each expert the layout lacks takes a row
    no version reads and no other expert of the layout is mapped to, lowest first; then appended
    rows P, P+1, ... Slots with the same expert share a row.
    """
    where: dict[int, int] = {}
    for r, e in enumerate(expert):
        if e >= 0 and (e not in where or (r in in_use and where[e] not in in_use)):
            where[e] = r
    wanted = dict.fromkeys(layout)
    taken = in_use | {where[e] for e in wanted if e in where}
    free = [r for r in range(len(expert)) if r not in taken]
    writes, appended = {}, 0
    for e in wanted:
        if e in where:
            continue
        if free:
            writes[e] = free.pop(0)
        else:
            writes[e] = len(expert) + appended
            appended += 1
        where[e] = writes[e]
    return [where[e] for e in layout], writes, appended


def row_map(rows: list[int], num_rows: int) -> torch.Tensor | None:
    """A version's slot -> row map as PackedExperts keeps it: None where every slot is its own row
    and there are no others (the kernels index rows by slot directly), else [S] int64."""
    if num_rows == len(rows) and rows == list(range(num_rows)):
        return None
    return torch.tensor(rows, dtype=torch.long)
