"""DeepSeek-V3's rotary embedding: the frequencies (plain or YaRN) and the positions' cos / sin.

The model math of the other layers (norms, the router, the dense and expert MLPs) is a kernel
family each: its torch reference is in kernels/torch_ops.py, and which implementation runs it is
chosen once per model (kernels/select.py).
"""

from __future__ import annotations

import torch

from .config import ModelConfig, rope_inv_freq
from .kernels import torch_ops


class Rope:
    """Rotary embedding (plain or YaRN) for the qk_rope_head_dim part of q and k.

    With `interleave` (DeepSeek-V3 weights) pairs (x[2i], x[2i+1]) are rotated by frequency i and
    the output keeps that interleaved layout (as DeepSeek's own code and vLLM/SGLang do; HF
    de-interleaves, which gives the same scores). Without it, the neox rotate-half form is used.
    The model applies it with its kernels' `rope` (kernels/select.py); `apply` is the torch
    reference.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)
        self.interleave = cfg.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] in `dtype` (computed in fp32, like HF)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (
            (freqs.cos() * self.attention_factor).to(dtype),
            (freqs.sin() * self.attention_factor).to(dtype),
        )

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., R] with cos/sin [T, R/2] -> rotated x, same shape and layout (torch)."""
        if self.interleave:
            return torch_ops.rope_interleaved(x, cos, sin)
        return torch_ops.rope_neox(x, cos, sin)
