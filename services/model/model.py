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

Every kernel call (norms, linears, rope, the router, MLPs, attention) goes through the model's
`kernels` (kernels/select.py), chosen once for its device and dtype: `kernels.mla_decode(...)`
runs whatever was chosen (FlashMLA, Triton, C++ or torch), with no fallback per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .checkpoint import CheckpointReader
from .config import ModelConfig
from .fp8 import Fp8Weight
from .indexer import IndexQueries, index_keys
from .kernels.deterministic import expand_dispatch, sum_choices
from .kernels.select import Kernels, select_kernels
from .kv_cache import BLOCK_SIZE, dequantize_index_keys, fp8_latent_bytes
from .layers import Rope
from .messages import ExpertCombine, ExpertDispatch, StepGen
from .mtp import MTPWeights, load_mtp, module_input, mtp_forward
from .weights import LayerWeights, MLAWeights, load_layer, load_layers, shard_heads

NORM_EPS_LATENT = 1e-6  # q_a_layernorm / kv_a_layernorm always use 1e-6 (HF, DeepSeek)


# ---------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------
def cached_index_keys(flat: torch.Tensor, slots: torch.Tensor, C: int, R: int, Di: int) -> torch.Tensor:
    """V3.2's indexer keys [..., Di] of the rows `slots` (flat cache rows, any shape) of flat [rows,
    W]: each row's tail, dequantised where the rows are FP8 (kv_cache.quantize_latent_rows)."""
    if flat.dtype != torch.uint8:
        return flat[slots, C + R :]
    return dequantize_index_keys(flat[slots, fp8_latent_bytes(C, R) :], Di)


