"""Linears whose weights are kept FP8 (DeepSeek's block-FP8 checkpoints), in Triton.

y = x @ W^T + bias, W being its float8_e4m3fn values times the scale of their (row block, column
block) (`weight_scale_inv`, fp8.dequantize_fp8_blocks). Weight-only FP8: each [BLOCK_K,
BLOCK_N] weight tile is converted to x's dtype in the kernel and its dot product scaled per
output column (BLOCK_K divides the quantisation block's width, so a tile spans one column block;
its columns may span several row blocks of W, hence a per-column scale vector), the sums in fp32.
The weights stay 1 byte each in memory, as in triton_moe's FP8 experts. On GPUs without an e4m3
type in Triton (before sm_89: A100) the kernels read the weights' bytes as uint8 and convert them
with integer ops (`e4m3_bits_to_fp16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import hardware
from .hardware import INTERPRETED

# the activation dtypes the kernels take (shared by triton_mla and triton_moe)
TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def e4m3_bits_to_fp16(bits):
    """uint8 bits of float8_e4m3fn values -> fp16 values 256 times smaller, exactly: e4m3's sign,
    4 exponent and 3 mantissa bits go to fp16's sign, low 4 exponent and top 3 mantissa bits, and
    the exponent biases (7 and 15) differ by 8; subnormals stay subnormals. (The caller multiplies
    the 256 back into the block's scale. e4m3's NaN becomes 1.875: checkpoints hold none.)"""
    b = bits.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym,
    stride_ys, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    FP8_BITS: tl.constexpr,
):  # fmt: skip
    """y[split, m, n] = sum over the split's k of x[m, k] * w[n, k] * scale[n // QUANT_N, k //
    QUANT_K] (+ bias[n] in split 0) for one [BLOCK_M, BLOCK_N] tile; split = program_id(2) covers
    k in [split * K_PER_SPLIT, +K_PER_SPLIT) (a multiple of BLOCK_K). x [M, K], w [N, K] FP8, scale
    [ceil(N/QUANT_N), ceil(K/QUANT_K)]; y [splits, M, N] (one split: y itself, in x's dtype).
    FP8_BITS: w holds the FP8 values' bytes as uint8 (GPUs without e4m3)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    s_cols = scale_ptr + (cols // QUANT_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = split * K_PER_SPLIT
    for k0 in range(start, tl.minimum(start + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        s = tl.load(s_cols + k0 // QUANT_K, mask=col_ok, other=0.0)
        if FP8_BITS:
            w, s = e4m3_bits_to_fp16(w), s * 256.0
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION) * s[None, :]
    if HAS_BIAS:  # (added once: by split 0)
        first = (tl.zeros([BLOCK_N], tl.int32) + split) == 0
        acc += tl.load(bias_ptr + cols, mask=col_ok & first, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _splits(tiles: int, k_blocks: int, device: torch.device) -> int:
    """Splits of K: enough programs to fill the GPU about twice over at decode sizes (kv_a's 576
    outputs are 9 tiles of 64: 9 programs for 132 SMs without splits), each split at least 4 K
    tiles; a power of two."""
    units = hardware.multiprocessors(device)
    want = max(1, min(-(-2 * units // tiles), k_blocks // 4))
    return 1 << (want.bit_length() - 1)  # (the power of two at or below)


def unsupported(dtype: torch.dtype, block: tuple[int, int]) -> str | None:
    """Why `fp8_linear` cannot take activations of `dtype` with FP8 blocks `block` (None: it can)."""
    if dtype not in TL_DTYPE:
        return f"{dtype} activations"
    if block[1] % 16:
        return f"FP8 column blocks of {block[1]} (a multiple of 16 needed)"
    return None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [..., K] fp32/bf16/fp16, weight [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)]
    fp32, block (bn, bk), bias [N] -> [..., N] in x's dtype. `splits` of K (heuristic: `_splits`)
    are summed in fp32 in a fixed order (deterministic). ValueError where the kernel does not
    apply (another weight dtype, a column block that is not a multiple of 16: `unsupported`)."""
    N, K = weight.shape
    bn, bk = block
    block_k = 64 if bk % 64 == 0 else 32 if bk % 32 == 0 else 16  # a power of two dividing bk
    problem = unsupported(x.dtype, block) or (
        weight.dtype != torch.float8_e4m3fn and f"{weight.dtype} weights"
    )
    if problem:
        raise ValueError(f"fp8_linear: {problem}")
    if x.shape[-1] != K or scale.shape != (-(-N // bn), -(-K // bk)):
        raise ValueError(
            f"fp8_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)}"
        )
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    scale = scale.float().contiguous()
    M = x2.shape[0]
    if M == 0:
        return torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    block_m, block_n = (16 if M <= 16 else 64), 64  # decode sizes: small M tiles, many N tiles
    grid_mn = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    k_blocks = triton.cdiv(K, block_k)
    splits = max(1, min(splits or _splits(grid_mn[0] * grid_mn[1], k_blocks, x.device), k_blocks))
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(K, k_per_split)  # (no empty split)
    y = (torch.empty(M, N, dtype=x.dtype, device=x.device) if splits == 1
         else torch.empty(splits, M, N, dtype=torch.float32, device=x.device))  # fmt: skip
    dot_dtype = tl.float32 if INTERPRETED else TL_DTYPE[x.dtype]
    bits = not hardware.fp8_native(weight)
    weight = weight.view(torch.uint8) if bits else weight  # (the FP8 bytes, converted in the kernel)
    _fp8_linear_kernel[(*grid_mn, splits)](
        x2, weight, scale, scale if bias is None else bias, y, M, N, K, k_per_split, x2.stride(0),
        weight.stride(0), scale.stride(0), y.stride(-2), y.stride(0) if splits > 1 else 0,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, QUANT_N=bn, QUANT_K=bk,
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else None, FP8_BITS=bits,
    )  # fmt: skip
    if splits > 1:
        y = y.sum(0).to(x.dtype)
    return y.view(*x.shape[:-1], N)
