"""Packed routed experts and the in-process expert backend.

`PackedExperts` is what an expert worker holds and what `LocalEngine` holds for all experts:
per MoE layer one `w13 [S, 2I, H]` and one `w2 [S, H, I]` tensor over the S physical experts
(slots) it serves, plus which logical expert each local slot holds, and `ffn`, the routed-expert
kernel its holder chose (kernels/select.py: Kernels.expert_ffn).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .checkpoint import CheckpointReader, load_expert_weights, load_expert_weights_fp8
from .config import ModelConfig
from .kernels.select import Kernels, select_kernels
from .messages import ExpertCombine, ExpertDispatch


class LayerTensors(NamedTuple):
    """A MoE layer's expert tensors (PackedExperts.layer_tensors)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    rows: torch.Tensor | None


@dataclass
class PackedExperts:
    w13: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer -> [S, 2I, H]
    w2: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer -> [S, H, I]
    logical: dict[int, list[int]] = field(default_factory=dict)  # decoder layer -> logical expert per slot
    swiglu_limit: float | None = None  # DeepSeek-V4: clamped SwiGLU (ModelConfig.swiglu_limit)
    # FP8 experts kept FP8 (w13 / w2 float8_e4m3fn): their block scales and the block shape
    w13_scale: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer -> [S, 2I/bn, H/bk]
    w2_scale: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder layer -> [S, H/bn, I/bk]
    fp8_block: tuple[int, int] | None = None  # (bn, bk) when the experts are held in FP8
    # decoder layer -> [S] int64 row of w13 / w2 each slot reads (an expert worker's rows are
    # shared between placement versions: services/experts/rows.py); absent: slot s is row s
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # the routed-expert kernel (Kernels.expert_ffn of the store or engine holding them): ffn(x,
    # slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, fp8_block)
    ffn: Callable | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        experts_per_layer: dict[int, list[int]],
        dtype: torch.dtype,
        progress=None,
        keep_fp8: bool = False,
    ) -> PackedExperts:
        """Read only the listed (decoder layer -> logical experts in slot order) expert tensors, in
        `dtype`, or (keep_fp8) FP8 experts as stored with their block scales."""
        packed = cls(fp8_block=reader.fp8_block if keep_fp8 else None)
        for n, (layer, experts) in enumerate(sorted(experts_per_layer.items())):
            if keep_fp8:
                w13, w2, packed.w13_scale[layer], packed.w2_scale[layer] = load_expert_weights_fp8(
                    reader, layer, experts
                )
            else:
                w13, w2 = load_expert_weights(reader, layer, experts, dtype)
            packed.w13[layer], packed.w2[layer] = w13, w2
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
        return self.forward_tensors(self.layer_tensors(layer), x, slot, weight, out)

    def layer_tensors(self, layer: int) -> LayerTensors:
        """One layer's tensors and slot -> row map, read together (an expert worker swaps them
        under its lock when a layer's rows grow: read them under it too)."""
        return LayerTensors(self.w13[layer], self.w2[layer], self.w13_scale.get(layer), self.w2_scale.get(layer),
                            self.rows.get(layer))  # fmt: skip

    def forward_tensors(self, t: LayerTensors, x, slot, weight, out=None) -> torch.Tensor:
        """`forward` on tensors read by `layer_tensors`, by `ffn`."""
        if t.rows is not None:  # (slots -> their rows; -1 stays -1)
            rows = t.rows.to(slot.device)
            slot = torch.where(slot >= 0, rows[slot.clamp(min=0).long()], slot.new_tensor(-1)).to(slot.dtype)
        if self.ffn is None:
            raise ValueError(
                "PackedExperts without a kernel (ffn): its holder selects one (kernels/select.py)"
            )
        return self.ffn(x, slot, weight, t.w13, t.w2, out, self.swiglu_limit, t.w13_scale, t.w2_scale,
                        self.fp8_block)  # fmt: skip

    def tensor_dicts(self) -> list[dict[int, torch.Tensor]]:
        return [self.w13, self.w2, self.w13_scale, self.w2_scale]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensor_dicts() for t in d.values())


class LocalExperts:
    """Expert backend that runs every routed expert in this process (slot == logical expert), on
    `kernels`' expert_ffn: an engine's (Engine gives its own to the in-process experts it runs),
    else chosen for experts computing in their weights' dtype on the CPU (`load_all`)."""

    def __init__(self, cfg: ModelConfig, packed: PackedExperts, kernels: Kernels):
        self.cfg, self.packed = cfg, packed
        self.use_kernels(kernels)

    def use_kernels(self, kernels: Kernels) -> None:
        """Compute with `kernels`' routed-expert kernel from now on."""
        self.kernels = kernels
        self.packed.ffn = kernels.expert_ffn

    @classmethod
    def load_all(
        cls,
        reader: CheckpointReader,
        cfg: ModelConfig,
        dtype: torch.dtype,
        progress=None,
        keep_fp8: bool = False,
        kernels: Kernels | None = None,
        mtp: bool = False,
    ):
        """Every routed expert, held in `dtype` (or FP8 as shipped: keep_fp8). kernels: the ones
        they compute with (None: selected for `dtype` on the CPU; `to` moves them along). mtp: the
        MTP modules' MoE layers' experts too (model/mtp.py), under their decoder-layer index."""
        if kernels is None:
            kernels = select_kernels("cpu", dtype, cfg, fp8_experts=keep_fp8, scope="experts")
        layers = cfg.moe_layers + ([i for i in cfg.mtp_layers if cfg.is_moe_layer(i)] if mtp else [])
        everything = {layer: list(range(cfg.n_routed_experts)) for layer in layers}
        packed = PackedExperts.load(reader, everything, dtype, progress, keep_fp8)
        packed.swiglu_limit = cfg.swiglu_limit
        return cls(cfg, packed, kernels)

    def to(self, device) -> LocalExperts:
        for d in self.packed.tensor_dicts():
            for k in d:
                d[k] = d[k].to(device)
        self.use_kernels(self.kernels.for_device(device))
        return self

    def dispatch(self, msg: ExpertDispatch) -> torch.Tensor:
        return self.packed.forward(msg.decoder_layer, msg.x, msg.topk_idx, msg.topk_weight)

    def combine(self, msg: ExpertCombine) -> torch.Tensor:
        return msg.handle
