"""The attention side of DeepSeek-V3: embeddings, MLA over the paged latent cache, dense MLPs,
the MoE gate, shared experts, final norm and LM head. Routed experts are *not* here: at every
MoE layer the forward pass hands the routed tokens to an expert backend (local packed experts
in `LocalEngine`, gRPC expert workers in the cluster) through two generator messages:

    handle = yield ExpertDispatch(decoder_layer, moe_layer, x, topk_idx, topk_weight, counts)
    ... shared experts run here, overlapping the routed work ...           (backend starts the work)
    routed = yield ExpertCombine(handle)                                   (backend returns [T, H])

A driver (`run_interleaved`) answers them, so the model math stays free of threads, RPCs and
event loops. "decoder_layer" is a layer's index among all decoder layers (checkpoint names, the
Dispatch RPC); "moe_layer" its index among the MoE layers (placements, load counts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.model.kernels.cpu_kernels import linear

from .batch import DecodeRows, StepBatch
from .checkpoint import CheckpointReader
from .config import ModelConfig
from .fp8 import Fp8Weight
from .indexer import IndexQueries, index_keys
from .kernels import cpu_kernels
from .kernels.gpu import FLASH_MLA, TRITON
from .kv_cache import (
    BLOCK_SIZE,
    dequantize_index_keys,
    dequantize_latent_rows,
    fp8_latent_bytes,
    quantize_latent_rows,
)
from .layers import Rope, add_rms_norm, dense_ffn, rms_norm, route
from .messages import ExpertCombine, ExpertDispatch, StepGen
from .weights import LayerWeights, MLAWeights, load_layer, load_layers, shard_heads

NORM_EPS_LATENT = 1e-6  # q_a_layernorm / kv_a_layernorm always use 1e-6 (HF, DeepSeek)


# ---------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------
def sparse_decode(q, cache, rows, count, C: int, scale: float) -> torch.Tensor:
    """Decode attention over chosen cache rows (V3.2's top-k): q [Bd, N, C+R], rows [Bd, k] flat
    cache rows (block * 64 + offset), the first count[b] of them used -> o_lat [Bd, N, C]. The
    Triton kernel where it runs (CUDA), else a torch gather (FP8 rows: dequantised as gathered)."""
    o = TRITON.mla_decode(q, cache, None, count, C, scale, rows=rows)
    if o is None:
        ctx = cache.view(-1, cache.shape[-1])[rows]  # [Bd, k, W]
        if ctx.dtype == torch.uint8:
            ctx = dequantize_latent_rows(ctx, C, q.shape[-1] - C, q.dtype)
        scores = torch.bmm(q, ctx[..., : q.shape[-1]].transpose(1, 2)).float() * scale  # [Bd, N, k]
        unused = torch.arange(rows.shape[1], device=q.device)[None, :] >= count[:, None]
        probs = scores.masked_fill_(unused[:, None], float("-inf")).softmax(dim=-1).to(q.dtype)
        o = torch.bmm(probs, ctx[..., :C])
    return o


def cached_index_keys(flat: torch.Tensor, slots: torch.Tensor, C: int, R: int, Di: int) -> torch.Tensor:
    """V3.2's indexer keys [..., Di] of the rows `slots` (flat cache rows, any shape) of flat [rows,
    W]: each row's tail, dequantised where the rows are FP8 (kv_cache.quantize_latent_rows)."""
    if flat.dtype != torch.uint8:
        return flat[slots, C + R :]
    return dequantize_index_keys(flat[slots, fp8_latent_bytes(C, R) :], Di)


