"""Packed routed experts and the in-process expert backend.

`PackedExperts` is what an expert worker holds and what `LocalEngine` holds for all experts:
per MoE layer one `w13 [S, 2I, H]` and one `w2 [S, H, I]` tensor over the S physical experts
(slots) it serves, plus which logical expert each local slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .checkpoint import CheckpointReader, load_expert_weights
from .config import ModelConfig
from .layers import grouped_expert_ffn
from .model import ExpertCombine, ExpertDispatch


@dataclass
class PackedExperts:
    w13: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer -> [S, 2I, H]
    w2: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer -> [S, H, I]
    logical: dict[int, list[int]] = field(default_factory=dict)  # decoder layer -> logical expert per slot
    swiglu_limit: float | None = None  # DeepSeek-V4: clamped SwiGLU (ModelConfig.swiglu_limit)

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        experts_per_layer: dict[int, list[int]],
        dtype: torch.dtype,
        progress=None,
    ) -> PackedExperts:
        """Read only the listed (decoder layer -> logical experts in slot order) expert tensors."""
        packed = cls()
        for n, (layer, experts) in enumerate(sorted(experts_per_layer.items())):
            packed.w13[layer], packed.w2[layer] = load_expert_weights(reader, layer, experts, dtype)
            packed.logical[layer] = list(experts)
            if progress is not None:
                progress(n + 1, len(experts_per_layer))
        return packed

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        slot: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H], slot [T, K] local slot ids (-1 = none), weight [T, K] -> [T, H] (into `out`
        when given)."""
        return grouped_expert_ffn(x, slot, weight, self.w13[layer], self.w2[layer], out, self.swiglu_limit)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.w13, self.w2) for t in d.values())


class LocalExperts:
    """Expert backend that runs every routed expert in this process (slot == logical expert)."""

    def __init__(self, cfg: ModelConfig, packed: PackedExperts):
        self.cfg, self.packed = cfg, packed

    @classmethod
    def load_all(cls, reader: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype, progress=None):
        everything = {layer: list(range(cfg.n_routed_experts)) for layer in cfg.moe_layers}
        packed = PackedExperts.load(reader, everything, dtype, progress)
        packed.swiglu_limit = cfg.swiglu_limit
        return cls(cfg, packed)

    def to(self, device) -> LocalExperts:
        for d in (self.packed.w13, self.packed.w2):
            for k in d:
                d[k] = d[k].to(device)
        return self

    def dispatch(self, msg: ExpertDispatch) -> torch.Tensor:
        return self.packed.forward(msg.decoder_layer, msg.x, msg.topk_idx, msg.topk_weight)

    def combine(self, msg: ExpertCombine) -> torch.Tensor:
        return msg.handle
