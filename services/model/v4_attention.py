"""DeepSeek-V4 attention over the paged cache: one shared K=V head, a sliding window, compressed
KV entries (CSA: every `compress_ratio_csa` tokens, picked per query by a lightning indexer; HCA:
every `compress_ratio_hca` tokens, all of them), attention sinks and the grouped output
projection. The math is transformers' `DeepseekV4Attention` (modeling_deepseek_v4.py).

Shapes: T tokens in the step, H hidden, N heads, D = head_dim (the one K=V head: D - R no-rope
dims, then R rope dims), r a compress ratio, Hi / Di the indexer's heads / head size, G o_groups.

Per token t of a layer (x = the layer's attention input):
    kv[t]   = rope(RMSNorm(wkv x))                                       [D]   (K and V)
    q[t]    = rope(unit-RMS per head(wq_b RMSNorm(wq_a x)))                [N, D]
rope acts on the *last* R dims, interleaved pairs; sliding layers use the main rope (rope_theta),
CSA/HCA layers the compress rope (compress_rope_theta, YaRN) for everything.

A compressor emits entry w from the source tokens of window w (HCA: positions [w*r, (w+1)*r)) or,
for CSA, of windows w-1 and w (two series: token t contributes its first half Ca to the entry of
its window's successor and its second half Cb to its own window's):
    entry[w] = rope_at(w*r)(RMSNorm(sum_j softmax_j(gate_j + ape[j % r]) * kv_j))     [d]
(softmax per feature over the window's r or 2r slots; kv = wkv x, gate = wgate x per token).
Query t sees entry w once its window is complete: w < (t+1) // r. The CSA indexer compresses
the same way at Di and keeps, per query, the `index_topk` entries with the best
    score[t, w] = sum_h (weights_proj x)[t, h] / sqrt(Hi) * relu(q_idx[t, h] . k_idx[w]) / sqrt(Di),
q_idx = rope(wq_b of the q_lora query). Each query attends, in one softmax with a per-head sink
logit, to its last `sliding_window` tokens' kv and its visible (CSA: selected) entries; the
output's rope dims are rotated back by the query's position, then `wo_b(wo_a per group)`.

The cache (kv_cache.V4Cache) keeps, per layer, two things with their own lifetimes:
    state rows, one per recent token, in state blocks (`StepBatch.state_table`):
        [kv (D) | compressor kv (S*d) | compressor gate (S*d) | same for the indexer]
    compressed entries, one per window, in the block of the window's last token (`entry_rows`):
        [entry (d) | the indexer's entry (Di), CSA]
(S = 2 for CSA's two overlapping series, 1 for HCA). A token's compressor kv / gate are raw
projections; a window's entry is pooled from them when a step computes the window's last token
(the earlier tokens' states read from the cache, so windows straddle chunks and blocks). An entry
depends only on its window's tokens, so a cached block carries exact entries; the scheduler keeps
state rows only as far back as `ModelConfig.v4_state_start` reads. Both are read and written by
flat row and columns (`read` / `write`): in the model's dtype (kv_cache.PlainRows) or FP8
(kv_cache.PackedRows: kv and entries in FlashMLA's MODEL1 rows, the indexer's entries as FP8
keys, compressor inputs as they are).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .batch import DecodeRows, StepBatch
from .config import ModelConfig, rope_inv_freq
from .kernels import deterministic
from .kv_cache import BLOCK_SIZE, PackedRows, PlainRows, entries_per_block

Rows = PlainRows | PackedRows  # a layer's state rows or entries, read and written by flat row

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as V4's: in fp32, times the fp32 `weight` (None: unweighted), cast back once."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf if weight is None else weight * xf).to(x.dtype)


class V4Rope:
    """cos / sin [T, R/2] (fp32) of the main (sliding layers) or compress (CSA/HCA) rope."""

    def __init__(self, cfg: ModelConfig, compress: bool, device: torch.device | str = "cpu"):
        inv_freq, self.factor = rope_inv_freq(cfg, compress=compress)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.factor, freqs.sin() * self.factor


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rope of the last R = 2 * cos.shape[-1] dims of x [T, ..., d] (in fp32,
    cast back); cos/sin [T, R/2]. (cos, -sin) undoes it."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    rope = x[..., -2 * half :].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat((x[..., : -2 * half], rotated.to(x.dtype)), dim=-1)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
@dataclass
class CompressorWeights:
    """One compressor (CSA/HCA main, or the CSA indexer's): S = 2 overlapping series (CSA) or 1."""

    wkv: torch.Tensor  # [S*d, H]
    wgate: torch.Tensor  # [S*d, H]
    ape: torch.Tensor  # [r, S*d] fp32 position bias of the gate
    norm: torch.Tensor  # [d] fp32
    ratio: int  # r
    offset: int  # first state-row column of its [kv (S*d) | gate (S*d)]
    entry_offset: int  # first entry-row column of its entry (d)

    @property
    def dim(self) -> int:
        return self.norm.shape[0]

    @property
    def width(self) -> int:
        return self.wkv.shape[0]

    @property
    def overlap(self) -> bool:
        return self.width == 2 * self.dim

    @property
    def entry_cols(self) -> slice:
        return slice(self.entry_offset, self.entry_offset + self.dim)

    @property
    def state_end(self) -> int:
        return self.offset + 2 * self.width

    @classmethod
    def load(cls, get, prefix: str, ratio: int, offset: int, entry_offset: int, dtype: torch.dtype):
        """prefix ends with 'compressor.'; get(name, dtype) reads a checkpoint tensor."""
        return cls(get(prefix + "wkv.weight", dtype), get(prefix + "wgate.weight", dtype),
                   get(prefix + "ape", torch.float32), get(prefix + "norm.weight", torch.float32),
                   ratio, offset, entry_offset)  # fmt: skip


@dataclass
class V4IndexerWeights:
    wq_b: torch.Tensor  # [Hi*Di, q_lora]
    weights_proj: torch.Tensor  # [Hi, H]
    compressor: CompressorWeights  # at Di, two series


@dataclass
class V4AttentionWeights:
    kind: str  # SLIDING, CSA or HCA
    wq_a: torch.Tensor  # [q_lora, H]
    q_norm: torch.Tensor  # [q_lora] fp32
    wq_b: torch.Tensor  # [N*D, q_lora]
    wkv: torch.Tensor  # [D, H]
    kv_norm: torch.Tensor  # [D] fp32
    wo_a: torch.Tensor  # [G*o_lora, N*D/G]
    wo_b: torch.Tensor  # [H, G*o_lora]
    sinks: torch.Tensor  # [N] fp32
    compressor: CompressorWeights | None = None  # CSA / HCA
    indexer: V4IndexerWeights | None = None  # CSA

    @classmethod
    def load(cls, get, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> V4AttentionWeights:
        a, kind, D = f"model.layers.{layer}.attn.", cfg.attention_type(layer), cfg.head_dim
        f32 = torch.float32
        w = cls(kind, get(a + "wq_a.weight", dtype), get(a + "q_norm.weight", f32), get(a + "wq_b.weight", dtype),
                get(a + "wkv.weight", dtype), get(a + "norm.weight", f32), get(a + "wo_a.weight", dtype),
                get(a + "wo_b.weight", dtype), get(a + "attn_sink", f32))  # fmt: skip
        if kind != SLIDING:
            w.compressor = CompressorWeights.load(
                get, a + "compressor.", cfg.compress_ratio(layer), D, 0, dtype
            )
        if kind == CSA:
            main = w.compressor
            comp = CompressorWeights.load(
                get, a + "indexer.compressor.", cfg.compress_ratio_csa, main.state_end, main.dim, dtype
            )
            w.indexer = V4IndexerWeights(get(a + "indexer.wq_b.weight", dtype),
                                         get(a + "indexer.weights_proj.weight", dtype), comp)  # fmt: skip
        return w


def shard_heads(w: V4AttentionWeights, cfg: ModelConfig, rank: int, tp: int) -> V4AttentionWeights:
    """The attention weights of tensor-parallel rank `rank` of `tp`: a contiguous slice of the
    query heads (wq_b rows, sinks) and of the output groups they form (wo_a's groups, wo_b's
    columns), so the ranks' outputs sum to the layer's. The one K=V head, the compressors and
    the indexer are replicated: every rank writes the same cache rows and picks the same entries."""
    N, G, D = cfg.num_attention_heads, cfg.o_groups, cfg.head_dim
    if N % tp or G % tp:
        raise ValueError(f"attention_tp={tp} must divide num_attention_heads={N} and o_groups={G}")
    heads = slice(rank * N // tp, (rank + 1) * N // tp)
    groups = slice(rank * G // tp, (rank + 1) * G // tp)
    H, width = w.wo_b.shape[0], w.wo_a.shape[1]
    return replace(
        w,
        wq_b=w.wq_b.view(N, D, -1)[heads].reshape(-1, w.wq_b.shape[1]).contiguous(),
        sinks=w.sinks[heads].contiguous(),
        wo_a=w.wo_a.view(G, -1, width)[groups].reshape(-1, width).contiguous(),
        wo_b=w.wo_b.view(H, G, -1)[:, groups].reshape(H, -1).contiguous(),
    )


# ---------------------------------------------------------------------------------------------
# Compressed entries
# ---------------------------------------------------------------------------------------------
def _state_rows(state_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat state rows (state block * 64 + offset) of `positions` [..., P] through `state_table`
    [..., max_blocks] (StepBatch.state_table rows: one sequence's, or one per leading index). A
    block without a state block (-1: only where the caller masks) reads state block 0."""
    blocks = state_table.long().gather(-1, positions // BLOCK_SIZE).clamp(min=0)
    return blocks * BLOCK_SIZE + positions % BLOCK_SIZE


def entry_rows(block_table: torch.Tensor, w: torch.Tensor, r: int) -> torch.Tensor:
    """Flat entry rows (block * entries_per_block(r) + slot) of windows w through `block_table`
    [..., max_blocks]: w [E] with one sequence's table -> [E], with tables [B, max_blocks] ->
    [B, E] (the same windows of each), or w [B, 1] -> [B, 1] (one window of each). Entry w sits
    in the block of its last token w*r + r - 1, after the entries of the earlier windows ending
    there (the first is (64 * block) // r)."""
    block = (w * r + r - 1) // BLOCK_SIZE
    blocks = block_table.long().gather(-1, block.expand(*block_table.shape[:-1], block.shape[-1]))
    return blocks * entries_per_block(r) + w - (block * BLOCK_SIZE) // r


def emit_entries(
    c: CompressorWeights,
    rows: Rows,
    entries: Rows,
    batch: StepBatch,
    rope: V4Rope,
    eps: float,
    stable: bool = False,
) -> None:
    """Compute the entries of the windows this step's tokens complete (of every sequence at
    once), from the compressor states in the state rows `rows` (this step's included), into
    `entries`. stable (deterministic kernels): the gate's softmax over the window's slots (not
    the last dim) as `deterministic.softmax`, torch's giving a window other bits beside other
    windows; the rest is per window already (the pooled sum over its slots, the RMSNorm, the rope)."""
    r, d, device = c.ratio, c.dim, batch.state_table.device
    seqs, windows = [], []
    for b, n in enumerate(batch.query_lens):
        end = batch.context_lens[b]
        first, last = (end - n) // r, end // r  # windows first .. last-1 close in this step
        seqs += [b] * (last - first)
        windows += range(first, last)
    if not windows:
        return
    b, w = torch.tensor(seqs, device=device), torch.tensor(windows, device=device)  # [nw]
    span = 2 * r if c.overlap else r
    pos = (w[:, None] - (1 if c.overlap else 0)) * r + torch.arange(span, device=device)  # [nw, span]
    at = _state_rows(batch.state_table[b], pos.clamp(min=0))
    src = rows.read(at, slice(c.offset, c.state_end))  # [nw, span, 2Sd]
    kv, gate = src[..., : c.width], src[..., c.width :].float()
    if c.overlap:  # slots 0..r-1: window w-1's Ca series; r..2r-1: window w's Cb series
        kv = torch.cat((kv[:, :r, :d], kv[:, r:, d:]), dim=1)  # [nw, 2r, d]
        gate = torch.cat((gate[:, :r, :d] + c.ape[:, :d], gate[:, r:, d:] + c.ape[:, d:]), dim=1)
        before = (pos < 0)[..., None]  # window -1 does not exist: weight 0
        kv, gate = kv.masked_fill(before, 0.0), gate.masked_fill(before, float("-inf"))
    else:
        gate = gate + c.ape
    probs = deterministic.softmax(gate, 1) if stable else gate.softmax(dim=1)
    pooled = (kv * probs.to(kv.dtype)).sum(dim=1)  # [nw, d]
    entry = rope_tail(rms_norm_f32(pooled, c.norm, eps), *rope.cos_sin(w * r))
    at = entry_rows(batch.block_table[b], w[:, None], r)[:, 0]  # [nw]
    entries.write(at, c.entry_cols, entry)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
def _compressor_states(c: CompressorWeights, x: torch.Tensor, linear=F.linear) -> list[torch.Tensor]:
    """This step's state-row columns of one compressor: [kv | gate]."""
    return [linear(x, c.wkv), linear(x, c.wgate)]


def _indexer_top(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor, topk: int, index_scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `topk` best-scoring entries of each query and whether each is visible: q [Q, Hi, Di],
    weights [Q, Hi] (fp32, Hi^-0.5 in), keys [E, Di] (one context) or [Q, E, Di] indexer entries,
    lens [Q] int64 (query i sees its first lens[i] entries) -> ([Q, topk] entry indices, [Q,
    topk] bool). With fewer than `topk` visible, the invisible ones picked are marked so. E > topk.
    The scores come from the model's kernel (`index_scores`: Kernels.index_scores)."""
    scores = index_scores(q, weights, keys, lens)
    top = scores.topk(topk, dim=-1).indices
    return top, top < lens[:, None]


def _attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """One softmax over the visible keys and a per-head sink logit, the keys also the values:
    q [..., n, N, D], keys [..., K, D], visible [..., n, K], sinks [N] -> [..., n, N, D]."""
    logits = torch.einsum("...qnd,...kd->...nqk", q, keys).float() * q.shape[-1] ** -0.5  # [..., N, n, K]
    logits = logits.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    sink = sinks.view(-1, 1, 1).expand(logits.shape[:-1] + (1,))
    probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1].to(keys.dtype)
    return torch.einsum("...nqk,...kd->...qnd", probs, keys)


PREFILL_QUERIES = 256  # prefill queries attended at once (their band of window rows, their picks)


def _attend_picked(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    picked: torch.Tensor,
    seen: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """`_attend` over shared keys plus each query's own picked ones, in one softmax: q [n, N, D],
    keys [K, D] with visible [n, K] (the window rows), picked [n, P, D] with seen [n, P] (the
    entries the indexer kept for that query) -> [n, N, D] (the two halves summed in fp32, rounded
    once). Scratch is [N, n, K + P] scores, not the whole context's entries."""
    scale = q.shape[-1] ** -0.5
    shared = torch.einsum("qnd,kd->nqk", q, keys).float().masked_fill(~visible[None], float("-inf"))
    own = torch.einsum("qnd,qpd->nqp", q, picked).float().masked_fill(~seen[None], float("-inf"))
    sink = sinks.view(-1, 1, 1).expand(shared.shape[:-1] + (1,))
    probs = torch.cat((shared * scale, own * scale, sink), dim=-1).softmax(dim=-1)
    K = keys.shape[0]
    out = torch.einsum("nqk,kd->qnd", probs[..., :K], keys.float())
    return (out + torch.einsum("nqp,qpd->qnd", probs[..., K:-1], picked.float())).to(keys.dtype)


def _decode_groups(d: DecodeRows) -> list[DecodeRows]:
    """The decode rows in groups of similar context length (longest first; a group's longest is
    at most twice its shortest plus 1,024 tokens), so that padding each group to its longest costs
    little more than its rows' own context."""
    lens = d.lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or lens[order[start]] > 2 * lens[order[i]] + 1024:
            groups.append(order[start:i])
            start = i
    if len(groups) == 1:
        return [d]
    picks = [torch.tensor(g, device=d.lens.device) for g in groups]
    return [DecodeRows(d.rows[g], d.seqs[g], d.table[g], d.lens[g]) for g in picks]


def _decode_context(
    w: V4AttentionWeights,
    cfg: ModelConfig,
    rows: Rows,
    entries: Rows | None,
    batch: StepBatch,
    d: DecodeRows,
    q_idx: torch.Tensor | None,
    idx_weights: torch.Tensor | None,
    k,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and their visibility of decode rows `d` at once, padded to the longest: keys
    [Bd, window + E, D] (each row's window rows, then its entries, E the most any has; with an
    indexer, only the entries it keeps: E = top-k), visible [Bd, 1, window + E]. Padding reads other rows and entries of the cache; they are masked and
    zeroed (a non-finite value left in a freed block must not reach this step)."""
    D, window = cfg.head_dim, min(cfg.sliding_window, int(d.lens.max()))  # (no row sees further)
    kpos = d.lens[:, None] - window + torch.arange(window, device=d.lens.device)  # [Bd, window]
    at = _state_rows(batch.state_table[d.seqs], kpos.clamp(min=0))
    keys = rows.read(at, slice(0, D))  # (released rows: masked)
    visible = kpos >= 0
    c = w.compressor
    num = None if c is None else d.lens // c.ratio  # [Bd] complete windows (= entries) of each
    if num is not None and (most := int(num.max())) > 0:
        e = torch.arange(most, device=d.lens.device)
        at = entry_rows(d.table, e, c.ratio)  # [Bd, E] (the longest sequence's blocks hold them all)
        seen = e[None] < num[:, None]  # [Bd, E]
        if w.indexer is not None and most > cfg.index_topk:  # gather the kept entries: attention
            # then costs the window plus top-k, whatever the context (the indexer's scores are
            # the part that still grows with it)
            index_keys = entries.read(at, w.indexer.compressor.entry_cols).masked_fill(~seen[..., None], 0)
            top, seen = _indexer_top(q_idx[d.rows], idx_weights[d.rows], index_keys, num, cfg.index_topk,
                                     k.index_scores)  # fmt: skip
            at = at.gather(1, top)  # [Bd, topk]
        keys = torch.cat((keys, entries.read(at, c.entry_cols)), dim=1)
        visible = torch.cat((visible, seen), dim=1)
    return keys.masked_fill(~visible[..., None], 0), visible[:, None]


def _prefill(
    w: V4AttentionWeights,
    cfg: ModelConfig,
    rows: Rows,
    entries: Rows | None,
    batch: StepBatch,
    b: int,
    q: torch.Tensor,
    q_idx: torch.Tensor | None,
    idx_weights: torch.Tensor | None,
    out: torch.Tensor,
    k,
) -> None:
    """Attention of sequence b's prefill chunk into `out` [T, N, D], PREFILL_QUERIES queries at a
    time: each tile reads the band of window rows its queries see (tile + window - 1 rows, not the
    chunk's) and the entries (CSA past top-k: each query's own top-k, gathered), so its scores are
    [N, tile, tile + window - 1 + entries or top-k] however long the chunk."""
    n, end, s0 = batch.query_lens[b], batch.context_lens[b], batch.query_starts[b]
    D, window, device, c = cfg.head_dim, cfg.sliding_window, q.device, w.compressor
    at, pick = None, False
    if c is not None and end >= c.ratio:
        e = torch.arange(end // c.ratio, device=device)  # the entries so far
        at = entry_rows(batch.block_table[b], e, c.ratio)
        pick = w.indexer is not None and len(e) > cfg.index_topk
        ent = entries.read(at, (w.indexer.compressor if pick else c).entry_cols)  # [E, Di] keys / [E, D]
    for t0 in range(0, n, PREFILL_QUERIES):
        t1 = min(n, t0 + PREFILL_QUERIES)
        tile = slice(s0 + t0, s0 + t1)
        qpos = torch.arange(end - n + t0, end - n + t1, device=device)  # [t]
        kpos = torch.arange(max(0, end - n + t0 - window + 1), end - n + t1, device=device)  # their band
        keys = rows.read(_state_rows(batch.state_table[b], kpos), slice(0, D))  # [band, D]
        visible = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - window)  # [t, band]
        if at is not None:
            num = (qpos + 1) // c.ratio  # [t] complete windows (= entries) each query sees
            if pick:  # each query's own top-k, gathered: scores [t, E], picked rows [t, top-k, D]
                top, seen = _indexer_top(
                    q_idx[tile], idx_weights[tile], ent, num, cfg.index_topk, k.index_scores
                )
                picked = entries.read(at[top], c.entry_cols)
                out[tile] = _attend_picked(q[tile], keys, visible, picked, seen, w.sinks)
                continue
            keys = torch.cat((keys, ent), dim=0)
            visible = torch.cat((visible, e[None] < num[:, None]), dim=1)
        out[tile] = _attend(q[tile], keys, visible, w.sinks)


def _attend_each(w, cfg, cache, batch: StepBatch, q, q_idx, idx_weights, out: torch.Tensor, k) -> None:
    """Deterministic kernels: every query of the step, decode rows and prefill chunks alike, attended
    alone over exactly what it sees, in one order: its window rows by position, then its entries
    by window (CSA past top-k: the indexer's top-k, ties to the earlier window, in window order)
    -> out [T, N, D]. The batched paths pad a decode group to its longest context and tile a
    chunk's queries, which shapes their products and softmax rows by the batch; here only the
    reads (exact copies) are batched, PREFILL_QUERIES queries at a time; the indexer's scores are
    per (query, entry) already (k.index_scores: the C++ kernel or `index_scores_torch`)."""
    rows, entries = cache
    D, c, window, device = cfg.head_dim, w.compressor, cfg.sliding_window, q.device
    seqs = torch.tensor([b for b, n in enumerate(batch.query_lens) for _ in range(n)], device=device)
    pos = torch.tensor([p for b, n in enumerate(batch.query_lens)
                        for p in range(batch.context_lens[b] - n, batch.context_lens[b])], device=device)  # fmt: skip
    for t0 in range(0, q.shape[0], PREFILL_QUERIES):
        tile = slice(t0, min(q.shape[0], t0 + PREFILL_QUERIES))
        s, p = seqs[tile], pos[tile]
        kpos = p[:, None] - window + 1 + torch.arange(window, device=device)  # [t, window]
        keys = rows.read(_state_rows(batch.state_table[s], kpos.clamp(min=0)), slice(0, D))  # [t, window, D]
        skip = (window - 1 - p).clamp(min=0).tolist()  # (window rows before position 0)
        count = [0] * len(skip)
        if c is not None and (most := int(((p + 1) // c.ratio).max())) > 0:
            num = (p + 1) // c.ratio  # [t] complete windows (= entries) each sees
            e = torch.arange(most, device=device)
            at = entry_rows(batch.block_table[s], e, c.ratio)  # [t, most]
            if w.indexer is not None and most > cfg.index_topk:
                seen = (e[None] < num[:, None])[..., None]
                index_keys = entries.read(at, w.indexer.compressor.entry_cols).masked_fill(~seen, 0)
                scores = k.index_scores(q_idx[tile], idx_weights[tile], index_keys, num)  # [t, most]
                # (in window order: a row seeing fewer picks its -inf ones last, past num)
                at = at.gather(1, deterministic.top_indices(scores, cfg.index_topk).sort(dim=-1).values)
                num = num.clamp(max=cfg.index_topk)
            ents, count = entries.read(at, c.entry_cols), num.tolist()  # [t, E, D]
        for i, t in enumerate(range(tile.start, tile.stop)):
            own = keys[i, skip[i] :]
            # (fresh copies of q and the context: MKL's sums can depend on an operand's alignment;
            # the softmax row is this query's alone)
            ctx = own.clone() if not count[i] else torch.cat((own, ents[i, : count[i]]))
            logits = torch.mm(q[t].clone(), ctx.t()).float() * D**-0.5  # [N, K]
            probs = torch.cat((logits, w.sinks[:, None]), dim=-1).softmax(dim=-1)[:, :-1].to(ctx.dtype)
            out[t] = torch.mm(probs, ctx)


def write_state_rows(
    x: torch.Tensor,
    w: V4AttentionWeights,
    cfg: ModelConfig,
    ropes: dict[str, V4Rope],
    cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
    cache: tuple[Rows, Rows | None],
    batch: StepBatch,
    k,
) -> None:
    """What a V4 attention layer leaves in its cache for x [T, H] (its normed input), arguments as
    `v4_attention`'s: each token's state row (its roped, normed kv [D], then its compressors'
    states) at batch.state_slot_mapping, and the compressed entries of the windows the step
    completes."""
    det = bool(k.deterministic)
    linear = k.linear if det else F.linear
    cos, sin = cos_sin["main" if w.kind == SLIDING else "compress"]
    kv = rope_tail(rms_norm_f32(linear(x, w.wkv), w.kv_norm, cfg.rms_norm_eps), cos, sin)  # [T, D]
    compressors = [c for c in (w.compressor, w.indexer and w.indexer.compressor) if c is not None]
    new = torch.cat([kv] + [col for c in compressors for col in _compressor_states(c, x, linear)], dim=-1)
    rows, entries = cache
    rows.write(batch.state_slot_mapping, slice(0, None), new)
    for c in compressors:
        emit_entries(c, rows, entries, batch, ropes["compress"], cfg.rms_norm_eps, stable=det)


def v4_attention(
    x: torch.Tensor,
    w: V4AttentionWeights,
    cfg: ModelConfig,
    ropes: dict[str, V4Rope],
    cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
    cache: tuple[Rows, Rows | None],
    batch: StepBatch,
    k,
) -> torch.Tensor:
    """x [T, H] (the layer's normed attention input) -> [T, H]. cache = (state rows, entries or
    None; kv_cache.V4Cache). Writes this step's
    state rows (and the entries of the windows the step completes), then each sequence's queries
    attend to their window rows and compressed entries. k: the model's kernels (kernels/select.py:
    the indexer's scores; the rest of V4's attention is torch code). With deterministic kernels
    (kernels/deterministic.py) a token gets the same bits whatever else is in the step: the
    linears on k.linear, each query attended alone (`_attend_each`), the entries' softmax
    `deterministic.softmax`, the grouped output projection one linear per group; the RMSNorms
    (over each row's last dim) and the ropes (elementwise) are row-local as they are."""
    T, D, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    det = bool(k.deterministic)
    linear = k.linear if det else F.linear
    rope_kind = "main" if w.kind == SLIDING else "compress"
    cos, sin = cos_sin[rope_kind]
    q_lora = rms_norm_f32(linear(x, w.wq_a), w.q_norm, eps)
    q = rope_tail(rms_norm_f32(linear(q_lora, w.wq_b).view(T, -1, D), None, eps), cos, sin)  # [T, N, D]
    N = q.shape[1]
    write_state_rows(x, w, cfg, ropes, cos_sin, cache, batch, k)
    rows, entries = cache
    q_idx = idx_weights = None
    if w.indexer is not None:
        Hi = w.indexer.weights_proj.shape[0]
        q_idx = rope_tail(linear(q_lora, w.indexer.wq_b).view(T, Hi, -1), *cos_sin["compress"])
        idx_weights = linear(x, w.indexer.weights_proj).float() * Hi**-0.5

    out = torch.empty(T, N, D, dtype=x.dtype, device=x.device)
    if det:
        _attend_each(w, cfg, cache, batch, q, q_idx, idx_weights, out, k)
    else:
        if batch.decode is not None:  # the decode rows in padded batches of similar lengths
            for d in _decode_groups(batch.decode):
                keys, visible = _decode_context(w, cfg, rows, entries, batch, d, q_idx, idx_weights, k)
                out[d.rows] = _attend(q[d.rows, None], keys, visible, w.sinks)[:, 0]
        for b, n in enumerate(batch.query_lens):  # prefill chunks one sequence at a time
            if n > batch.decode_upto:  # (shorter ones are decode rows: a verify chunk's, say)
                _prefill(w, cfg, rows, entries, batch, b, q, q_idx, idx_weights, out, k)

    out = rope_tail(out, cos, -sin)  # undo the rope the values (= keys) carried
    G = cfg.o_groups * N // cfg.num_attention_heads  # (a tensor-parallel rank: its heads' groups)
    grouped = out.reshape(T, G, -1)
    wo_a = w.wo_a.view(G, -1, grouped.shape[-1])  # [G, o_lora, N*D/G]
    if det:  # (the einsum: a batched GEMM over the groups, shaped by T)
        return linear(torch.cat([linear(grouped[:, g], wo_a[g]) for g in range(G)], dim=-1), w.wo_b)
    return F.linear(torch.einsum("tgi,goi->tgo", grouped, wo_a).reshape(T, -1), w.wo_b)
