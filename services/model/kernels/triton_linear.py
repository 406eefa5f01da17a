"""Linears whose weights are kept FP8 (DeepSeek's block-FP8 checkpoints), in Triton.

y = x @ W^T + bias, W being its float8_e4m3fn values times the scale of their (row block, column
block) (`weight_scale_inv`, fp8.dequantize_fp8_blocks). Weight-only FP8: each [BLOCK_K,
BLOCK_N] weight tile is converted to x's dtype in the kernel and its dot product scaled per
output column (BLOCK_K divides the quantisation block's width, so a tile spans one column block;
its columns may span several row blocks of W, hence a per-column scale vector), the sums in fp32.
The weights stay 1 byte each in memory, as in triton_moe's FP8 experts. On GPUs without an e4m3
type in Triton (before sm_89: A100) the kernels read the weights' bytes as uint8 and convert them
with integer ops (`e4m3_bits_to_fp16`).

Batch-invariant linears (deterministic kernels, kernels/deterministic.py; Thinking Machines'
"batch-invariant ops"): `linear` / `batched_linear`, a plain GEMM with ONE tile configuration per
dtype whatever M (`GEMM_TILES`), each output's K loop in order from an fp32 zero, no split-K, so a
row's sums do not depend on how many rows share the call; and `fp8_linear(deterministic=True)`:
fixed M tiles and no split of K.
"""

from __future__ import annotations

from dataclasses import dataclass

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


DETERMINISTIC_FP8_BLOCK_M = 64  # the FP8 linear's M tile under deterministic (any M), K unsplit


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    splits: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """x [..., K] fp32/bf16/fp16, weight [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)]
    fp32, block (bn, bk), bias [N] -> [..., N] in x's dtype. `splits` of K (heuristic: `_splits`)
    are summed in fp32 in a fixed order (deterministic). ValueError where the kernel does not
    apply (another weight dtype, a column block that is not a multiple of 16: `unsupported`).
    deterministic: batch-invariant (M tiles of DETERMINISTIC_FP8_BLOCK_M rows whatever M, one
    split of K: each output's K loop in order), `splits` ignored."""
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
    if deterministic:  # (the M tile and the splits would follow M)
        block_m, splits = DETERMINISTIC_FP8_BLOCK_M, 1
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


# ---------------------------------------------------------------------------------------------
# Batch-invariant plain GEMMs (deterministic kernels)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmTiles:
    """The one tile configuration of `batched_linear` for a dtype (whatever M)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# 16-bit: 64 x 64 output tiles over 64-wide K steps (tensor cores; at decode sizes the weight
# reads dominate, so the unused rows of a 64-row tile cost little); fp32 (exact IEEE products, no
# TF32): half the K step, for registers
GEMM_TILES = {
    torch.bfloat16: GemmTiles(64, 64, 64, 4, 3),
    torch.float16: GemmTiles(64, 64, 64, 4, 3),
    torch.float32: GemmTiles(64, 64, 32, 4, 2),
}


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk,
    stride_yb, stride_ym, stride_yn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """y[b, m, n] = sum_k x[b, m, k] * w[b, n, k] (+ bias[n]) for one [BLOCK_M, BLOCK_N] tile of
    batch b = program_id(2): the K tiles in ascending order into one fp32 accumulator (the masked
    tail adds zeros), so an output's arithmetic is the same whatever M is and whatever the other
    rows hold. Any strides (x and w read in their own dtypes, converted to DOT_DTYPE)."""
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + b.to(tl.int64) * stride_wb + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + b.to(tl.int64) * stride_yb + rows.to(tl.int64)[:, None] * stride_ym
    tl.store(
        y + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
    )


def batched_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Batch-invariant y[b] = x[b] @ w[b]^T (+ bias): x [B, M, K] (any strides), w [B, N, K] (any
    strides; stored narrower than x, bf16 under fp32, it is widened in the kernel), bias [N] ->
    [B, M, N] in out_dtype (default x's). One tile shape per x dtype (GEMM_TILES) whatever M, no
    split of K: a row of x gets the same bits alone as among any other rows. ValueError for
    dtypes the kernel does not take."""
    B, M, K = x.shape
    N = w.shape[1]
    if x.dtype not in GEMM_TILES or w.shape != (B, N, K):
        raise ValueError(f"batched_linear: x {x.dtype} {list(x.shape)}, w {w.dtype} {list(w.shape)}")
    tiles = GEMM_TILES[x.dtype]
    y = torch.empty(B, M, N, dtype=out_dtype or x.dtype, device=x.device)
    if B * M * N == 0:
        return y.zero_() if K == 0 else y
    fp32 = x.dtype == torch.float32
    dot_dtype = tl.float32 if INTERPRETED or fp32 else TL_DTYPE[x.dtype]
    grid = (triton.cdiv(M, tiles.block_m), triton.cdiv(N, tiles.block_n), B)
    _gemm_kernel[grid](
        x, w, w if bias is None else bias, y, M, N, K, *x.stride(), *w.stride(), *y.stride(),
        HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant F.linear: x [..., K], w [N, K] (fp32 / bf16 / fp16; widened to x's dtype in
    the kernel), bias [N] -> [..., N] in x's dtype (`batched_linear` with one batch)."""
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    return batched_linear(x2[None], w[None], bias)[0].view(*x.shape[:-1], N)
