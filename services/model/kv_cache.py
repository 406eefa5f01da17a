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
while some sequence still reads that block's recent tokens (`BlockAllocator.hold_state`). Its
FP8 format (`kv_cache_dtype="fp8"`) is FlashMLA's "MODEL1" (`Model1`, `PackedRows`).

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
# one for Di <= FP8_GROUP] (V3.2: 128 + 4 = 132 bytes). A group's scale is its largest |value| /
# 448 (e4m3's largest finite value), so nothing saturates. Rows are zero-padded to a multiple of
# FP8_ROW_ALIGN bytes, which GPU kernels need to load them (V3's 656 need none; V3.2's 788 take 800).
FP8_GROUP = 128
FP8_MAX = 448.0
FP8_ROW_ALIGN = 16


def key_groups(Di: int) -> int:
    """Scale groups of a Di-wide indexer key: one per FP8_GROUP values, one for a shorter key."""
    return max(1, Di // FP8_GROUP)


def fp8_latent_bytes(C: int, R: int) -> int:
    """Bytes of an FP8 row's [c_kv | scales | k_pe] (where V3.2's indexer key starts)."""
    return C + 4 * (C // FP8_GROUP) + 2 * R


def fp8_row_bytes(C: int, R: int, Di: int = 0) -> int:
    """Bytes of one FP8 row, padded, for kv_lora_rank C (a multiple of FP8_GROUP), rope dim R and,
    for V3.2, index_head_dim Di (<= FP8_GROUP or a multiple of it; 0: none)."""
    used = fp8_latent_bytes(C, R) + (Di + 4 * key_groups(Di) if Di else 0)
    return -(-used // FP8_ROW_ALIGN) * FP8_ROW_ALIGN


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
    width = fp8_row_bytes(C, k_pe.shape[1], 0 if index_key is None else index_key.shape[1])
    parts.append(c_kv.new_zeros(T, width - sum(p.shape[1] for p in parts), dtype=torch.uint8))  # the pad
    return torch.cat(parts, dim=-1)


def dequantize_latent_rows(
    rows: torch.Tensor, C: int, R: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [..., W] FP8 rows (W >= fp8_latent_bytes(C, R)) -> [..., C + R] in `dtype` ([c_kv | k_pe])."""
    lead, G = rows.shape[:-1], C // FP8_GROUP
    flat = rows.reshape(-1, rows.shape[-1])
    rope = flat[:, C + 4 * G : C + 4 * G + 2 * R].contiguous().view(torch.bfloat16).float()
    return torch.cat([_dequantize_groups(flat, C, G), rope], dim=-1).to(dtype).view(*lead, C + R)


def dequantize_index_keys(tails: torch.Tensor, Di: int) -> torch.Tensor:
    """uint8 [..., >= Di + 4 * key_groups(Di)]: the tails of V3.2's FP8 rows (from
    fp8_latent_bytes(C, R) on) -> the indexer keys [..., Di] fp32."""
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


# DeepSeek-V4's FP8 rows (`kv_cache_dtype="fp8"`): a K=V row (window kv, compressed entry) of D
# values whose last R are rope is FlashMLA's "MODEL1" row: [D - R as float8_e4m3fn | R as bf16],
# and apart from those, one UE8M0 scale (a power of two, the byte its exponent + 127) per
# MODEL1_TILE values, padded to 8 bytes (V4: 448 + 128 + 7 + 1 = 584 bytes against 1,024 in bf16).
# A tile's scale is the least power of two >= its largest |value| / 448 (at least 2^-126; 1 for a
# zero tile), so nothing saturates.
# Like FlashMLA's MODEL1 blocks, each block holds its rows' [nope | rope] bytes, then their scales.
MODEL1_TILE = 64


class Model1:
    """The MODEL1 format of D-wide rows with R rope dims (D - R a multiple of MODEL1_TILE, or one
    shorter tile): sections (the [nope | rope] bytes, the scale bytes) of one row."""

    def __init__(self, D: int, R: int):
        n = D - R
        if n % MODEL1_TILE and n > MODEL1_TILE:
            raise ValueError(f"MODEL1 rows need head_dim - rope <= {MODEL1_TILE} or a multiple, got {n}")
        self.width, self.nope, self.tiles = D, n, max(1, n // MODEL1_TILE)
        self.sections = (n + 2 * R, -(-self.tiles // 8) * 8)

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, D] -> [uint8 [T, D - R + 2R], uint8 [T, scale bytes]]."""
        T, n = x.shape[0], self.nope
        tiles = x[:, :n].float().view(T, self.tiles, -1)
        mantissa, exponent = torch.frexp(tiles.abs().amax(-1) / FP8_MAX)  # m * 2^e, m in [0.5, 1)
        exponent = (exponent - (mantissa == 0.5).int()).clamp_(-126, 127)  # ceil(log2(amax / 448))
        fp8 = torch.ldexp(tiles, -exponent[..., None].float()).view(T, n).to(torch.float8_e4m3fn)
        scales = torch.zeros(T, self.sections[1], dtype=torch.uint8, device=x.device)
        scales[:, : self.tiles] = (exponent + 127).to(torch.uint8)
        rope = x[:, n:].to(torch.bfloat16).view(torch.uint8).view(T, -1)
        return [torch.cat((fp8.view(torch.uint8), rope), dim=-1), scales]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The sections of T rows -> [T, D] in `dtype`."""
        data, scales = parts
        T, n = data.shape[0], self.nope
        exponent = scales[:, : self.tiles].float() - 127
        nope = data[:, :n].contiguous().view(torch.float8_e4m3fn).float().view(T, self.tiles, -1)
        rope = data[:, n:].contiguous().view(torch.bfloat16).float()
        return torch.cat((torch.ldexp(nope, exponent[..., None]).view(T, n), rope), dim=-1).to(dtype)


class Fp8Groups:
    """n-wide keys as e4m3 with an fp32 scale per FP8_GROUP values (one for n <= FP8_GROUP), as
    V3.2's FP8 indexer keys: sections (the e4m3 bytes, the scales)."""

    def __init__(self, n: int):
        if n > FP8_GROUP and n % FP8_GROUP:
            raise ValueError(f"FP8 indexer keys need index_head_dim <= {FP8_GROUP} or a multiple, got {n}")
        self.width, self.groups = n, key_groups(n)
        self.sections = (n, 4 * self.groups)

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(_quantize_groups(x, self.groups))

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_index_keys(torch.cat(parts, dim=-1), self.width).to(dtype)


class Raw:
    """n values kept as they are, in `dtype` (V4's compressor states)."""

    def __init__(self, n: int, dtype: torch.dtype):
        self.width, self.dtype = n, dtype
        self.sections = (n * dtype.itemsize,)

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x.to(self.dtype).contiguous().view(torch.uint8)]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts[0].contiguous().view(self.dtype).to(dtype)


class PlainRows:
    """One V4 layer's state rows or entries as they are: `data` [blocks, rows per block, W] in the
    model's dtype, read and written by flat row (block * rows per block + row) and columns."""

    def __init__(self, data: torch.Tensor):
        self.data, self.flat = data, data.view(-1, data.shape[-1])

    def read(self, rows: torch.Tensor, cols: slice) -> torch.Tensor:
        """rows [...] flat row indices -> [..., cols] values."""
        return self.flat[rows, cols]

    def write(self, rows: torch.Tensor, cols: slice, values: torch.Tensor) -> None:
        """rows [T], values [T, cols]."""
        self.flat[rows, cols] = values.to(self.flat.dtype)


class PackedRows:
    """One V4 layer's state rows or entries in FP8 (`Model1`, `Fp8Groups`, `Raw` fields covering a
    row's columns in order): `data` uint8 [blocks, block_bytes(fields, rows_per_block)], each block
    holding its rows section by section (all rows' first section, then all rows' second, ...), as
    FlashMLA's MODEL1 blocks do, then zeros to a multiple of FP8_ROW_ALIGN bytes (GPU loads).
    Reads give the model's `dtype`; the same read/write as PlainRows."""

    def __init__(self, fields: list, num_blocks: int, rows_per_block: int, dtype: torch.dtype, device="cpu"):
        self.fields, self.rows_per_block, self.dtype = fields, rows_per_block, dtype
        self.data = zeros(
            num_blocks, self.block_bytes(fields, rows_per_block), dtype=torch.uint8, device=device
        )
        self._sections, self._starts, start, col = [], [], 0, 0
        for f in fields:  # per field: [blocks, rows_per_block, w] views of its sections
            views = []
            for w in f.sections:
                views.append(
                    self.data[:, start : start + rows_per_block * w].view(num_blocks, rows_per_block, w)
                )
                start += rows_per_block * w
            self._sections.append(views)
            self._starts.append(col)
            col += f.width
        self.width = col  # a row's columns

    @staticmethod
    def block_bytes(fields: list, rows_per_block: int) -> int:
        used = rows_per_block * sum(sum(f.sections) for f in fields)
        return -(-used // FP8_ROW_ALIGN) * FP8_ROW_ALIGN

    def _fields(self, first: int, last: int) -> list[int]:
        """The fields columns first .. last-1 cover, whole; else ValueError."""
        covered = [i for i, s in enumerate(self._starts) if first <= s < last]
        ends = [self._starts[i] + self.fields[i].width for i in covered]
        if not covered or self._starts[covered[0]] != first or ends[-1] != last:
            raise ValueError(f"columns {first}:{last} are not whole fields (they start at {self._starts})")
        return covered

    def read(self, rows: torch.Tensor, cols: slice) -> torch.Tensor:
        """rows [...] flat row indices -> [..., cols] values (cols within one field, or whole fields)."""
        first, stop = cols.start or 0, self.width if cols.stop is None else cols.stop
        i = max(i for i, start in enumerate(self._starts) if start <= first)
        f, start = self.fields[i], self._starts[i]
        if stop > start + f.width:  # whole fields, one after the other
            fields = self._fields(first, stop)
            return torch.cat([self.read(rows, slice(self._starts[j], self._starts[j] + self.fields[j].width))
                              for j in fields], dim=-1)  # fmt: skip
        block, slot = rows // self.rows_per_block, rows % self.rows_per_block
        parts = [s[block, slot].view(-1, s.shape[-1]) for s in self._sections[i]]
        return f.decode(parts, self.dtype)[:, first - start : stop - start].view(*rows.shape, -1)

    def write(self, rows: torch.Tensor, cols: slice, values: torch.Tensor) -> None:
        """rows [T], values [T, cols] (cols whole fields)."""
        block, slot = rows // self.rows_per_block, rows % self.rows_per_block
        first = cols.start or 0
        for i in self._fields(first, first + values.shape[1] if cols.stop is None else cols.stop):
            f, at = self.fields[i], self._starts[i] - first
            for s, part in zip(self._sections[i], f.encode(values[:, at : at + f.width]), strict=True):
                s[block, slot] = part

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class V4Cache:
    """DeepSeek-V4's paged cache. Per layer i, `kv[i]` = (state, entries), each a PlainRows (the
    model's dtype; shapes below) or, with `fp8`, a PackedRows (`v4_fp8_fields`; uint8 [blocks,
    block bytes], the same rows):
    state [num_state_blocks, BLOCK_SIZE, state_dim]: the window-state rows of recent tokens
        (`ModelConfig.v4_state_dim`), addressed through `StepBatch.state_table`;
    entries [num_blocks, entries_per_block(r), entry_dim] (None for sliding layers): the
        compressed entries (`ModelConfig.v4_entry_dim`), entry w in the block of its window's
        last token (`v4_attention.entry_rows`), addressed through the block table.
    """

    def __init__(self, cfg, num_blocks: int, num_state_blocks: int, dtype: torch.dtype, device="cpu",
                 fp8: bool = False, layers: int | None = None):  # fmt: skip
        """layers: the layers with a slot (default the decoder layers; speculative decoding adds
        the MTP modules', sliding-window layers at index num_hidden_layers + j)."""
        self.num_blocks, self.num_state_blocks = num_blocks, num_state_blocks
        self.kv = []
        for i in range(cfg.num_hidden_layers if layers is None else layers):
            kind, layer = cfg.attention_type(i), []
            layout = _v4_layout(cfg, i, kind, dtype, fp8)  # state rows, then entries
            for (n, f), blocks in zip(layout, (num_state_blocks, num_blocks)[: len(layout)], strict=True):
                if fp8:
                    layer.append(PackedRows(f, blocks, n, dtype, device))
                else:
                    layer.append(PlainRows(zeros(blocks, n, f, dtype=dtype, device=device)))
            self.kv.append((layer[0], layer[1] if len(layer) > 1 else None))

    @property
    def nbytes(self) -> int:
        return sum(rows.data.nbytes for layer in self.kv for rows in layer if rows is not None)

    @staticmethod
    def bytes_per_block(
        cfg, dtype: torch.dtype, fp8: bool = False, layers: int | None = None
    ) -> tuple[int, int]:
        """(bytes of one block's entries, bytes of one state block), all `layers` (as __init__'s)."""
        sizes = [0, 0]  # state, entries
        for i in range(cfg.num_hidden_layers if layers is None else layers):
            for k, (n, f) in enumerate(_v4_layout(cfg, i, cfg.attention_type(i), dtype, fp8)):
                sizes[k] += PackedRows.block_bytes(f, n) if fp8 else n * f * dtype.itemsize
        return sizes[1], sizes[0]

    @staticmethod
    def state_blocks_per_seq(cfg, max_model_len: int) -> int:
        """State blocks one sequence holds at most while decoding: its lookback
        (`ModelConfig.v4_state_start`) plus the new token, across a block boundary."""
        lookback = max(cfg.sliding_window - 1, 2 * cfg.compress_ratio_csa - 1, cfg.compress_ratio_hca - 1)
        return blocks_needed(min(lookback, max_model_len) + 1) + 1


def _v4_layout(cfg, i: int, layer_type: str, dtype: torch.dtype, fp8: bool) -> list[tuple[int, list | int]]:
    """Layer i's [(rows per block, FP8 fields or plain width)]: its state rows, then (compressed
    layers) its entries."""
    r = cfg.compress_ratio(i)
    rows = [BLOCK_SIZE] + ([entries_per_block(r)] if r else [])
    if fp8:
        return list(zip(rows, v4_fp8_fields(cfg, layer_type, dtype), strict=True))
    return list(
        zip(rows, [cfg.v4_state_dim(layer_type), cfg.v4_entry_dim(layer_type)][: len(rows)], strict=True)
    )


def v4_fp8_fields(cfg, layer_type: str, dtype: torch.dtype) -> list[list]:
    """The fields of a DeepSeek-V4 layer's FP8 rows, in column order ([state] or [state, entries],
    as `ModelConfig.v4_state_dim` / `v4_entry_dim` lay them out): kv and entries in MODEL1, the
    indexer's entries as FP8 keys, the compressor states (inputs of entries not yet complete) as
    they are."""
    D, R, Di = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
    if layer_type == "sliding_attention":
        return [[Model1(D, R)]]
    if layer_type == "heavily_compressed_attention":
        return [[Model1(D, R), Raw(2 * D, dtype)], [Model1(D, R)]]
    return [[Model1(D, R), Raw(4 * D, dtype), Raw(4 * Di, dtype)], [Model1(D, R), Fp8Groups(Di)]]


def entries_per_block(ratio: int) -> int:
    """Compressed entries (one per `ratio` tokens) whose window ends in one 64-token block, at most."""
    return -(-BLOCK_SIZE // ratio)