def absorb_q(q_nope: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """The absorbed form's latent queries: q_nope [T, N, D] @ W_UK (kv_b [N, D+V, C]) -> [T, N, C]
    (per-head dots on the CPU at decode sizes, cpu_kernels.absorb; a batched matmul otherwise)."""
    D = q_nope.shape[-1]
    q_lat = cpu_kernels.absorb(q_nope, kv_b, D, "q")
    return q_lat if q_lat is not None else torch.bmm(q_nope.transpose(0, 1), kv_b[:, :D]).transpose(0, 1)


def absorb_o(o_lat: torch.Tensor, kv_b: torch.Tensor, D: int) -> torch.Tensor:
    """The absorbed form's outputs: o_lat [T, N, C] through W_UV (kv_b [N, D+V, C], its rows from
    D on) -> [T, N, V] (per-head dots on the CPU at decode sizes, else a batched matmul)."""
    o = cpu_kernels.absorb(o_lat, kv_b, D, "o")
    return (
        o if o is not None else torch.bmm(o_lat.transpose(0, 1), kv_b[:, D:].transpose(1, 2)).transpose(0, 1)
    )


def paged_decode(q: torch.Tensor, cache: torch.Tensor, dec: DecodeRows, C: int, scale: float) -> torch.Tensor:
    """Decode attention over each row's paged context: q [Bd, N, C+R] absorbed latent queries,
    cache [blocks, 64, 1, W] -> o_lat [Bd, N, C]. FlashMLA where it applies (Hopper, installed),
    else the Triton split-KV kernel (CUDA; also over FP8 rows), else the C++ kernel (fp32 CPU),
    else torch ops."""
    # FP8 latent rows: the Triton or C++ kernel reads them, or torch dequantizes
    fp8 = cache.dtype == torch.uint8
    o = None if fp8 else FLASH_MLA.mla_decode(q, cache, dec, C, scale)
    if o is None:
        o = TRITON.mla_decode(q, cache, dec.table, dec.lens, C, scale)
    if o is None:  # fp32 CPU: one call over the paged cache in place (cpu_kernels.py)
        o = cpu_kernels.mla_decode(q, cache, dec.table, dec.lens, C, scale)
    if o is None:
        ctx = cache[dec.table].view(q.shape[0], -1, cache.shape[-1])  # [Bd, Lmax, W]
        if fp8:
            ctx = dequantize_latent_rows(ctx, C, q.shape[-1] - C, q.dtype)
        scores = torch.bmm(q, ctx[..., : q.shape[-1]].transpose(1, 2)).float() * scale  # [Bd, N, Lmax]
        scores.masked_fill_(dec.pad, float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype)
        o = torch.bmm(probs, ctx[..., :C])  # [Bd, N, C]
    return o


def mla_forward(
    x: torch.Tensor,
    w: MLAWeights,
    cfg: ModelConfig,
    rope: Rope,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache: torch.Tensor,
    batch: StepBatch,
) -> torch.Tensor:
    """x [T, H] -> [T, H]. Writes this step's rows into `cache` [blocks, 64, 1, W]: the latent
    [c_kv | k_pe] (W = C+R), for V3.2 followed by the indexer key (W = C+R+index_head_dim).

    Decode rows (query_len 1) use the absorbed form against the paged cache: q_nope @ W_UK gives
    a 512-wide latent query, scores against [c_kv | k_pe] rows, the softmax-weighted c_kv is
    projected by W_UV. Prefill chunks use the naive form (expand c_kv through kv_b_proj into
    per-head K/V, causal over the whole context). With a V3.2 indexer each query attends only
    to its top-k context tokens (the others are masked out; see indexer.py). The number of heads
    is read from the weight shapes, so a rank of attention tensor parallelism passes its head slice.
    """
    T = x.shape[0]
    D, R, C, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    dec = batch.decode
    only_decodes = dec is not None and dec.rows.shape[0] == T  # every row a decode, in order
    cpu = x.device.type == "cpu" and not TRITON.enabled(x)  # (not the interpreter's tests)
    if only_decodes and rope.interleave and cpu:
        # a decode-only step on an fp32 CPU: this whole function in one C++ call (cpu_kernels.py)
        out = cpu_kernels.mla_decode_layer(x, w, cos_sin, cache, batch.slot_mapping, dec.table, dec.lens, cfg,
                                           NORM_EPS_LATENT)  # fmt: skip
        if out is not None:
            return out
    if w.q_proj is not None:
        q_lora, q = None, linear(x, w.q_proj)
    else:
        q_lora = rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, NORM_EPS_LATENT)
        q = linear(q_lora, w.q_b)
    q = q.view(T, -1, D + R)
    N = q.shape[1]
    cos, sin = cos_sin
    kv = linear(x, w.kv_a, w.kv_a_bias)
    W, index = cache.shape[-1], None
    fp8 = cache.dtype == torch.uint8  # FP8 latent rows (kv_cache.quantize_latent_rows)
    q_nope, q_pe = q[..., :D], None
    if w.indexer is None and not fp8:  # on a GPU one kernel: the latent norm, both ropes and the cache write
        q_pe = TRITON.latent_to_cache(kv, q[..., D:], w.kv_a_norm, cos, sin,
                                  batch.slot_mapping, cache, rope.interleave, NORM_EPS_LATENT)  # fmt: skip
    if q_pe is None:
        q_pe = rope.apply(q[..., D:], cos, sin)
        rows = [rms_norm(kv[:, :C], w.kv_a_norm, NORM_EPS_LATENT), rope.apply(kv[:, C:], cos, sin)]
        if w.indexer is not None:  # V3.2: cache the indexer keys too; score the context for our queries
            rows.append(index_keys(x, w.indexer, cos_sin))
            index = IndexQueries.build(x, q_lora, w.indexer, cfg, cos_sin)
        written = quantize_latent_rows(*rows) if fp8 else torch.cat(rows, dim=-1).to(cache.dtype)
        cache.view(-1, W)[batch.slot_mapping] = written

    kv_b = w.kv_b.view(N, D + V, C)
    out = None if only_decodes else torch.empty(T, N, V, dtype=x.dtype, device=x.device)
    scale = cfg.softmax_scale

    if dec is not None:
        Bd = dec.rows.shape[0]
        q_nope_d, q_pe_d = (q_nope, q_pe) if only_decodes else (q_nope[dec.rows], q_pe[dec.rows])
        q_full = torch.cat((absorb_q(q_nope_d, kv_b), q_pe_d), dim=-1)  # [Bd, N, C+R]
        if index is not None:  # V3.2: score the context, attend to each query's top-k rows only
            flat = cache.view(-1, W)
            slots = (dec.table[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=x.device)).view(
                Bd, -1
            )
            keys = cached_index_keys(flat, slots, C, R, index.q.shape[-1])  # [Bd, L, Di]
            pos, count = index.select(dec.rows, keys, ~dec.pad[:, 0])
            o_lat = sparse_decode(q_full, cache, slots.gather(1, pos), count, C, scale)
        else:
            o_lat = paged_decode(q_full, cache, dec, C, scale)
        o = absorb_o(o_lat, kv_b, D)  # [Bd, N, V]
        if only_decodes:
            return linear(o.reshape(T, N * V), w.o, w.o_bias)
        out[dec.rows] = o

    starts = batch.query_starts
    for b, n in enumerate(batch.query_lens):
        if n == 1:
            continue
        L, s0 = batch.context_lens[b], starts[b]
        blocks = batch.block_table[b, : (L + BLOCK_SIZE - 1) // BLOCK_SIZE].long()
        if index is not None:  # V3.2: each query attends to its top-k context tokens, gathered
            out[s0 : s0 + n] = sparse_prefill(q_nope[s0 : s0 + n], q_pe[s0 : s0 + n], s0, index, cache, blocks, L,
                                              kv_b, C, R, scale)  # fmt: skip
            continue
        o = absorbed_prefill(q_nope[s0 : s0 + n], q_pe[s0 : s0 + n], cache, blocks, L, kv_b, C, scale)
        if o is None:  # (CPU: tiled over keys)
            qb = torch.cat((q_nope[s0 : s0 + n], q_pe[s0 : s0 + n]), dim=-1)  # [n, N, D+R]
            o = prefill_attention(qb, cache, blocks, L, kv_b, C, R, scale)
        out[s0 : s0 + n] = o.to(x.dtype)

    return linear(out.view(T, N * V), w.o, w.o_bias)


SPARSE_PREFILL_BYTES = 32 << 20  # V3.2 prefill: a query tile's index scores or gathered rows


def sparse_prefill(q_nope, q_pe, s0: int, index: IndexQueries, cache, blocks, L: int, kv_b, C: int, R: int,
                   scale: float) -> torch.Tensor:  # fmt: skip
    """DeepSeek-V3.2's prefill attention, gathered: q_nope [n, N, D], q_pe [n, N, R] (the step's
    queries s0 .. s0+n-1, positions L-n .. L-1 of one sequence) -> [n, N, V]. Per query tile: the
    indexer picks each query's top-k context tokens (`IndexQueries.select`), their cache rows are
    gathered and attended in the absorbed form, as decode does (`sparse_decode`): the cost grows
    with top-k, not with the context (but for the indexer's own scores, one dot per token and
    index head). Tiles are sized so the index scores [tile, Hi, L] and the gathered rows [tile,
    k, W] stay within SPARSE_PREFILL_BYTES."""
    n, D, W = q_nope.shape[0], q_nope.shape[-1], cache.shape[-1]
    flat_rows = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=blocks.device)).view(-1)[:L]
    keys = cached_index_keys(cache.view(-1, W), flat_rows, C, R, index.q.shape[-1])  # [L, Di]
    k, heads = min(index.topk, L), index.q.shape[1]
    tile = max(1, SPARSE_PREFILL_BYTES // (4 * max(k * W, heads * L)))
    out = []
    for q0 in range(0, n, tile):
        q1 = min(n, q0 + tile)
        positions = torch.arange(L - n + q0, L - n + q1, device=keys.device)
        visible = torch.arange(L, device=keys.device)[None, :] <= positions[:, None]  # [t, L] causal
        pos, count = index.select(torch.arange(s0 + q0, s0 + q1, device=keys.device), keys, visible)
        q_full = torch.cat((absorb_q(q_nope[q0:q1], kv_b), q_pe[q0:q1]), dim=-1)  # [t, N, C+R]
        out.append(absorb_o(sparse_decode(q_full, cache, flat_rows[pos], count, C, scale), kv_b, D))
    return torch.cat(out)


PREFILL_SCORE_BYTES = 4 << 20  # fp32 scores of one (query tile, key tile): ~L2-sized tiles ran fastest here
PREFILL_KEY_TILE = 8 * BLOCK_SIZE  # context tokens whose K/V are expanded at a time


def absorbed_prefill(q_nope, q_pe, cache, blocks, L: int, kv_b, C: int, scale: float) -> torch.Tensor | None:
    """Causal MLA of one sequence's prefill chunk on the Triton decode kernel: q_nope [n, N, D],
    q_pe [n, N, R] (positions L-n .. L-1), the context's `blocks` [ceil(L / 64)] -> [n, N, V], or
    None where the kernel does not run (CPU without the interpreter). Each query is a
    decode row of its own causal length over the same blocks, in the absorbed form: ~3.4x the
    multiply-adds of the expanded form at V3's dims, but no per-head K/V at all; its scratch is
    the chunk's [n, N, C+R] queries and [n, N, C] outputs, whatever the context. On an H200 at
    V3's heads (bench_mla_prefill, 2,048-query chunk) 16-20x prefill_attention's time."""
    if cache.dtype not in (q_nope.dtype, torch.uint8) or not TRITON.enabled(q_nope):  # (uint8: FP8 rows)
        return None
    n = q_nope.shape[0]
    q_full = torch.cat((absorb_q(q_nope, kv_b), q_pe), dim=-1)  # [n, N, C+R]
    lens = torch.arange(L - n + 1, L + 1, device=q_nope.device, dtype=torch.int32)
    o_lat = TRITON.mla_decode(q_full, cache, blocks[None].expand(n, -1), lens, C, scale)
    return None if o_lat is None else absorb_o(o_lat, kv_b, q_nope.shape[-1])


def prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    L: int,
    kv_b: torch.Tensor,
    C: int,
    R: int,
    scale: float,
) -> torch.Tensor:
    """Causal MLA of one sequence's prefill chunk, tiled: q [n, N, D+R] (the queries of positions
    L-n .. L-1) against the sequence's L context tokens in `cache` [blocks, 64, 1, W] (its
    `blocks` [ceil(L / 64)]; a row is [c_kv | k_pe | ...]), kv_b [N, D+V, C] (W_UK rows, then
    W_UV) -> [n, N, V] fp32.

    Keys come PREFILL_KEY_TILE context tokens at a time (their c_kv expanded to per-head K/V for
    that tile only) and queries in tiles whose scores fit PREFILL_SCORE_BYTES; each query keeps a
    running max and sum (flash attention's online softmax), so the scratch is a few tiles however
    long the context. Tiles wholly in a query tile's future are skipped. (V3.2 attends to gathered
    top-k rows instead: `sparse_prefill`.)
    """
    n, N, _ = q.shape
    W, D = cache.shape[-1], q.shape[-1] - R
    V = kv_b.shape[1] - D
    tq = max(1, min(n, PREFILL_SCORE_BYTES // (4 * N * PREFILL_KEY_TILE)))
    out = torch.zeros(n, N, V, dtype=torch.float32, device=q.device)
    top = torch.full((N, n), float("-inf"), device=q.device)  # running max of each query's scores
    total = torch.zeros(N, n, device=q.device)  # running sum of exp(score - max)
    qpos = torch.arange(L - n, L, device=q.device)
    for k0 in range(0, L, PREFILL_KEY_TILE):
        k1 = min(L, k0 + PREFILL_KEY_TILE)
        rows = cache[blocks[k0 // BLOCK_SIZE : -(-k1 // BLOCK_SIZE)]].view(-1, W)[: k1 - k0]  # [t, W]
        if rows.dtype == torch.uint8:  # FP8 latent rows: this tile's, dequantized
            rows = dequantize_latent_rows(rows, C, R, q.dtype)
        kv = linear(rows[:, :C], kv_b.view(-1, C)).view(k1 - k0, N, D + V)
        k = torch.cat((kv[..., :D], rows[:, None, C : C + R].expand(-1, N, R)), dim=-1)  # [t, N, D+R]
        v = kv[..., D:]
        for q0 in range(0, n, tq):
            q1 = min(n, q0 + tq)
            if k0 > L - n + q1 - 1:  # every key of the tile is after every query of this one
                continue
            scores = torch.einsum("qnd,knd->nqk", q[q0:q1], k).float() * scale  # [N, tq, t]
            if k1 - 1 > L - n + q0:  # (the diagonal: some keys after some queries)
                future = torch.arange(k0, k1, device=q.device)[None, :] > qpos[q0:q1, None]
                scores.masked_fill_(future[None], float("-inf"))
            was = top[:, q0:q1].clone()
            now = torch.maximum(was, scores.amax(-1))  # [N, tq]
            top[:, q0:q1] = now
            now.masked_fill_(now == float("-inf"), 0.0)  # (a query that has seen nothing yet)
            probs = scores.sub_(now[..., None]).exp_()  # (in place: the scores are one tile's scratch)
            rescale = torch.exp(was - now)
            total[:, q0:q1] = total[:, q0:q1] * rescale + probs.sum(-1)
            acc = out[q0:q1]
            acc.mul_(rescale.t()[..., None]).add_(torch.einsum("nqk,knv->qnv", probs.to(v.dtype), v).float())
    return out.div_(total.t()[..., None])


# ---------------------------------------------------------------------------------------------
# The model (attention side)
# ---------------------------------------------------------------------------------------------
class DeepseekV3:
    """Everything but the routed experts, with weights as plain tensors."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.cfg, self.embed, self.layers, self.norm, self.lm_head = cfg, embed, layers, norm, lm_head
        self.dtype, self.device = dtype, torch.device(device)
        self.rope = Rope(cfg, self.device)
        # attention tensor parallelism: sums the ranks' partial attention outputs (an all-reduce)
        self.attn_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shard_attention(self, rank: int, tp: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keep only rank `rank` of `tp`'s slice of every layer's heads (the latent projections
        stay whole: every rank holds the full latent cache); `reduce` sums the ranks' partial
        attention outputs."""
        for layer in self.layers:
            layer.attn = shard_heads(layer.attn, self.cfg, rank, tp)
        self.attn_reduce = reduce

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        progress=None,
        weight_dtype: torch.dtype | None = None,
        keep_fp8: bool = False,
    ) -> DeepseekV3:
        """Read the attention-side weights; no routed-expert tensor is touched. weight_dtype: the
        linears' and the LM head's storage (see `weights.load_layer`); None: `dtype`. keep_fp8: the
        linears of an FP8 checkpoint kept FP8 with their block scales (the LM head is not FP8)."""
        load = functools.partial(load_layer, weight_dtype=weight_dtype, keep_fp8=keep_fp8)
        layers = load_layers(load, reader, cfg, dtype, progress)
        embed = reader.get("model.embed_tokens.weight", dtype)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        head = reader.get(head_name, weight_dtype or dtype)
        model = cls(cfg, embed, layers, reader.get("model.norm.weight", dtype), head, dtype)
        return model.to(device)

    def nbytes(self) -> int:
        """Bytes of the attention-side weights (FP8 linears with their scales)."""

        def size(v) -> int:
            if isinstance(v, Fp8Weight):
                return v.weight.nbytes + v.scale.nbytes
            return v.nbytes if isinstance(v, torch.Tensor) else 0

        parts = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            parts += [*vars(layer).values(), *vars(layer.attn).values()]
            if layer.attn.indexer is not None:
                parts += vars(layer.attn.indexer).values()
        return sum(size(v) for v in parts)

    def to(self, device: torch.device | str) -> DeepseekV3:
        device = torch.device(device)
        if device == self.device:
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731

        def move_fields(obj):
            for k, v in vars(obj).items():
                if isinstance(v, torch.Tensor | Fp8Weight):
                    setattr(obj, k, move(v))

        for layer in self.layers:
            move_fields(layer)
            move_fields(layer.attn)
            if layer.attn.indexer is not None:
                move_fields(layer.attn.indexer)
        self.embed, self.norm, self.lm_head = move(self.embed), move(self.norm), move(self.lm_head)
        self.device = device
        self.rope = Rope(self.cfg, device)
        return self

    def forward(self, batch: StepBatch, latent_cache: torch.Tensor) -> StepGen:
        """One step. latent_cache [layers, blocks, 64, 1, cfg.cache_dim]. Yields expert messages at every
        MoE layer; returns fp32 logits [len(batch.logits_index), vocab]."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        h = F.embedding(batch.input_ids, self.embed)  # the residual stream
        delta = None  # what the last sublayer adds to it (added with the next norm: add_rms_norm)
        cos_sin = self.rope.cos_sin(batch.positions, self.dtype)
        for i, layer in enumerate(self.layers):
            h, x = add_rms_norm(h, delta, layer.input_norm, eps)
            attn = mla_forward(x, layer.attn, cfg, self.rope, cos_sin, latent_cache[i], batch)
            if self.attn_reduce is not None:  # tensor parallel: sum the ranks' head slices
                attn = self.attn_reduce(attn)
            h, x = add_rms_norm(h, attn, layer.post_norm, eps)
            if not layer.is_moe:
                delta = dense_ffn(x, layer.mlp_w13, layer.mlp_down)
                continue
            topk_idx, topk_weight = route(x, layer.router, layer.router_bias, cfg)
            msg = ExpertDispatch.routed(i, layer.moe_layer, x, topk_idx, topk_weight, cfg.n_routed_experts)
            handle = yield msg
            shared = dense_ffn(x, layer.mlp_w13, layer.mlp_down) if layer.mlp_w13 is not None else 0
            routed = yield ExpertCombine(handle)
            delta = routed + shared
        rows = batch.logits_index
        _, last = add_rms_norm(h[rows], None if delta is None else delta[rows], self.norm, eps)
        return linear(last, self.lm_head).float()
