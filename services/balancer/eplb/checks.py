"""Argument checks shared by the EPLB entry points.

Validation of loads (``_as_weight``), of the slot layout (``_check_layout``), of placements
(``_as_placement``, ``_check_placement``, ``_check_current``), the published rule that picks the
hierarchical or the global policy (``_is_hierarchical``), and ``_old_in_new_layout``, which shows a
previous placement in a (possibly resized) new slot layout. Every check raises ``ValueError`` naming
the violated constraint.
"""

from __future__ import annotations

import numpy as np
import torch


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
