"""Paged latent KV cache (FlashMLA layout) and its block allocator.

One cache row per token per layer holds [c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe
(qk_rope_head_dim, after RoPE, interleaved pairs)], and for DeepSeek-V3.2 then the lightning
indexer's key (index_head_dim, see indexer.py), so one block table addresses both. Per layer the
cache is `[num_blocks, BLOCK_SIZE, 1, row_dim]` (one latent "KV head"; row_dim is
`ModelConfig.cache_dim`), addressed through an int32 block table `[batch, max_blocks]` and int32
seqlens, exactly what FlashMLA's `flash_mla_with_kvcache` takes for V3 (576-wide rows), so that
kernel drops in on Hopper.

DeepSeek-V4 (`V4Cache`) splits what it keeps by lifetime: compressed entries, a few per block and
needed for ever, live in blocks addressed by the block table like the rows above; each token's
window state (its K=V row and compressor inputs), needed only while it is among a sequence's
last few dozen tokens, lives in *state blocks*: a second, much smaller pool, attached to a block
while some sequence still reads that block's recent tokens (`BlockAllocator.hold_state`).

Blocks are shared between requests with a common prompt prefix (automatic prefix caching,
`BlockAllocator`): a full block's identity is the chained hash of its tokens and everything
before them, as in vLLM.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BLOCK_SIZE = 64


def blocks_needed(num_tokens: int) -> int:
    return (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape) for a cache: on the CPU its pages come zero-filled from the OS on first
    touch (numpy's calloc), so a GiB-sized cache costs no fill at start-up (~0.4 s for 2 GiB
    here) and no resident memory until its blocks are used."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


# FP8 latent rows (`kv_cache_dtype="fp8"`), FlashMLA's "FP8 with scale" layout: per token
# [c_kv as float8_e4m3fn (C bytes) | one fp32 scale per FP8_GROUP values of c_kv | k_pe as bf16]
# (V3: 512 + 4 x 4 + 64 x 2 = 656 bytes against 1,152 in bf16 and 2,304 in fp32), and for
# DeepSeek-V3.2 then the indexer's key [Di as float8_e4m3fn | one fp32 scale per FP8_GROUP values,
# one for Di <= FP8_GROUP] (V3.2: 128 + 4 = 132 bytes, 788 in all). A group's scale is its
# largest |value| / 448 (e4m3's largest finite value), so nothing saturates.
FP8_GROUP = 128
FP8_MAX = 448.0


def key_groups(Di: int) -> int:
    """Scale groups of a Di-wide indexer key: one per FP8_GROUP values, one for a shorter key."""
    return max(1, Di // FP8_GROUP)


def fp8_row_bytes(C: int, R: int, Di: int = 0) -> int:
    """Bytes of one FP8 row for kv_lora_rank C (a multiple of FP8_GROUP), rope dim R and, for
    V3.2, index_head_dim Di (<= FP8_GROUP or a multiple of it; 0: none)."""
    return C + 4 * (C // FP8_GROUP) + 2 * R + (Di + 4 * key_groups(Di) if Di else 0)


def _quantize_groups(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, n] -> (e4m3 bytes uint8 [T, n], fp32 scales as bytes uint8 [T, 4 * groups])."""
    T, n = x.shape
    g = x.float().view(T, groups, n // groups)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)  # [T, groups]
    fp8 = (g / scale[..., None]).view(T, n).to(torch.float8_e4m3fn)
    return fp8.view(torch.uint8), scale.view(torch.uint8).view(T, -1)


def _dequantize_groups(flat: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """uint8 [T, n + 4 * groups] (e4m3 values, then fp32 scales) -> fp32 [T, n]."""
    fp8 = flat[:, :n].contiguous().view(torch.float8_e4m3fn).float().view(-1, groups, n // groups)
    scale = flat[:, n : n + 4 * groups].contiguous().view(torch.float32).view(-1, groups, 1)
    return (fp8 * scale).view(-1, n)


def quantize_latent_rows(
    c_kv: torch.Tensor, k_pe: torch.Tensor, index_key: torch.Tensor | None = None
) -> torch.Tensor:
    """c_kv [T, C], k_pe [T, R] (and V3.2's index_key [T, Di]) -> uint8 [T, fp8_row_bytes(C, R, Di)]
    FP8 rows."""
    T, C = c_kv.shape
    parts = [*_quantize_groups(c_kv, C // FP8_GROUP), k_pe.to(torch.bfloat16).view(torch.uint8).view(T, -1)]
    if index_key is not None:
        parts += _quantize_groups(index_key, key_groups(index_key.shape[1]))
    return torch.cat(parts, dim=-1)


def dequantize_latent_rows(
    rows: torch.Tensor, C: int, R: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [..., W] FP8 rows (W >= fp8_row_bytes(C, R)) -> [..., C + R] in `dtype` ([c_kv | k_pe])."""
    lead, G = rows.shape[:-1], C // FP8_GROUP
    flat = rows.reshape(-1, rows.shape[-1])
    rope = flat[:, C + 4 * G : C + 4 * G + 2 * R].contiguous().view(torch.bfloat16).float()
    return torch.cat([_dequantize_groups(flat, C, G), rope], dim=-1).to(dtype).view(*lead, C + R)


def dequantize_index_keys(tails: torch.Tensor, Di: int) -> torch.Tensor:
    """uint8 [..., Di + 4 * key_groups(Di)]: the tails of V3.2's FP8 rows (from fp8_row_bytes(C, R)
    on) -> the indexer keys [..., Di] fp32."""
    lead = tails.shape[:-1]
    return _dequantize_groups(tails.reshape(-1, tails.shape[-1]), Di, key_groups(Di)).view(*lead, Di)


class PagedLatentCache:
    """`kv[layer]` is `[num_blocks, BLOCK_SIZE, 1, latent_dim]`, all layers in one tensor
    (`latent_dim` here is the whole row: `ModelConfig.cache_dim`); with `fp8` = (C, R, Di) the
    rows are FP8 rows instead: uint8 `[..., fp8_row_bytes(C, R, Di)]`."""

    num_state_blocks = 0

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        latent_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fp8: tuple[int, int, int] | None = None,
    ):
        if fp8 is not None:
            latent_dim, dtype = fp8_row_bytes(*fp8), torch.uint8
        self.kv = zeros(num_layers, num_blocks, BLOCK_SIZE, 1, latent_dim, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class V4Cache:
    """DeepSeek-V4's paged cache. Per layer i, `kv[i]` = (state, entries):
    state [num_state_blocks, BLOCK_SIZE, state_dim]: the window-state rows of recent tokens
        (`ModelConfig.v4_state_dim`), addressed through `StepBatch.state_table`;
    entries [num_blocks, entries_per_block(r), entry_dim] (None for sliding layers): the
        compressed entries (`ModelConfig.v4_entry_dim`), entry w in the block of its window's
        last token (`v4_attention.entry_rows`), addressed through the block table.
    """

    def __init__(self, cfg, num_blocks: int, num_state_blocks: int, dtype: torch.dtype, device="cpu"):
        self.num_blocks, self.num_state_blocks = num_blocks, num_state_blocks
        self.kv = []
        for i, kind in enumerate(cfg.layer_types):
            state = zeros(num_state_blocks, BLOCK_SIZE, cfg.v4_state_dim(kind), dtype=dtype, device=device)
            r, width = cfg.compress_ratio(i), cfg.v4_entry_dim(kind)
            entries = None
            if r:
                entries = zeros(num_blocks, entries_per_block(r), width, dtype=dtype, device=device)
            self.kv.append((state, entries))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.kv for t in layer if t is not None)

    @staticmethod
    def bytes_per_block(cfg, dtype: torch.dtype) -> tuple[int, int]:
        """(bytes of one block's entries, bytes of one state block), all layers."""
        size = torch.empty((), dtype=dtype).element_size()
        entries = sum(entries_per_block(cfg.compress_ratio(i)) * cfg.v4_entry_dim(kind)
                      for i, kind in enumerate(cfg.layer_types) if cfg.compress_ratio(i))  # fmt: skip
        state = sum(BLOCK_SIZE * cfg.v4_state_dim(kind) for kind in cfg.layer_types)
        return entries * size, state * size

    @staticmethod
    def state_blocks_per_seq(cfg, max_model_len: int) -> int:
        """State blocks one sequence holds at most while decoding: its lookback
        (`ModelConfig.v4_state_start`) plus the new token, across a block boundary."""
        lookback = max(cfg.sliding_window - 1, 2 * cfg.compress_ratio_csa - 1, cfg.compress_ratio_hca - 1)
        return blocks_needed(min(lookback, max_model_len) + 1) + 1


def entries_per_block(ratio: int) -> int:
    """Compressed entries (one per `ratio` tokens) whose window ends in one 64-token block, at most."""
    return -(-BLOCK_SIZE // ratio)
