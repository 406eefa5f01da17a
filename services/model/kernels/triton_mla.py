"""MLA decode attention over the paged latent cache, in Triton (split-KV, "flash decoding").

The absorbed decode form of model.mla_forward: each decode row's N latent queries q [N, C+R]
score the rows [c_kv | k_pe] of its context in the paged cache [blocks, 64, 1, W] (FlashMLA's
layout, W >= C+R) and take the softmax-weighted sum of their first C values. The context is cut
into `splits` ranges of whole 64-row blocks (each row's own: cdiv(blocks, splits) per range, at
least MIN_SPLIT_BLOCKS); stage 1 runs one program per (group of BLOCK_H heads, row, split) with an
online softmax over the split's rows and writes a partial output and its log-sum-exp; stage 2
merges a row's splits (with one split, stage 1 writes the output and there is no stage 2). The
number of splits comes from the block table's width, not from the lengths, so launching needs no
device-to-host copy (a CUDA graph can capture it); a split past the end of a row's context writes
only its log-sum-exp (-inf).

Every group of heads reads each cache row once for all of them (DeepSeek-V3 has 128 heads sharing
one latent KV head): 16 heads per program and tiles of 32 rows by default (SGLang's Triton MLA
decode sizes), 64 heads and tiles of 64 rows on Hopper-class GPUs at batches of 8 and more, and
at every batch over FP8 rows (`decode_tiles`, chosen from bench_kernels' sweeps). Softmax and
sums in fp32 whatever the cache dtype.

The same kernel runs prefill on the GPU (gpu.TritonKernels.mla_prefill): a chunk's queries are rows of
their own causal lengths over one block table.

Deterministic kernels (`mla_decode(deterministic=True)`, kernels/deterministic.py): the splits
above come from the batch (its size, the table's width), so a row's online softmax was cut at
other places in another batch. Under the flag each row is cut by its own length alone: splits of
DETERMINISTIC_SPLIT_BLOCKS blocks, or for rows of more than DETERMINISTIC_MAX_SPLITS such splits,
cdiv(blocks, DETERMINISTIC_MAX_SPLITS) blocks each (so a split's partials stay bounded); the
launch's SPLITS only has to cover the widest row (the trailing splits of shorter rows are empty),
and the merge skips an empty split outright (its running maximum, sum and output keep their bits),
so a row gets the same bits whatever the launch's SPLITS; the tile shape does not follow the batch
either (`decode_tiles(..., deterministic=True)`). Prefill rows run the same kernel: a token's
attention is the same in a prompt chunk as decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.model.kv_cache import BLOCK_SIZE, FP8_GROUP, fp8_latent_bytes

from . import hardware
from .hardware import INTERPRETED
from .triton_linear import TL_DTYPE, e4m3_bits_to_fp16


@triton.jit
def _fp8_rows(cache_ptr, scale_ptr, rope_ptr, row, ok, c, r, C, R, W, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """One tile of FP8 latent rows (kv_cache.quantize_latent_rows' layout, W bytes each: [c_kv as
    e4m3 | C / GROUP fp32 scales | k_pe as bf16 | V3.2's key, the pad: not read]) -> (c_kv [rows,
    BLOCK_C], k_pe [rows, BLOCK_R])
    in fp32, the values `kv_cache.dequantize_latent_rows` gives. scale_ptr / rope_ptr: the same
    bytes as fp32 / bf16 (W / 4 and W / 2 of them per row). The e4m3 bits become fp16 values 256
    times smaller (exact), and the 256 goes into the scale: the product is the torch path's."""
    ok_c = ok[:, None] & (c[None, :] < C)
    bits = tl.load(cache_ptr + row[:, None] * W + c[None, :], mask=ok_c, other=0)
    g = tl.arange(0, BLOCK_C // GROUP)
    s = tl.load(scale_ptr + row[:, None] * (W // 4) + C // 4 + g[None, :],
                mask=ok[:, None] & (g[None, :] < C // GROUP), other=0.0)  # fmt: skip
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_C // GROUP, GROUP)), (BLOCK_N, BLOCK_C))
    kv_c = e4m3_bits_to_fp16(bits).to(tl.float32) * (s * 256.0)
    rope = rope_ptr + row[:, None] * (W // 2) + (C + 4 * (C // GROUP)) // 2 + r[None, :]
    k_r = tl.load(rope, mask=ok[:, None] & (r[None, :] < R), other=0.0).to(tl.float32)
    return kv_c, k_r


@triton.jit
def _mla_decode_split(
    q_ptr, cache_ptr, scale_ptr, rope_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
    N, C, R, W, stride_q_b, stride_q_n, stride_table_b, scale, SPARSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, MAX_ROW_SPLITS: tl.constexpr,
):  # fmt: skip
    """Stage 1: the softmax of heads [BLOCK_H] of row b over its split's context rows.
    mid_o [B, N, SPLITS, C] fp32 (normalised by the split's own sum; not written for a split past
    the end of the row's context), mid_lse [B, N, SPLITS] (-inf there); with one split, the
    output itself: mid_o is o [B, N, C] in its dtype and mid_lse is not used.
    SPARSE: table_ptr holds each row's chosen flat cache rows (V3.2's top-k), not block ids.
    FP8: the cache holds FP8 latent rows (`_fp8_rows`), dequantised per tile to q's dtype.
    The head group is the fastest-varying program id: a row's groups run side by side and read
    its cache rows once from memory between them (the others hit the L2).
    MAX_ROW_SPLITS (deterministic; 0: off): a row's split size from its own length only,
    max(MIN_BLOCKS, cdiv(blocks, MAX_ROW_SPLITS)) blocks, not from SPLITS."""
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1)
    split = tl.program_id(2)
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    head_ok = heads < N
    q_rows = q_ptr + b * stride_q_b + heads[:, None] * stride_q_n
    q_c = tl.load(q_rows + c[None, :], mask=head_ok[:, None] & (c[None, :] < C), other=0.0)
    q_r = tl.load(q_rows + C + r[None, :], mask=head_ok[:, None] & (r[None, :] < R), other=0.0)
    if UPCAST:
        q_c, q_r = q_c.to(tl.float32), q_r.to(tl.float32)

    length = tl.load(lens_ptr + b).to(tl.int32)
    # this row's context in whole blocks, at least MIN_BLOCKS per split (the last splits may be empty)
    if MAX_ROW_SPLITS > 0:  # (deterministic: the row's own cut, whatever the launch's SPLITS)
        per_split = tl.maximum(tl.cdiv(tl.cdiv(length, PAGE), MAX_ROW_SPLITS), MIN_BLOCKS) * PAGE
    else:
        per_split = tl.maximum(tl.cdiv(tl.cdiv(length, PAGE), SPLITS), MIN_BLOCKS) * PAGE
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for s in range(start, end, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        if SPARSE:
            row = tl.load(table_ptr + b * stride_table_b + pos, mask=pos_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table_ptr + b * stride_table_b + pos // PAGE, mask=pos_ok, other=0)
            row = block.to(tl.int64) * PAGE + pos % PAGE
        if FP8:
            kv_c, k_r = _fp8_rows(
                cache_ptr, scale_ptr, rope_ptr, row, pos_ok, c, r, C, R, W, GROUP, BLOCK_N, BLOCK_C
            )
            if q_ptr.dtype.element_ty != tl.float32:  # rounded to q's dtype as torch rounds
                kv_c = kv_c.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
                k_r = k_r.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            rows = cache_ptr + row * W
            kv_c = tl.load(rows[:, None] + c[None, :], mask=pos_ok[:, None] & (c[None, :] < C), other=0.0)
            k_r = tl.load(rows[:, None] + C + r[None, :], mask=pos_ok[:, None] & (r[None, :] < R), other=0.0)
        if UPCAST:
            kv_c, k_r = kv_c.to(tl.float32), k_r.to(tl.float32)
        score = tl.dot(q_c, tl.trans(kv_c), input_precision=PRECISION)
        score += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        score = tl.where(pos_ok[None, :], score * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 1))
        p = tl.exp(score - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c, input_precision=PRECISION)
        m = m_new

    out = mid_o_ptr + ((b * N + heads[:, None]) * SPLITS + split) * C + c[None, :]
    empty = total == 0.0  # a split past the end of the context: weight 0 in stage 2
    mask = head_ok[:, None] & (c[None, :] < C) & ~empty[:, None]
    tl.store(out, (acc / total[:, None]).to(mid_o_ptr.dtype.element_ty), mask=mask)
    if SPLITS > 1:
        lse = mid_lse_ptr + (b * N + heads) * SPLITS + split
        tl.store(lse, tl.where(empty, float("-inf"), m + tl.log(total)), mask=head_ok)


@triton.jit
def _mla_decode_merge(
    mid_o_ptr, mid_lse_ptr, o_ptr, N, C,
    BLOCK_C: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Stage 2: o[b, n] = sum_s exp(lse_s - lse) * mid_o[b, n, s] for one (row b, head n), the
    splits merged one by one (a running maximum, as the online softmax). An empty split (lse
    -inf: past the end of the row's context) is skipped, not merged with weight 0, so a row's bits
    do not depend on how many empty splits follow its own."""
    bn = tl.program_id(0)  # b * N + n
    c = tl.arange(0, BLOCK_C)
    top = tl.load(mid_lse_ptr + bn * SPLITS)  # split 0 is never empty (lens >= 1)
    total = tl.zeros([1], tl.float32) + 1.0
    acc = tl.load(mid_o_ptr + bn * SPLITS * C + c, mask=c < C, other=0.0)
    for s in range(1, SPLITS):  # (one split at a time: SPLITS x C values would not fit in registers)
        lse = tl.load(mid_lse_ptr + bn * SPLITS + s)
        new_top = tl.maximum(top, lse)
        keep, add = tl.exp(top - new_top), tl.exp(lse - new_top)
        written = tl.where(lse > float("-inf"), C, 0)  # (an empty split's partial: not written, not read)
        part = tl.load(mid_o_ptr + (bn * SPLITS + s) * C + c, mask=c < written, other=0.0)
        used = lse > float("-inf")
        acc = tl.where(used, acc * keep + add * part, acc)
        total = tl.where(used, total * keep + add, total)
        top = tl.where(used, new_top, top)
    tl.store(o_ptr + bn * C + c, (acc / total).to(o_ptr.dtype.element_ty), mask=c < C)


@dataclass(frozen=True)
class DecodeTiles:
    """Stage 1's tile shape: heads per program (block_h: its [block_h, C] fp32 accumulator), cache
    rows per step (block_n; halved for fp32), and the launch's warps and pipeline stages."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


DECODE_TILES = DecodeTiles()  # SGLang's Triton MLA decode sizes: 16 heads x C = 512 fp32 is 32 KB
# of registers per program, two [32, 576] bf16 row tiles in flight
WIDE_TILES = DecodeTiles(block_h=64, block_n=64, num_warps=8, num_stages=2)  # a quarter of the
# programs each reading a row once for 64 heads; measured on an H200 (bench_kernels' mla_sweep,
# V3 shapes, bf16): 1.9x the default at batch 64 / 4K context, 1.4x at batch 8, 0.8x at batch 1


FP8_TILES = DECODE_TILES  # FP8 rows: each tile is dequantised to fp32 in registers first. Measured on
# an H200 (bench_kernels' mla_fp8, V3 shapes, 4K context): at batch 8 / 64 these 16-head tiles ran
# 1.5-1.6x the same tiles with 8 warps (which do not spill: these spill 24 bytes on sm_90)
FP8_WIDE_TILES = WIDE_TILES  # and these the fastest of six shapes at batch 1, 8 and 64 (1.2-2.9x
# the 16-head tiles; 189 KB of shared memory: Hopper-class GPUs only)


def decode_tiles(
    batch: int,
    heads: int,
    dtype: torch.dtype,
    device: torch.device,
    fp8_rows: bool = False,
    deterministic: bool = False,
) -> DecodeTiles:
    """WIDE_TILES for 64 heads or more (V3's 128; fewer would leave a program's heads masked),
    16-bit rows and batches of 8 or more on Hopper-class GPUs (their 227 KB of shared memory per
    block hold its tiles); DECODE_TILES otherwise (at small batches more programs win). FP8 rows
    (fp8_rows): FP8_WIDE_TILES at any batch, on the same other terms, else FP8_TILES.
    deterministic: the same tiles at every batch (those of batches of 8 and more)."""
    wide = heads >= 64 and dtype != torch.float32 and hardware.hopper_or_newer(device)
    if fp8_rows:
        return FP8_WIDE_TILES if wide else FP8_TILES
    return WIDE_TILES if wide and (batch >= 8 or deterministic) else DECODE_TILES


MIN_SPLIT_BLOCKS = 4  # cache blocks per split at least: a split's partials (heads x C fp32, 256 KB
# on V3) are written and read back once, its rows (64 x 576 bf16 per block, 74 KB) read once

# deterministic: splits of this many blocks (256 rows), up to DETERMINISTIC_MAX_SPLITS per row
# (longer rows: cdiv(blocks, DETERMINISTIC_MAX_SPLITS) blocks a split); a launch's partials are
# bounded by running at most DETERMINISTIC_MID_BYTES of them at a time (rows are independent)
DETERMINISTIC_SPLIT_BLOCKS = MIN_SPLIT_BLOCKS
DETERMINISTIC_MAX_SPLITS = 32
DETERMINISTIC_MID_BYTES = 1 << 29


def _splits(batch: int, head_groups: int, max_blocks: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice over, a power of two, and no more than splits of
    MIN_SPLIT_BLOCKS blocks of the widest context (max_blocks) need (the kernel gives each of a
    row's splits at least MIN_SPLIT_BLOCKS of its blocks: the last ones of a short row are empty)."""
    units = hardware.multiprocessors(device)
    want = max(1, -(-2 * units // max(batch * head_groups, 1)))
    return min(
        triton.next_power_of_2(want), triton.next_power_of_2(triton.cdiv(max_blocks, MIN_SPLIT_BLOCKS))
    )


def unsupported(dtype: torch.dtype, cache_dtype: torch.dtype, C: int, R: int, W: int) -> str | None:
    """Why `mla_decode` cannot take queries of `dtype` over cache rows of `cache_dtype` (uint8: FP8
    latent rows) and width W with latent C and rope R (None: it can)."""
    if dtype not in TL_DTYPE:
        return f"{dtype} queries"
    if cache_dtype == torch.uint8:
        if C % FP8_GROUP or R % 2:
            return f"FP8 rows need kv_lora_rank % {FP8_GROUP} == 0 and an even rope dim (C={C}, R={R})"
        if fp8_latent_bytes(C, R) > W or W % 16:
            return f"FP8 rows of {W} bytes (a multiple of 16 holding the latent)"
    elif cache_dtype != dtype:
        return f"a {cache_dtype} cache under {dtype} queries"
    elif C + R > W:
        return f"rows of {W} values narrower than the latent's {C + R}"
    return None


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    latent_dim: int,
    scale: float,
    splits: int | None = None,
    rows: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """q [B, N, C+R] (the absorbed latent query: q_nope @ W_UK, then q_pe), cache [blocks, 64, 1,
    W] (rows [c_kv | k_pe | ...]), table [B, max_blocks] int32/int64, lens [B] context lengths
    (>= 1) -> o [B, N, C] in q's dtype: softmax(scale * q . row[:C+R]) weighted sum of row[:C]
    over each sequence's first lens[b] rows. `splits` (a power of two) overrides the heuristic (then
    each row's blocks are cut in exactly `splits` ranges, without the minimum per split).
    rows [B, k] int64 (then `table` is not used): each sequence's chosen flat cache rows (block *
    64 + offset; V3.2's top-k), of which the first lens[b] are attended to.
    `tiles` overrides decode_tiles' choice (bench_kernels' sweep).
    A uint8 cache holds FP8 latent rows (`kv_cache.quantize_latent_rows`, W = fp8_row_bytes(C, R,
    Di): 656 bytes on V3, 800 on V3.2, whose indexer key the kernel skips), read as they are and
    dequantised per tile in the kernel; rows whose width is not a multiple of 16 bytes (not ours:
    they are padded) are refused (on an H200 they raised "misaligned address").
    ValueError for a cache of another dtype or layout (`unsupported`: what selection checks).
    deterministic: batch-invariant (module docstring; `splits` and `tiles` are then not taken).
    """
    B, N, D = q.shape
    C, R, W = latent_dim, q.shape[-1] - latent_dim, cache.shape[-1]
    problem = unsupported(q.dtype, cache.dtype, C, R, W)
    if problem or not cache.is_contiguous() or cache.shape[1] != BLOCK_SIZE:
        raise ValueError(f"mla_decode: {problem or 'the cache is not [blocks, 64, 1, W] contiguous'}")
    fp8 = cache.dtype == torch.uint8
    q = q if q.stride(-1) == 1 else q.contiguous()
    table = (table if rows is None else rows).contiguous()
    lens = lens.contiguous()
    if deterministic:
        return _deterministic_decode(q, cache, table, lens, C, scale, rows, fp8)
    tiles = tiles or decode_tiles(B, N, q.dtype, q.device, fp8)
    groups = triton.cdiv(N, tiles.block_h)
    width = table.shape[1] if rows is None else triton.cdiv(rows.shape[1], BLOCK_SIZE)  # in blocks
    min_blocks = 1 if splits else MIN_SPLIT_BLOCKS  # (splits given: exactly cdiv(blocks, splits) each)
    splits = splits or _splits(B, groups, width, q.device)
    return _launch(q, cache, table, lens, C, scale, rows is not None, fp8, tiles, splits, min_blocks, 0)


def _deterministic_decode(q, cache, table, lens, C: int, scale: float, rows, fp8: bool) -> torch.Tensor:
    """`mla_decode(deterministic=True)`: each row cut by its own length (module docstring), the
    launch's SPLITS a power of two covering the widest row, rows in groups whose partials fit
    DETERMINISTIC_MID_BYTES."""
    B, N, _ = q.shape
    if B == 0:
        return q.new_empty(0, N, C)
    tiles = decode_tiles(B, N, q.dtype, q.device, fp8, deterministic=True)
    width = table.shape[1] if rows is None else triton.cdiv(rows.shape[1], BLOCK_SIZE)  # in blocks
    need = min(DETERMINISTIC_MAX_SPLITS, triton.cdiv(max(width, 1), DETERMINISTIC_SPLIT_BLOCKS))
    splits = triton.next_power_of_2(need)
    step = max(1, DETERMINISTIC_MID_BYTES // (N * splits * C * 4))
    parts = [
        _launch(q[b : b + step], cache, table[b : b + step], lens[b : b + step], C, scale, rows is not None,
                fp8, tiles, splits, DETERMINISTIC_SPLIT_BLOCKS, DETERMINISTIC_MAX_SPLITS)
        for b in range(0, B, step)
    ]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _launch(q, cache, table, lens, C: int, scale: float, sparse: bool, fp8: bool, tiles: DecodeTiles,
            splits: int, min_blocks: int, max_row_splits: int) -> torch.Tensor:  # fmt: skip
    """Stage 1 (and with splits > 1 stage 2) over q's B rows -> o [B, N, C]."""
    B, N, _ = q.shape
    R, W = q.shape[-1] - C, cache.shape[-1]
    fp32 = q.dtype == torch.float32
    block_n = max(16, tiles.block_n // 2) if fp32 else tiles.block_n  # (fp32 tiles are twice the
    # registers; tl.dot's K is at least 16)
    groups = triton.cdiv(N, tiles.block_h)
    o = torch.empty(B, N, C, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    mid_o = torch.empty(B, N, splits, C, dtype=torch.float32, device=q.device) if splits > 1 else o
    mid_lse = torch.empty(B, N, splits, dtype=torch.float32, device=q.device) if splits > 1 else o
    BLOCK_C = max(16, triton.next_power_of_2(C))
    scales, ropes = (cache.view(torch.float32), cache.view(torch.bfloat16)) if fp8 else (cache, cache)
    _mla_decode_split[(groups, B, splits)](
        q, cache, scales, ropes, table, lens, mid_o, mid_lse,
        N, C, R, W, q.stride(0), q.stride(1), table.stride(0), scale, sparse,
        BLOCK_H=tiles.block_h, BLOCK_C=BLOCK_C, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_N=block_n,
        PAGE=BLOCK_SIZE, SPLITS=splits, MIN_BLOCKS=min_blocks,
        PRECISION="ieee" if fp32 else None,  # fp32: no TF32 rounding
        UPCAST=INTERPRETED, FP8=fp8, GROUP=FP8_GROUP, MAX_ROW_SPLITS=max_row_splits, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        _mla_decode_merge[(B * N,)](mid_o, mid_lse, o, N, C, BLOCK_C=BLOCK_C, SPLITS=splits)
    return o


@triton.jit
def _rounded(v, DTYPE: tl.constexpr):
    """v (fp32) rounded to DTYPE (to nearest, ties to even) and back: one elementwise torch op in
    DTYPE (computed in fp32, rounded once), so the kernel gives the torch path's bits."""
    if DTYPE == tl.float32:  # noqa: SIM300 (a constexpr, known when the kernel compiles)
        return v
    return v.to(DTYPE, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _rotate(x_ptr, o1, o2, mask, cos, sin, out_ptr, DTYPE: tl.constexpr):
    """out[o1], out[o2] = x[o1] cos - x[o2] sin, x[o2] cos + x[o1] sin, op by op in DTYPE (as
    torch_ops.rope_interleaved)."""
    x1 = tl.load(x_ptr + o1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + o2, mask=mask, other=0.0).to(tl.float32)
    y1 = _rounded(_rounded(x1 * cos, DTYPE) - _rounded(x2 * sin, DTYPE), DTYPE)
    y2 = _rounded(_rounded(x2 * cos, DTYPE) + _rounded(x1 * sin, DTYPE), DTYPE)
    tl.store(out_ptr + o1, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + o2, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _latent_to_cache(
    kv_ptr, q_ptr, norm_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_pe_ptr,
    N, stride_kv, stride_q_t, stride_q_n, stride_cs, eps,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERLEAVE: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Token t = program id: cache row slot[t] <- [rms_norm(kv[t, :C]) * norm | rope(kv[t, C:])],
    q_pe[t] <- rope(q[t, :, :R]) for its N heads."""
    t = tl.program_id(0)
    kv = kv_ptr + t * stride_kv
    row = cache_ptr + tl.load(slot_ptr + t).to(tl.int64) * (C + R)
    c = tl.arange(0, BLOCK_C)
    x = tl.load(kv + c, mask=c < C, other=0.0).to(tl.float32)
    normed = _rounded(x * tl.rsqrt(tl.sum(x * x, 0) / C + eps), DTYPE)  # (torch_ops.rms_norm's math)
    w = tl.load(norm_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    tl.store(row + c, _rounded(w * normed, DTYPE).to(cache_ptr.dtype.element_ty), mask=c < C)

    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < R // 2
    if INTERLEAVE:  # pairs (2i, 2i + 1), DeepSeek's layout
        o1, o2 = 2 * i, 2 * i + 1
    else:  # halves (i, i + R/2)
        o1, o2 = i, i + R // 2
    cos = tl.load(cos_ptr + t * stride_cs + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cs + i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate(kv + C, o1, o2, i_ok, cos, sin, row + C, DTYPE)
    n = tl.arange(0, BLOCK_N)[:, None]
    heads = (n < N) & i_ok[None, :]
    q_rows, out_rows = q_ptr + t * stride_q_t + n * stride_q_n, q_pe_ptr + (t * N + n) * R
    _rotate(q_rows, o1[None, :], o2[None, :], heads, cos[None, :], sin[None, :], out_rows, DTYPE)


def latent_to_cache(
    kv: torch.Tensor,
    q_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    interleave: bool,
    eps: float,
) -> torch.Tensor:
    """The MLA layer's per-token work between its projections, in one launch: kv [T, C+R] (kv_a's
    output), q_pe [T, N, R] (the queries' rope part, a view), norm_weight [C], cos / sin [T, R/2],
    slot_mapping [T] int64 -> writes each token's latent row [rms_norm(c_kv) | rope(k_pe)] into
    cache [blocks, 64, 1, C+R] at its slot and returns rope(q_pe) [T, N, R]: the torch path's math
    (torch_ops.latent_to_cache: rms_norm, the rope, the cache write) op by op in kv's dtype, the norm's sum in
    another order. ValueError for V3.2's wider rows or mixed dtypes (selection leaves those to
    torch); other strides are made contiguous."""
    T, N, R = q_pe.shape
    C = kv.shape[1] - R
    dtypes = {kv.dtype, q_pe.dtype, cos.dtype, norm_weight.dtype}
    if cache.shape[-1] != C + R or not cache.is_contiguous() or len(dtypes) > 1 or kv.dtype not in TL_DTYPE:
        raise ValueError(f"latent_to_cache: rows of {cache.shape[-1]} for C + R = {C + R}, dtypes {dtypes}")
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(T, N, R, dtype=q_pe.dtype, device=q_pe.device)
    if T:
        _latent_to_cache[(T,)](
            kv, q_pe, norm_weight, cos, sin, slot_mapping, cache, out,
            N, kv.stride(0), q_pe.stride(0), q_pe.stride(1), cos.stride(0), eps,
            C=C, R=R, BLOCK_C=triton.next_power_of_2(C), BLOCK_HALF=max(2, triton.next_power_of_2(R // 2)),
            BLOCK_N=triton.next_power_of_2(N), INTERLEAVE=interleave, DTYPE=TL_DTYPE[kv.dtype],
        )  # fmt: skip
    return out