def add_rms_norm(
    k: Kernels, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream h [T, H] plus a sublayer's output delta [T, H] (None: nothing to add
    yet, the first layer), and its RMSNorm: (h + delta, rms_norm(h + delta)), one kernel call."""
    if delta is None:
        return h, k.rms_norm(h, weight, eps)
    return k.add_rms_norm(h, delta, weight, eps)


def mla_forward(
    x: torch.Tensor,
    w: MLAWeights,
    cfg: ModelConfig,
    k: Kernels,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache: torch.Tensor,
    batch: StepBatch,
) -> torch.Tensor:
    """x [T, H] -> [T, H], on the kernels `k`. Writes this step's rows into `cache` [blocks, 64,
    1, W]: the latent [c_kv | k_pe] (W = C+R), for V3.2 followed by the indexer key (W =
    C+R+index_head_dim).

    Decode rows (query_len 1) use the absorbed form against the paged cache: q_nope @ W_UK gives
    a 512-wide latent query, scores against [c_kv | k_pe] rows, the softmax-weighted c_kv is
    projected by W_UV. Prefill chunks attend causally over the whole context (k.mla_prefill: the
    expanded form in key tiles, or the absorbed form on the decode kernel). With a V3.2 indexer
    each query attends only to its top-k context tokens (the others are masked out; see
    indexer.py). The number of heads is read from the weight shapes, so a rank of attention
    tensor parallelism passes its head slice. A decode-only step on kernels with a fused layer
    (k.mla_decode_layer: the C++ one) is that one call.
    """
    T = x.shape[0]
    D, R, C, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    dec = batch.decode
    only_decodes = dec is not None and dec.rows.shape[0] == T  # every row a decode, in order
    if only_decodes and k.mla_decode_layer is not None:  # (this whole function in one call)
        return k.mla_decode_layer(x, w, cos_sin, cache, batch.slot_mapping, dec.table, dec.lens, cfg,
                                  NORM_EPS_LATENT)  # fmt: skip
    linear = k.linear
    if w.q_proj is not None:
        q_lora, q = None, linear(x, w.q_proj)
    else:
        q_lora = k.rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, NORM_EPS_LATENT)
        q = linear(q_lora, w.q_b)
    q = q.view(T, -1, D + R)
    N = q.shape[1]
    W, index = cache.shape[-1], None
    if w.indexer is not None:  # V3.2: score the context for our queries
        index = IndexQueries.build(x, q_lora, w.indexer, cfg, cos_sin, k)
    q_pe = write_latent_rows(x, w, k, cos_sin, cache, batch, q[..., D:])
    q_nope = q[..., :D]

    kv_b = w.kv_b.view(N, D + V, C)
    out = None if only_decodes else torch.empty(T, N, V, dtype=x.dtype, device=x.device)
    scale = cfg.softmax_scale

    if dec is not None:
        Bd = dec.rows.shape[0]
        q_nope_d, q_pe_d = (q_nope, q_pe) if only_decodes else (q_nope[dec.rows], q_pe[dec.rows])
        q_full = torch.cat((k.absorb_q(q_nope_d, kv_b), q_pe_d), dim=-1)  # [Bd, N, C+R]
        if index is not None:  # V3.2: score the context, attend to each query's top-k rows only
            flat = cache.view(-1, W)
            slots = (dec.table[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=x.device)).view(
                Bd, -1
            )
            keys = cached_index_keys(flat, slots, C, R, index.q.shape[-1])  # [Bd, L, Di]
            pos, count = index.select(dec.rows, keys, ~dec.pad[:, 0])
            o_lat = k.sparse_decode(q_full, cache, slots.gather(1, pos), count, C, scale)
        else:
            o_lat = k.mla_decode(q_full, cache, dec, C, scale)
        o = k.absorb_o(o_lat, kv_b, D)  # [Bd, N, V]
        if only_decodes:
            return linear(o.reshape(T, N * V), w.o, w.o_bias)
        out[dec.rows] = o

    starts = batch.query_starts
    for b, n in enumerate(batch.query_lens):
        if n <= batch.decode_upto:  # (its rows are decode rows: done above)
            continue
        L, s0 = batch.context_lens[b], starts[b]
        blocks = batch.block_table[b, : (L + BLOCK_SIZE - 1) // BLOCK_SIZE].long()
        if index is not None:  # V3.2: each query attends to its top-k context tokens, gathered
            out[s0 : s0 + n] = sparse_prefill(q_nope[s0 : s0 + n], q_pe[s0 : s0 + n], s0, index, cache, blocks, L,
                                              kv_b, C, R, scale, k)  # fmt: skip
            continue
        o = k.mla_prefill(q_nope[s0 : s0 + n], q_pe[s0 : s0 + n], cache, blocks, L, kv_b, C, scale)
        out[s0 : s0 + n] = o.to(x.dtype)

    return linear(out.view(T, N * V), w.o, w.o_bias)


def write_latent_rows(
    x: torch.Tensor,
    w: MLAWeights,
    k: Kernels,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache: torch.Tensor,
    batch: StepBatch,
    q_pe: torch.Tensor | None = None,
) -> torch.Tensor:
    """An MLA layer's cache rows for x [T, H] (its normed input), written at batch.slot_mapping into
    `cache`: kv_a, the latent norm and rope, for V3.2 the indexer key (FP8 rows:
    kv_cache.quantize_latent_rows). Returns q_pe [T, N, R] roped in the same kernel call (None: no
    queries, only the rows: a [T, 1, R] stand-in is roped)."""
    cos, sin = cos_sin
    kv = k.linear(x, w.kv_a, w.kv_a_bias)
    if q_pe is None:
        q_pe = kv.new_zeros(x.shape[0], 1, cos.shape[-1] * 2)
    index_key = index_keys(x, w.indexer, cos_sin, k) if w.indexer is not None else None
    return k.latent_to_cache(kv, q_pe, w.kv_a_norm, cos, sin, batch.slot_mapping, cache, NORM_EPS_LATENT,
                             index_key)  # fmt: skip


SPARSE_PREFILL_BYTES = 32 << 20  # V3.2 prefill: a query tile's index scores or gathered rows


def sparse_prefill(q_nope, q_pe, s0: int, index: IndexQueries, cache, blocks, L: int, kv_b, C: int, R: int,
                   scale: float, kernels: Kernels) -> torch.Tensor:  # fmt: skip
    """DeepSeek-V3.2's prefill attention, gathered: q_nope [n, N, D], q_pe [n, N, R] (the step's
    queries s0 .. s0+n-1, positions L-n .. L-1 of one sequence) -> [n, N, V]. Per query tile: the
    indexer picks each query's top-k context tokens (`IndexQueries.select`), their cache rows are
    gathered and attended in the absorbed form, as decode does (kernels.sparse_decode): the cost grows
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
        q_full = torch.cat((kernels.absorb_q(q_nope[q0:q1], kv_b), q_pe[q0:q1]), dim=-1)  # [t, N, C+R]
        o_lat = kernels.sparse_decode(q_full, cache, flat_rows[pos], count, C, scale)
        out.append(kernels.absorb_o(o_lat, kv_b, D))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# The model (attention side)
