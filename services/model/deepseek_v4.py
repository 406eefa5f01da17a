"""The attention side of DeepSeek-V4 (`model_type: deepseek_v4`): embeddings, manifold-constrained
hyper-connections (mHC), the V4 attention layers (v4_attention.py), the MoE gates (hash-routed or
sqrtsoftplus top-k), the shared expert, and the head. Routed experts stay with the expert backend:
`forward` is a generator with DeepseekV3's contract (an `ExpertDispatch.routed` / `ExpertCombine`
pair per MoE layer; every V4 layer is one), so `Engine`, `LocalExperts` and the gRPC expert
workers run it unchanged. The math is transformers' `DeepseekV4ForCausalLM`.

Shapes: T tokens, H hidden, M = hc_mult residual streams, E routed experts, K experts per token.

The residual stream is M copies of the hidden state, h [T, M, H]. Around each sub-block (attention,
then MoE) a hyper-connection computes, from RMS-normalised h flattened to [T, M*H],
    pre [T, M]  = sigmoid(fn_pre  . h * scale[0] + base) + eps      (collapse: x = sum_m pre_m h_m)
    post [T, M] = 2 * sigmoid(fn_post . h * scale[1] + base)          (expand the block's output)
    comb [T, M, M] = Sinkhorn(softmax(fn_comb . h * scale[2] + base) + eps)   (doubly stochastic)
and h <- post * block(norm(x)) + comb^T h. At the end `hc_head` collapses the streams (sigmoid
weights), then the final norm and `head.weight`.

MoE gate: scores = sqrt(softplus(x . gate^T)) (or sigmoid); "moe" layers pick the top-K of
scores + bias, "hash_moe" layers take the experts `tid2eid[token id]`; the weights are the picked
scores normalised, times routed_scaling_factor. The shared expert and the routed experts are
SwiGLUs with gate clamped to <= swiglu_limit and up to [-limit, limit].

With deterministic kernels (`kernels.deterministic`, kernels/deterministic.py) every function here
gives a token the same bits whatever else is in the step: the linears on the model's batch-invariant
ones (MKL's F.linear sums a row differently beside other rows), sigmoid / softplus / SiLU on
`deterministic`'s (torch's compute a tensor's last elements on a scalar path), hc_post's stream mix
as M ordered multiply-adds (torch.matmul's batched GEMM over T is shaped by T), and the routed
experts summed in expert order (per-choice rows where the backend does not do it). Row-local as
they are: the RMSNorms and the softmax over a row's last dim, the Sinkhorn sums and the collapse
over M (each output summed over its own M values in one order), the gate's top-k over E.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .checkpoint import CheckpointReader
from .config import ModelConfig
from .kernels import deterministic
from .kernels.deterministic import expand_dispatch, sum_choices
from .kernels.select import Kernels, select_kernels
from .kernels.torch_ops import swiglu_act
from .messages import ExpertCombine, ExpertDispatch, StepGen
from .v4_attention import (
    Rows,
    V4AttentionWeights,
    V4Rope,
    rms_norm_f32,
    shard_heads,
    v4_attention,
    write_state_rows,
)
from .weights import load_layers


@dataclass
class HyperConnection:
    fn: torch.Tensor  # [(2+M)*M, M*H] fp32 (one head: [M, M*H])
    base: torch.Tensor  # [(2+M)*M] fp32
    scale: torch.Tensor  # [3] fp32 (head: [1])


@dataclass
class V4LayerWeights:
    attn_norm: torch.Tensor  # [H] fp32
    ffn_norm: torch.Tensor  # [H] fp32
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    attn: V4AttentionWeights
    gate: torch.Tensor  # [E, H]
    gate_bias: torch.Tensor | None  # [E] fp32 ("moe" layers)
    tid2eid: torch.Tensor | None  # [vocab, K] int64 ("hash_moe" layers)
    w1: torch.Tensor  # shared expert gate [I, H]
    w2: torch.Tensor  # shared expert down [H, I]
    w3: torch.Tensor  # shared expert up [I, H]


def _load_layer(reader: CheckpointReader, cfg: ModelConfig, i: int, dtype: torch.dtype) -> V4LayerWeights:
    p, f32 = f"model.layers.{i}.", torch.float32
    get = reader.get

    def hc(name: str) -> HyperConnection:
        return HyperConnection(
            get(p + name + "_fn", f32), get(p + name + "_base", f32), get(p + name + "_scale", f32)
        )

    tid2eid = get(p + "ffn.gate.tid2eid").long() if cfg.is_hash_layer(i) else None
    return V4LayerWeights(
        attn_norm=get(p + "attn_norm.weight", f32),
        ffn_norm=get(p + "ffn_norm.weight", f32),
        hc_attn=hc("hc_attn"),
        hc_ffn=hc("hc_ffn"),
        attn=V4AttentionWeights.load(get, cfg, i, dtype),
        gate=get(p + "ffn.gate.weight", dtype),
        gate_bias=None if tid2eid is not None else reader.get_optional(p + "ffn.gate.bias", f32),
        tid2eid=tid2eid,
        w1=get(p + "ffn.shared_experts.w1.weight", dtype),
        w2=get(p + "ffn.shared_experts.w2.weight", dtype),
        w3=get(p + "ffn.shared_experts.w3.weight", dtype),
    )


@dataclass
class V4MTPWeights:
    """A DeepSeek-V4 multi-token-prediction module (DeepSeek's `MTPBlock`): a full V4 block at
    decoder-layer index `index` (sliding-window attention, `ModelConfig.attention_type`; a routed
    MoE layer) with its own input projections and its own stream-collapsing head; the embedding
    and `head.weight` are the main model's."""

    index: int  # num_hidden_layers + j: its cache slot, its experts' layer
    enorm: torch.Tensor  # [H] fp32
    hnorm: torch.Tensor  # [H] fp32
    e_proj: torch.Tensor  # [H, H]
    h_proj: torch.Tensor  # [H, H]
    norm: torch.Tensor  # [H] fp32 (before the shared head)
    hc_head: HyperConnection  # hc_head_{fn [M, M*H], base [M], scale [1]}
    layer: V4LayerWeights


def _load_mtp(reader: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype) -> list[V4MTPWeights]:
    """The checkpoint's MTP modules under `model.layers.{num_hidden_layers + j}.` (DeepSeek's own
    release names them `mtp.{j}.`: CheckpointReader.for_config reads those under the same names).
    ValueError where the config declares a module the checkpoint lacks."""
    out, f32 = [], torch.float32
    for i in cfg.mtp_layers:
        p = f"model.layers.{i}."
        if p + "e_proj.weight" not in reader:
            raise ValueError(f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the checkpoint has no "
                             f"{p}e_proj.weight (its MTP weights were dropped)")  # fmt: skip
        head = HyperConnection(*(reader.get(f"{p}hc_head_{k}", f32) for k in ("fn", "base", "scale")))
        out.append(V4MTPWeights(i, reader.get(p + "enorm.weight", f32), reader.get(p + "hnorm.weight", f32),
                                reader.get(p + "e_proj.weight", dtype), reader.get(p + "h_proj.weight", dtype),
                                reader.get(p + "norm.weight", f32), head, _load_layer(reader, cfg, i, dtype)))  # fmt: skip
    return out


def _move(obj, device: torch.device) -> None:
    """Move every tensor field of a weights dataclass (and the ones nested in it) to `device`."""
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            setattr(obj, k, v.to(device))
        elif hasattr(v, "__dataclass_fields__"):
            _move(v, device)


# ---------------------------------------------------------------------------------------------
# Hyper-connections
# ---------------------------------------------------------------------------------------------
def _ops(k: Kernels | None):
    """(linear, sigmoid): the model's batch-invariant ones with deterministic kernels `k`, else
    torch's (module docstring)."""
    if k is not None and k.deterministic:
        return k.linear, deterministic.sigmoid
    return F.linear, torch.sigmoid


def hc_pre(h: torch.Tensor, w: HyperConnection, cfg: ModelConfig, k: Kernels | None = None):
    """h [T, M, H] -> (post [T, M] fp32, comb [T, M, M] fp32, collapsed x [T, H] in h's dtype).
    k: the model's kernels (None: torch's linears)."""
    T, M, _ = h.shape
    eps = cfg.hc_eps
    linear, sigmoid = _ops(k)
    mix = linear(rms_norm_f32(h.reshape(T, -1).float(), None, cfg.rms_norm_eps), w.fn)
    pre_w, post_w, comb_w = mix.split([M, M, M * M], dim=-1)
    pre_b, post_b, comb_b = w.base.split([M, M, M * M])
    pre = sigmoid(pre_w * w.scale[0] + pre_b) + eps
    post = 2 * sigmoid(post_w * w.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, M, M) * w.scale[2] + comb_b.view(M, M), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)  # Sinkhorn-Knopp: columns, then rows/columns
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


