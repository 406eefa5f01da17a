"""The messages between a forward pass and an expert backend, and the driver that passes them.

A forward pass is a generator: at each MoE layer it yields an `ExpertDispatch` (the routed
tokens), gets back a handle, computes its shared experts, yields an `ExpertCombine` and gets back
the routed experts' weighted sum. `run_interleaved` drives one or more passes against an
`ExpertBackend` (in process: `moe.LocalExperts`; remote: the attention worker's dispatch client).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class ExpertDispatch:
    decoder_layer: int  # index among all decoder layers
    moe_layer: int  # index among the MoE layers
    x: torch.Tensor  # [T, H] post-attention-norm hidden states
    topk_idx: torch.Tensor  # [T, K] int64 logical experts
    topk_weight: torch.Tensor  # [T, K] fp32 routing weights (scaling factor applied)
    expert_counts: torch.Tensor  # [E] int64 routed (token, choice) pairs per logical expert

    @classmethod
    def routed(cls, decoder_layer: int, moe_layer: int, x, topk_idx, topk_weight, num_experts: int):
        """The message for routed tokens, with their per-expert counts (by scatter-add: on a GPU
        torch.bincount waits for the device to size its output, which a CUDA graph cannot capture)."""
        flat = topk_idx.reshape(-1)
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        return cls(decoder_layer, moe_layer, x, topk_idx, topk_weight, counts)


@dataclass
class ExpertCombine:
    handle: Any  # whatever the backend returned for the matching ExpertDispatch


class ExpertBackend(Protocol):
    """dispatch starts the routed work and returns a handle; combine waits for it. A backend
    may also have `cancel(handle)`, called for dispatches that will not be combined (a step that
    failed in another micro-batch)."""

    def dispatch(self, msg: ExpertDispatch) -> Any: ...

    def combine(self, msg: ExpertCombine) -> torch.Tensor: ...


StepGen = Generator[ExpertDispatch | ExpertCombine, Any, torch.Tensor]


@dataclass
class ExpertTally:
    """What a step's routed experts did: `load` [num_moe_layers, E] int64 routed (token, choice)
    pairs per logical expert (on the model's device), `wait_s` seconds spent in `combine`
    (blocked on routed experts)."""

    load: torch.Tensor
    wait_s: float = 0.0


def run_interleaved(
    steps: list[StepGen], experts: ExpertBackend, tally: ExpertTally | None = None
) -> list[torch.Tensor]:
    """Drive several forward passes (micro-batches), switching at every expert wait; counts the
    routed load and the expert wait into `tally`.

    Each micro-batch runs until it must wait for its routed experts (after it has dispatched
    them and computed its shared experts); then the next one runs. With two micro-batches this
    is the ping-pong schedule: one's expert RPCs are in flight while the other's attention runs.
    Returns each pass's result, in order.
    """
    results: list[torch.Tensor | None] = [None] * len(steps)
    waiting: dict[int, ExpertCombine] = {}
    uncombined: dict[int, Any] = {}  # id -> handle dispatched and not combined yet (cancelled on failure)

    def advance(i: int, reply) -> None:
        step = steps[i]
        try:
            msg = next(step) if reply is None else step.send(reply)
            while isinstance(msg, ExpertDispatch):
                if tally is not None:
                    tally.load[msg.moe_layer] += msg.expert_counts
                handle = experts.dispatch(msg)
                uncombined[id(handle)] = handle
                msg = step.send(handle)
            waiting[i] = msg
        except StopIteration as stop:
            results[i] = stop.value

    try:
        for i in range(len(steps)):
            advance(i, None)
        while waiting:
            for i in sorted(waiting):
                t0 = time.perf_counter()
                msg = waiting.pop(i)
                uncombined.pop(id(msg.handle), None)  # (combine consumes it, whatever it raises)
                routed = experts.combine(msg)
                if tally is not None:
                    tally.wait_s += time.perf_counter() - t0
                advance(i, routed)
    except BaseException:  # dispatches that will never be combined, this pass's or the others'
        cancel = getattr(experts, "cancel", None)
        for handle in uncombined.values() if cancel is not None else ():
            cancel(handle)
        raise
    return results
