"""GPUs shared by several workers: each process held to the share Ray gave it.

Ray hands an actor a fraction of a GPU (`attention_gpus` / `expert_gpus` below 1: one H200 holding
one attention worker and two expert workers at 0.5 / 0.25 / 0.25) but does not enforce it: any
process may take all of the device's memory. `limit_gpu_memory` caps this process's CUDA caching
allocator at its share of the device, so the budgets of the workers on one GPU add up to at most
the GPU, and one that outgrows its share fails with an out-of-memory error of its own instead of
starving its neighbours.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def gpu_share(assigned: dict[str, float]) -> float | None:
    """The fraction of one GPU in Ray's `assigned` resources; None for none or a whole GPU (or more)."""
    share = float(assigned.get("GPU", 0.0))
    return share if 0.0 < share < 1.0 else None


def limit_gpu_memory() -> float | None:
    """In a Ray actor given part of a GPU, cap this process's CUDA memory at that part of the
    device; the fraction set (None: nothing to cap)."""
    import ray

    if not torch.cuda.is_available() or not ray.is_initialized():  # (no GPU, or not in a Ray worker)
        return None
    share = gpu_share(ray.get_runtime_context().get_assigned_resources())
    if share is None:
        return None
    torch.cuda.set_per_process_memory_fraction(share, torch.cuda.current_device())
    log.info("CUDA memory of this process capped at %.2f of %s", share, torch.cuda.get_device_name())
    return share