def hc_post(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, k: Kernels | None = None
) -> torch.Tensor:
    """The streams after a block: post * out + comb^T h; h [T, M, H], out [T, H] -> [T, M, H].
    With deterministic kernels `k`, comb^T h as M multiply-adds in stream order (not a batched
    GEMM over T)."""
    dtype = h.dtype
    comb = comb.to(dtype)
    if k is not None and k.deterministic:
        mixed = comb[:, 0, :, None] * h[:, 0, None, :]  # [T, M, H]: stream j gets sum_i comb[i, j] h_i
        for i in range(1, h.shape[1]):
            mixed = mixed + comb[:, i, :, None] * h[:, i, None, :]
    else:
        mixed = torch.matmul(comb.transpose(-1, -2), h)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + mixed


def hc_head(h: torch.Tensor, w: HyperConnection, cfg: ModelConfig, k: Kernels | None = None) -> torch.Tensor:
    """The final collapse of the streams: h [T, M, H] -> [T, H]."""
    linear, sigmoid = _ops(k)
    flat = rms_norm_f32(h.flatten(1).float(), None, cfg.rms_norm_eps)
    pre = sigmoid(linear(flat, w.fn) * w.scale + w.base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


# ---------------------------------------------------------------------------------------------
# MoE gate
# ---------------------------------------------------------------------------------------------
def route_v4(
    x: torch.Tensor,
    input_ids: torch.Tensor,
    layer: V4LayerWeights,
    cfg: ModelConfig,
    k: Kernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], input_ids [T] -> (topk_idx [T, K] int64, topk_weight [T, K] fp32)."""
    linear, sigmoid = _ops(k)
    softplus = deterministic.softplus if k is not None and k.deterministic else F.softplus
    logits = linear(x.float(), layer.gate.float())
    scores = softplus(logits).sqrt() if cfg.scoring_func == "sqrtsoftplus" else sigmoid(logits)
    if layer.tid2eid is not None:  # hash routing: the experts are a function of the token id
        idx = layer.tid2eid[input_ids]
    else:
        choice = scores if layer.gate_bias is None else scores + layer.gate_bias
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    weight = scores.gather(1, idx)
    weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weight * cfg.routed_scaling_factor


# ---------------------------------------------------------------------------------------------
# The model (attention side)
# ---------------------------------------------------------------------------------------------
class DeepseekV4:
    """Everything but the routed experts, with weights as plain tensors; `kernels` as
    DeepseekV3's (V4 runs the indexer's scores and, in process, the routed experts on them)."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[V4LayerWeights],
        hc_head: HyperConnection,
        norm: torch.Tensor,
        head: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kernels: Kernels | None = None,
    ):
        self.cfg, self.embed, self.layers, self.hc_head = cfg, embed, layers, hc_head
        self.norm, self.head, self.dtype, self.device = norm, head, dtype, torch.device(device)
        self.kernels = kernels if kernels is not None else select_kernels(self.device, dtype, cfg)
        self.ropes = {"main": V4Rope(cfg, False, self.device), "compress": V4Rope(cfg, True, self.device)}
        self.attn_reduce = None  # tensor parallelism: sums the ranks' partial attention outputs
        # as DeepseekV3's: whether the expert backend adds a token's experts in expert order; else,
        # with deterministic kernels, one row per (token, choice), added here in that order
        self.experts_sum_in_order = False
        self.mtp: list[V4MTPWeights] = []  # the MTP modules, where loaded (load(mtp=True))

    def shard_attention(self, rank: int, tp: int, reduce) -> None:
        """Keep rank `rank` of `tp`'s heads and output groups in every layer (v4_attention.shard_heads;
        the cache is replicated); `reduce` sums the ranks' partial attention outputs."""
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
        kernels: Kernels | None = None,
        mtp: bool = False,
    ) -> DeepseekV4:
        """Read the attention-side weights; no routed-expert tensor is touched. kernels: what the
        model computes with (None: select_kernels' default for `device`). mtp: also the
        checkpoint's multi-token-prediction modules (`V4MTPWeights`), for speculative decoding."""
        kernels = kernels if kernels is not None else select_kernels(device, dtype, cfg)
        layers = load_layers(_load_layer, reader, cfg, dtype, progress)
        f32 = torch.float32
        head = HyperConnection(*(reader.get(f"model.hc_head.hc_{k}", f32) for k in ("fn", "base", "scale")))
        model = cls(cfg, reader.get("model.embed_tokens.weight", dtype), layers, head,
                    reader.get("model.norm.weight", f32), reader.get("head.weight", dtype), dtype,
                    kernels=kernels)  # fmt: skip
        if mtp:
            model.mtp = _load_mtp(reader, cfg, dtype)
        return model.to(device)

    def to(self, device: torch.device | str) -> DeepseekV4:
        device = torch.device(device)
        if device != self.device:
            for obj in (*self.layers, self.hc_head, *self.mtp):
                _move(obj, device)
            self.embed, self.norm, self.head = (t.to(device) for t in (self.embed, self.norm, self.head))
            self.device = device
            self.ropes = {"main": V4Rope(self.cfg, False, device), "compress": V4Rope(self.cfg, True, device)}
            self.kernels = self.kernels.for_device(device)
        return self

    def forward(self, batch: StepBatch, cache: list[tuple[Rows, Rows | None]]) -> StepGen:
        """One step. cache: per layer (state, entries) (kv_cache.V4Cache.kv, v4_attention.py). Yields
        expert messages at every layer; returns fp32 logits [len(batch.logits_index), vocab]. With
        `batch.keep_hidden` (speculative decoding) it also sets `batch.hidden` [T, M, H]: every
        row's residual streams before `hc_head`, which the MTP module reads (`mtp_forward`)."""
        x = F.embedding(batch.input_ids, self.embed)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, M, H]
        cos_sin = {name: rope.cos_sin(batch.positions) for name, rope in self.ropes.items()}
        for i, layer in enumerate(self.layers):
            h = yield from self.block(h, i, layer, cache[i], batch, cos_sin)
        if batch.keep_hidden:
            batch.hidden = h
        return self._logits(h[batch.logits_index], self.hc_head, self.norm)

    def mtp_forward(self, w: V4MTPWeights, batch: StepBatch, hidden: torch.Tensor, cache) -> StepGen:
        """One pass of MTP module `w` (DeepSeek's MTPBlock) over `batch`, whose rows are positions p
        with input_ids token p + 1, and `hidden` [T, M, H] the main model's streams at p (`forward`'s
        `batch.hidden`): streams = e_proj(enorm(embed(token p + 1))) + h_proj(hnorm(hidden)) (per
        stream), then the module's block (its state rows at p in cache[w.index]), its own
        `hc_head`, `norm` and the shared head. Returns fp32 logits [len(batch.logits_index), vocab]
        of token p + 2; with `batch.keep_hidden` sets `batch.hidden` [len(logits_index), M, H]: its
        output streams there, what a chained pass at p + 1 reads (mtp.py)."""
        h, cos_sin = self._mtp_input(w, batch, hidden)
        h = yield from self.block(h, w.index, w.layer, cache[w.index], batch, cos_sin)
        h = h[batch.logits_index]
        if batch.keep_hidden:
            batch.hidden = h
        return self._logits(h, w.hc_head, w.norm)

    def mtp_cache_rows(self, w: V4MTPWeights, batch: StepBatch, hidden: torch.Tensor, cache) -> None:
        """Only what a pass of MTP module `w` (`mtp_forward`, same arguments) leaves in the cache:
        its block's state rows (v4_attention.write_state_rows of its attention input), bit for bit,
        without its attention, its MoE layer (no expert round trip) or its head. A decode step that
        does not speculate runs this, so the module's rows stay complete for a later one that does."""
        h, cos_sin = self._mtp_input(w, batch, hidden)
        _, _, x = hc_pre(h, w.layer.hc_attn, self.cfg, self.kernels)
        x = rms_norm_f32(x, w.layer.attn_norm, self.cfg.rms_norm_eps)
        write_state_rows(x, w.layer.attn, self.cfg, self.ropes, cos_sin, cache[w.index], batch, self.kernels)

    def _mtp_input(self, w: V4MTPWeights, batch: StepBatch, hidden: torch.Tensor):
        """The module's streams [T, M, H] before its block (`mtp_forward`), and the ropes' cos / sin."""
        eps = self.cfg.rms_norm_eps
        linear, _ = _ops(self.kernels)
        e = linear(rms_norm_f32(F.embedding(batch.input_ids, self.embed), w.enorm, eps), w.e_proj)
        h = linear(rms_norm_f32(hidden.to(e.dtype), w.hnorm, eps), w.h_proj) + e.unsqueeze(1)
        return h, {name: rope.cos_sin(batch.positions) for name, rope in self.ropes.items()}

    def block(
        self, h: torch.Tensor, i: int, layer: V4LayerWeights, cache, batch: StepBatch, cos_sin
    ) -> StepGen:
        """Decoder layer i (`layer`, its cache (state, entries)) over the streams h [T, M, H]: attention
        and the MoE block, each between its hyper-connections; yields the routed experts' messages
        (named by layer index i); returns the new streams."""
        cfg, k = self.cfg, self.kernels
        linear, _ = _ops(k)
        post, comb, x = hc_pre(h, layer.hc_attn, cfg, k)
        x = rms_norm_f32(x, layer.attn_norm, cfg.rms_norm_eps)
        attn = v4_attention(x, layer.attn, cfg, self.ropes, cos_sin, cache, batch, k)
        if self.attn_reduce is not None:
            attn = self.attn_reduce(attn)
        h = hc_post(h, attn, post, comb, k)

        post, comb, x = hc_pre(h, layer.hc_ffn, cfg, k)
        x = rms_norm_f32(x, layer.ffn_norm, cfg.rms_norm_eps)
        topk_idx, topk_weight = route_v4(x, batch.input_ids, layer, cfg, k)
        per_choice = k.deterministic and not self.experts_sum_in_order  # (summed below, in expert order)
        dispatch = expand_dispatch if per_choice else ExpertDispatch.routed
        handle = yield dispatch(i, i, x, topk_idx, topk_weight, cfg.n_routed_experts)  # (every V4 layer: MoE)
        shared = linear(self._swiglu(linear(x, layer.w1), linear(x, layer.w3)), layer.w2)
        routed = yield ExpertCombine(handle)
        if per_choice:
            routed = sum_choices(routed, topk_idx)
        return hc_post(h, routed + shared, post, comb, k)

    def _logits(self, h: torch.Tensor, head: HyperConnection, norm: torch.Tensor) -> torch.Tensor:
        """fp32 logits of streams h [n, M, H]: collapsed by `head`, normed by `norm`, the LM head."""
        k = self.kernels
        linear, _ = _ops(k)
        last = hc_head(h, head, self.cfg, k)
        return linear(rms_norm_f32(last, norm, self.cfg.rms_norm_eps), self.head).float()

    def _swiglu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The shared expert's activation (torch_ops.swiglu_act; deterministic kernels: its SiLU
        `deterministic.silu`, F.silu's bits depending on where a row falls in the tensor)."""
        limit = self.cfg.swiglu_limit
        if not self.kernels.deterministic:
            return swiglu_act(g, u, limit)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return deterministic.silu(g) * u