# ---------------------------------------------------------------------------------------------
class DeepseekV3:
    """Everything but the routed experts, with weights as plain tensors, computed on `kernels`
    (kernels/select.py: chosen once for the model's device and dtype; an engine passes the ones it
    selected, else the default selection for `device`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kernels: Kernels | None = None,
    ):
        self.cfg, self.embed, self.layers, self.norm, self.lm_head = cfg, embed, layers, norm, lm_head
        self.dtype, self.device = dtype, torch.device(device)
        self.kernels = kernels if kernels is not None else select_kernels(self.device, dtype, cfg)
        self.rope = Rope(cfg, self.device)
        # attention tensor parallelism: sums the ranks' partial attention outputs (an all-reduce)
        self.attn_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # whether the expert backend adds each token's expert outputs in ascending expert order, in
        # fp32, from zero (moe.LocalExperts); else, with deterministic kernels, the model asks for one
        # row per (token, choice) and adds them itself in that order (kernels/deterministic.py)
        self.experts_sum_in_order = False
        self.mtp: list[MTPWeights] = []  # the MTP modules, where loaded (load(mtp=True)): mtp.py

    def shard_attention(self, rank: int, tp: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keep only rank `rank` of `tp`'s slice of every layer's heads (the latent projections
        stay whole: every rank holds the full latent cache); `reduce` sums the ranks' partial
        attention outputs. The MTP modules' layers too."""
        for layer in [*self.layers, *(m.layer for m in self.mtp)]:
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
        kernels: Kernels | None = None,
        mtp: bool = False,
    ) -> DeepseekV3:
        """Read the attention-side weights; no routed-expert tensor is touched. weight_dtype: the
        linears' and the LM head's storage (see `weights.load_layer`); None: `dtype`. keep_fp8: the
        linears of an FP8 checkpoint kept FP8 with their block scales (the LM head is not FP8).
        kernels: what the model computes with (None: select_kernels' default for `device`, these
        weights and a cache in `dtype`). mtp: also the checkpoint's multi-token-prediction modules
        (cfg.num_nextn_predict_layers of them: mtp.py), for speculative decoding."""
        if kernels is None:
            kernels = select_kernels(device, dtype, cfg, weight_dtype=weight_dtype, fp8_linears=keep_fp8)
        load = functools.partial(load_layer, weight_dtype=weight_dtype, keep_fp8=keep_fp8)
        layers = load_layers(load, reader, cfg, dtype, progress)
        embed = reader.get("model.embed_tokens.weight", dtype)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        head = reader.get(head_name, weight_dtype or dtype)
        model = cls(cfg, embed, layers, reader.get("model.norm.weight", dtype), head, dtype, kernels=kernels)
        if mtp:
            model.mtp = load_mtp(reader, cfg, dtype, load, head, weight_dtype, keep_fp8)
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
        for m in self.mtp:
            parts += [t for t in m.tensors() if t is not self.lm_head]
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
        head = self.lm_head
        self.embed, self.norm, self.lm_head = move(self.embed), move(self.norm), move(self.lm_head)
        for m in self.mtp:
            shared, m.head = m.head is head, None if m.head is head else m.head
            m.to(device).head = self.lm_head if shared else m.head
        self.device = device
        self.rope = Rope(self.cfg, device)
        self.kernels = self.kernels.for_device(device)
        return self

    def forward(self, batch: StepBatch, latent_cache: torch.Tensor) -> StepGen:
        """One step. latent_cache [layers, blocks, 64, 1, cfg.cache_dim]. Yields expert messages at every
        MoE layer; returns fp32 logits [len(batch.logits_index), vocab]. With `batch.keep_hidden`
        (speculative decoding) it also sets `batch.hidden` [T, H]: every row's final-normed hidden
        state, the LM head's input, which the MTP module reads (mtp.py)."""
        k, eps = self.kernels, self.cfg.rms_norm_eps
        h = F.embedding(batch.input_ids, self.embed)  # the residual stream
        cos_sin = self.rope.cos_sin(batch.positions, self.dtype)
        h, delta = yield from self.decoder_layers(h, enumerate(self.layers), cos_sin, latent_cache, batch)
        if batch.keep_hidden:
            batch.hidden = add_rms_norm(k, h, delta, self.norm, eps)[1]
        rows = batch.logits_index
        _, last = add_rms_norm(k, h[rows], None if delta is None else delta[rows], self.norm, eps)
        return k.linear(last, self.lm_head).float()

    def mtp_forward(self, w: MTPWeights, batch: StepBatch, hidden: torch.Tensor, latent_cache) -> StepGen:
        """One pass of MTP module `w` (mtp.py `mtp_forward`; DeepseekV4 has its own)."""
        return mtp_forward(self, w, batch, hidden, latent_cache)

    def mtp_cache_rows(self, w: MTPWeights, batch: StepBatch, hidden: torch.Tensor, latent_cache) -> None:
        """Only what a pass of MTP module `w` (`mtp_forward`, same arguments) leaves in the cache:
        its latent rows (kv_a of its first sublayer's normed input; V3.2: with the indexer key),
        bit for bit, without its attention, its MoE layer (no expert round trip) or its head. A
        decode step that does not speculate runs this, so the module's rows stay complete for a
        later one that does."""
        x = self.kernels.rms_norm(
            module_input(self, w, batch, hidden), w.layer.input_norm, self.cfg.rms_norm_eps
        )
        cos_sin = self.rope.cos_sin(batch.positions, self.dtype)
        write_latent_rows(x, w.layer.attn, self.kernels, cos_sin, latent_cache[w.index], batch)

    def decoder_layers(self, h: torch.Tensor, layers, cos_sin, latent_cache: torch.Tensor, batch: StepBatch):
        """The residual stream h [T, H] through `layers` ((decoder-layer index, LayerWeights) pairs:
        the index picks the layer's cache slot and names it to the expert backend), yielding expert
        messages at every MoE layer; returns (h, delta): the stream and what the last sublayer adds
        to it (summed by the next norm: add_rms_norm)."""
        cfg, k = self.cfg, self.kernels
        eps = cfg.rms_norm_eps
        delta = None
        for i, layer in layers:
            h, x = add_rms_norm(k, h, delta, layer.input_norm, eps)
            attn = mla_forward(x, layer.attn, cfg, k, cos_sin, latent_cache[i], batch)
            if self.attn_reduce is not None:  # tensor parallel: sum the ranks' head slices
                attn = self.attn_reduce(attn)
            h, x = k.add_rms_norm(h, attn, layer.post_norm, eps)
            if not layer.is_moe:
                delta = k.dense_ffn(x, layer.mlp_w13, layer.mlp_down)
                continue
            topk_idx, topk_weight = k.route(x, layer.router, layer.router_bias)
            per_choice = k.deterministic and not self.experts_sum_in_order  # (summed below, in expert order)
            dispatch = expand_dispatch if per_choice else ExpertDispatch.routed
            handle = yield dispatch(i, layer.moe_layer, x, topk_idx, topk_weight, cfg.n_routed_experts)
            shared = k.dense_ffn(x, layer.mlp_w13, layer.mlp_down) if layer.mlp_w13 is not None else 0
            routed = yield ExpertCombine(handle)
            if per_choice:
                routed = sum_choices(routed, topk_idx)
            delta = routed + shared
        return h, delta
