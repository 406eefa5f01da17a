"""DeepSeek's block-FP8 weight format: float8_e4m3fn values with one fp32 scale per (bn, bk) block
(`weight_scale_inv` in the checkpoints: dequantisation multiplies; edge blocks may be partial,
e.g. the 576-row kv_a_proj_with_mqa of DeepSeek-V3), and `Fp8Weight`, a linear kept in it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)


FP8_DEQUANT_BYTES = 1 << 30  # FP8 weights dequantized at once where a torch path computes with them


def fp8_scale_shape(weight_shape: Sequence[int], block: tuple[int, int]) -> tuple[int, int]:
    """The block-scale grid of an [M, N] weight in (bm, bn) blocks: (ceil(M/bm), ceil(N/bn))."""
    (m, n), (bm, bn) = weight_shape, block
    return -(-m // bm), -(-n // bn)


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [M, N] fp8, scale_inv [ceil(M/bm), ceil(N/bn)] fp32 -> fp32 [M, N] = w * scale of its block."""
    bm, bn = block
    m, n = w.shape
    if scale_inv.shape != fp8_scale_shape(w.shape, block):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(w.shape)} "
            f"with {bm}x{bn} blocks"
        )
    scale = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return w.float() * scale


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `dequantize_fp8_blocks` (used to write FP8 test checkpoints).

    w [M, N] -> (fp8 e4m3 [M, N], scale_inv fp32 [ceil(M/bm), ceil(N/bn)]) on w's device, scale = amax/448.
    """
    bm, bn = block
    m, n = w.shape
    gm, gn = (m + bm - 1) // bm, (n + bn - 1) // bn
    padded = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=w.device)
    padded[:m, :n] = w.float()
    blocks = padded.view(gm, bm, gn, bn)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).view(gm * bm, gn * bn)[:m, :n]
    return q.to(torch.float8_e4m3fn), scale


class Fp8Weight(NamedTuple):
    """A linear's weight kept as a DeepSeek FP8 checkpoint stores it: weight [N, K] float8_e4m3fn and
    scale [ceil(N / bn), ceil(K / bk)] fp32 (its `weight_scale_inv`: a value is its FP8 number
    times its block's scale), block (bn, bk). The FP8 linear kernels compute with it as it is."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """fp32 [n, K]: the values of weight rows `rows` (whole blocks where the slice starts)."""
        start = rows.start or 0
        if start % self.block[0]:
            raise ValueError(f"a dequantised row range must start on a block ({self.block[0]} rows)")
        scale = self.scale[start // self.block[0] :]
        w = self.weight[rows]
        return dequantize_fp8_blocks(w, scale[: fp8_scale_shape(w.shape, self.block)[0]], self.block)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)

    @staticmethod
    def stack_rows(parts: Sequence[Fp8Weight]) -> Fp8Weight:
        """The rows of `parts` one after the other (a dense MLP's gate and up): each part's rows
        must fill whole blocks but the last's."""
        block = parts[0].block
        if any(p.block != block for p in parts) or any(p.shape[0] % block[0] for p in parts[:-1]):
            raise ValueError(f"FP8 weights stacked by rows must fill whole {block[0]}-row blocks")
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), block)
