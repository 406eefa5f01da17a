"""The routed experts' fused MoE in Triton: torch_ops.expert_ffn as two grouped GEMM kernels.

A layer's T tokens each pick K local slots (slot [T, K], -1 = skip), so there are P = T*K
(token, choice) pairs. `align_pairs` sorts the pairs by slot and pads each slot's group to a
multiple of BLOCK_M, so that every BLOCK_M-row block of the sorted order belongs to one slot.
Then:

1. `_gate_up_kernel`, one program per (M-block, BLOCK_N columns of I): gathers the block's token
   rows of x, multiplies them by the slot's gate and up rows of w13 (two fp32 accumulators over
   H), applies the (clamped) SwiGLU and stores the intermediate [EM, I] in x's dtype.
2. `_down_kernel`, one program per (M-block, BLOCK_N columns of H): intermediate @ w2[slot]^T
   over I, times the pair's routing weight, stored fp32 in a per-pair buffer [P, H].
3. torch sums the K choices of each token and casts to x's dtype.

Deterministic kernels (`deterministic=True`, kernels/deterministic.py): BLOCK_M is fixed
(DETERMINISTIC_BLOCK_M, not 16 or 64 by the pairs per slot), BLOCK_N / BLOCK_K / the grid's
per-block work never depend on T (each M-block holds one slot's pairs; a pair's products are its
row's K loop over H, then over I, in order), and the K choices are added in ascending slot order
from an fp32 zero with elementwise adds (`sum_in_slot_order`), not a torch reduction (whose
strategy on CUDA can follow the tensor's size): a token's output is the same whatever else is in
the call. (What the kernels give a pair does not depend on which row of its M-block it lands in:
the tensor cores sum every output of a tile in one order.)

The padded length EM is an upper bound computed from the shapes alone (each busy slot pads by at
most BLOCK_M - 1 rows), so nothing waits on the device and a CUDA graph can capture the whole
call; blocks past the busy slots are marked -1 and return at once.

Block-FP8 weights (DeepSeek's float8_e4m3fn checkpoints with `weight_scale_inv`) stay FP8 in
memory: each [BLOCK_K, BLOCK_N] tile is converted to x's dtype in the kernel and its dot product
scaled per output row (BLOCK_K divides the quantisation block's width, so a tile spans one column
block; its rows may span several row blocks, hence a per-row scale vector). GPUs without an e4m3
type in Triton (before sm_89: A100) read the weights' bytes as uint8, converted with integer ops
(`triton_linear.e4m3_bits_to_fp16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import hardware
from .hardware import INTERPRETED
from .triton_linear import TL_DTYPE, e4m3_bits_to_fp16

MAX_PAIRS = 32768  # (token, choice) pairs per kernel launch


def align_pairs(slot: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slot [T, K] int64 (-1 = skip) -> (sorted_pair [EM] int64, block_slot [EM / block_m] int64).

    sorted_pair lists the flat pair ids t*K + k grouped by slot (stable within a slot), each group
    padded to a multiple of block_m with the sentinel P = T*K; block_slot is the slot of each
    M-block, -1 for the unused blocks at the end. EM = P + min(S, P) * (block_m - 1) rounded up
    to block_m: known on the host, computed with device ops only (no sync, no loop over slots).
    """
    P, S, dev = slot.numel(), num_slots, slot.device
    EM = triton.cdiv(P + min(S, P) * (block_m - 1), block_m) * block_m
    flat = slot.reshape(-1).long()
    key = torch.where(flat >= 0, flat, S)  # skipped pairs sort last, into a dump row
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    counts = torch.zeros(S + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:S]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group = sorted_key.clamp(max=S - 1)
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[group]  # index within its slot
    dest = torch.where(sorted_key < S, padded_end[group] - padded[group] + rank, EM)
    sorted_pair = torch.full((EM + 1,), P, dtype=torch.int64, device=dev).scatter_(0, dest, order)[:EM]
    block_start = torch.arange(0, EM, block_m, device=dev)
    block_slot = torch.searchsorted(padded_end, block_start, right=True)
    return sorted_pair, torch.where(block_slot < S, block_slot, -1)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, sorted_pair_ptr, block_slot_ptr, inter_ptr,
    P, H, I, limit, stride_xt, stride_ws, stride_wn, stride_wk, stride_ss, stride_sn, stride_sk,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, FP8_BITS: tl.constexpr,
):  # fmt: skip
    """inter[m, n] = swiglu(x[token] . w13[slot, n], x[token] . w13[slot, I + n]) for the rows m
    of one M-block and columns n of one N-tile of I. x [T, H], w13 [S, 2I, H], scale [S,
    ceil(2I/QUANT_N), ceil(H/QUANT_K)] (FP8 only), inter [EM, I] in x's dtype."""
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    row_ok = pair < P
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (pair // K)[:, None] * stride_xt
    w_gate = w_ptr + slot * stride_ws + cols[None, :] * stride_wn  # [1, BLOCK_N]; + k: [BLOCK_K, BLOCK_N]
    w_up = w_gate + I * stride_wn
    s_gate = scale_ptr + slot * stride_ss + (cols // QUANT_N) * stride_sn  # [BLOCK_N] (FP8 only)
    s_up = scale_ptr + slot * stride_ss + ((cols + I) // QUANT_N) * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_ok = k < H
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_gate + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(w_up + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if FP8_BITS:
            wg, wu = e4m3_bits_to_fp16(wg), e4m3_bits_to_fp16(wu)
        wg, wu = wg.to(DOT_DTYPE), wu.to(DOT_DTYPE)
        if FP8:
            sg = tl.load(s_gate + (k0 // QUANT_K) * stride_sk, mask=col_ok, other=0.0)
            su = tl.load(s_up + (k0 // QUANT_K) * stride_sk, mask=col_ok, other=0.0)
            if FP8_BITS:
                sg, su = sg * 256.0, su * 256.0
            gate += tl.dot(a, wg, input_precision=PRECISION) * sg[None, :]
            up += tl.dot(a, wu, input_precision=PRECISION) * su[None, :]
        else:
            gate = tl.dot(a, wg, gate, input_precision=PRECISION)
            up = tl.dot(a, wu, up, input_precision=PRECISION)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate) * up
    out = inter_ptr + rows[:, None] * I + cols[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w_ptr, scale_ptr, sorted_pair_ptr, block_slot_ptr, route_ptr, pair_out_ptr,
    P, H, I, stride_ws, stride_wn, stride_wk, stride_ss, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, FP8_BITS: tl.constexpr,
):  # fmt: skip
    """pair_out[pair, n] = route[pair] * (inter[m] . w2[slot, n]) for the rows m of one M-block and
    columns n of one N-tile of H. inter [EM, I], w2 [S, H, I], scale [S, ceil(H/QUANT_N),
    ceil(I/QUANT_K)] (FP8 only), route [P] fp32, pair_out [P, H] fp32."""
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    row_ok = pair < P
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    w_cols = w_ptr + slot * stride_ws + cols[None, :] * stride_wn
    s_cols = scale_ptr + slot * stride_ss + (cols // QUANT_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + ks
        k_ok = k < I
        a_mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(inter_ptr + rows[:, None] * I + k[None, :], mask=a_mask, other=0.0).to(DOT_DTYPE)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8_BITS:
            w = e4m3_bits_to_fp16(w)
        w = w.to(DOT_DTYPE)
        if FP8:
            s = tl.load(s_cols + (k0 // QUANT_K) * stride_sk, mask=col_ok, other=0.0)
            if FP8_BITS:
                s = s * 256.0
            acc += tl.dot(a, w, input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    route = tl.load(route_ptr + pair, mask=row_ok, other=0.0)
    out = pair_out_ptr + pair[:, None] * H + cols[None, :]
    tl.store(out, acc * route[:, None], mask=row_ok[:, None] & col_ok[None, :])


def unsupported(dtype: torch.dtype, fp8_block: tuple[int, int] | None) -> str | None:
    """Why `fused_moe` cannot take activations of `dtype` with experts kept FP8 in `fp8_block`
    blocks (None: unquantized experts); None where it can."""
    if dtype not in TL_DTYPE:
        return f"{dtype} activations"
    if fp8_block is not None and (fp8_block[1] % min(64, fp8_block[1]) or fp8_block[1] < 16):
        return f"FP8 column blocks of {fp8_block[1]} (a multiple of 16 up to 64, or of 64)"
    return None


DETERMINISTIC_BLOCK_M = 64  # deterministic: one M-block size whatever the pairs per slot


def _blocks(
    P: int, S: int, fp8: bool, block_shape: tuple[int, int], deterministic: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): M-blocks of 16 rows while slots average <= 16 pairs (decode),
    else 64 (deterministic: DETERMINISTIC_BLOCK_M always); BLOCK_K divides the FP8 quantisation
    block's width."""
    block_m = DETERMINISTIC_BLOCK_M if deterministic else 16 if P <= 16 * S else 64
    block_k = 64
    if fp8:
        block_k = min(block_k, block_shape[1])
        if block_shape[1] % block_k or block_k < 16:
            raise ValueError(f"fused_moe: FP8 column block {block_shape[1]} needs a multiple of 16 up to 64")
    return block_m, 64, block_k


def fused_moe(
    x: torch.Tensor,
    slot: torch.Tensor,
    weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    out: torch.Tensor | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """torch_ops.expert_ffn on the GPU: x [T, H] fp32/bf16/fp16; slot [T, K] int64 (-1 =
    skip); weight [T, K] fp32; w13 [S, 2I, H] (gate rows, then up rows); w2 [S, H, I]. Returns
    [T, H] in x's dtype, the fp32 sum over k of weight[t, k] * w2[slot] @ swiglu(gate, up),
    written into `out` [T, H] when given. swiglu_limit: DeepSeek-V4's clamped SwiGLU.

    FP8 weights (float8_e4m3fn) come with w13_scale [S, ceil(2I/bn), ceil(H/bk)] and w2_scale [S,
    ceil(H/bn), ceil(I/bk)] fp32, block_shape = (bn, bk): the weight is the FP8 value times the
    scale of its (row block, column block) (fp8.dequantize_fp8_blocks).
    deterministic: batch-invariant (module docstring): fixed BLOCK_M, the choices summed in slot
    order.
    """
    T, K = slot.shape
    S, I2, H = w13.shape
    I = I2 // 2
    P = T * K
    fp8 = w13_scale is not None
    if w2.shape != (S, H, I) or x.shape != (T, H) or fp8 != (w2_scale is not None):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if fp8 != (w13.dtype == torch.float8_e4m3fn):
        raise ValueError(f"fused_moe: {w13.dtype} weights {'without' if not fp8 else 'with'} FP8 scales")
    result = out if out is not None else torch.empty(T, H, dtype=x.dtype, device=x.device)
    if P == 0:
        return result.zero_()
    if P > MAX_PAIRS:  # a long prefill: token chunks bound the [pairs, H] fp32 buffer (~1 GB at H = 7168)
        step = max(1, MAX_PAIRS // K)
        for t in range(0, T, step):
            fused_moe(x[t : t + step], slot[t : t + step], weight[t : t + step], w13, w2, swiglu_limit,
                      w13_scale, w2_scale, block_shape, result[t : t + step], deterministic)  # fmt: skip
        return result
    block_m, block_n, block_k = _blocks(P, S, fp8, block_shape, deterministic)
    quant_n, quant_k = block_shape if fp8 else (1, 1)
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_pair, block_slot = align_pairs(slot, S, block_m)
    EM = sorted_pair.numel()
    inter = torch.empty(EM, I, dtype=x.dtype, device=x.device)
    pair_out = torch.zeros(P, H, dtype=torch.float32, device=x.device)  # skipped pairs stay 0
    route = weight.reshape(-1).float().contiguous()
    s13 = w13_scale if fp8 else route  # (a placeholder pointer, never read)
    s2 = w2_scale if fp8 else route
    s13_strides = s13.stride() if fp8 else (0, 0, 0)
    s2_strides = s2.stride() if fp8 else (0, 0, 0)
    dot_dtype = tl.float32 if INTERPRETED else TL_DTYPE[x.dtype]
    precision = "ieee" if dot_dtype == tl.float32 else None  # fp32: no TF32 rounding
    num_m = EM // block_m
    bits = fp8 and not hardware.fp8_native(w13)  # (uint8 views of the FP8 bytes)
    w13, w2 = (w13.view(torch.uint8), w2.view(torch.uint8)) if bits else (w13, w2)
    _gate_up_kernel[(num_m * triton.cdiv(I, block_n),)](
        x, w13, s13, sorted_pair, block_slot, inter,
        P, H, I, float(swiglu_limit or 0.0), x.stride(0), *w13.stride(), *s13_strides,
        K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, QUANT_N=quant_n, QUANT_K=quant_k,
        HAS_LIMIT=swiglu_limit is not None, DOT_DTYPE=dot_dtype, PRECISION=precision, FP8_BITS=bits,
    )  # fmt: skip
    _down_kernel[(num_m * triton.cdiv(H, block_n),)](
        inter, w2, s2, sorted_pair, block_slot, route, pair_out,
        P, H, I, *w2.stride(), *s2_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, QUANT_N=quant_n, QUANT_K=quant_k,
        DOT_DTYPE=dot_dtype, PRECISION=precision, FP8_BITS=bits,
    )  # fmt: skip
    if deterministic:
        return result.copy_(sum_in_slot_order(pair_out.view(T, K, H), slot))
    summed = pair_out.view(T, K, H).sum(1)
    return result.copy_(summed)


def sum_in_slot_order(pair_out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """pair_out [T, K, H] fp32 (each (token, choice)'s weighted output; 0 for skipped choices),
    slot [T, K] -> [T, H] fp32: each token's K outputs added in ascending slot order (skipped
    ones, -1, first: zeros) from zero, K elementwise adds (the order the CPU's deterministic
    experts and the model's `sum_choices` add them in: slot == expert in process)."""
    T, K, H = pair_out.shape
    order = slot.argsort(dim=1, stable=True)  # [T, K]
    ordered = pair_out.gather(1, order[:, :, None].expand(T, K, H))
    acc = torch.zeros(T, H, dtype=torch.float32, device=pair_out.device)
    for j in range(K):
        acc.add_(ordered[:, j])
    return acc
