"""DeepSeek-V3 model math as plain torch functions.

Shapes use T = tokens in the (flattened) batch, H = hidden size, N = attention heads,
E = routed experts, K = experts per token, L = context length, C = kv_lora_rank,
R = qk_rope_head_dim, D = qk_nope_head_dim, V = v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model.kernels.cpu_kernels import linear

from .config import ModelConfig, rope_inv_freq
from .fp8 import FP8_DEQUANT_BYTES, dequantize_fp8_blocks
from .kernels import cpu_kernels
from .kernels.gpu import TRITON


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., d] -> [..., d]; computed in fp32, cast back before the weight multiply (as HF)."""
    y = TRITON.rms_norm(x, weight, eps) if x.stride(-1) == 1 else None  # CUDA
    if y is not None:
        return y
    y = cpu_kernels.rms_norm(x, weight, eps)  # fp32 on CPU: one op
    if y is not None:
        return y
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream h [T, H] plus a sublayer's output delta [T, H] (None: nothing to add
    yet), and its RMSNorm: (h + delta, rms_norm(h + delta)); one op on a GPU and on an fp32 CPU
    (as vLLM's fused_add_rms_norm)."""
    if delta is None:
        return h, rms_norm(h, weight, eps)
    fused = TRITON.add_rms_norm(h, delta, weight, eps)  # CUDA
    if fused is None:
        fused = cpu_kernels.add_rms_norm(h, delta, weight, eps)
    if fused is not None:
        return fused
    h = h + delta
    return h, rms_norm(h, weight, eps)


def dense_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP (a dense layer's MLP, the shared experts): x [T, H], w13 [2I, H] (gate rows,
    then up rows), w2 [H, I] -> [T, H]. One gate+up projection; at decode sizes on an fp32 CPU,
    the expert kernel with every token on one slot (MKL's GEMMs beyond MAX_ROWS rows)."""
    y = cpu_kernels.dense_ffn(x, w13, w2)
    if y is not None:
        return y
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


class Rope:
    """Rotary embedding (plain or YaRN) for the qk_rope_head_dim part of q and k.

    With `interleave` (DeepSeek-V3 weights) pairs (x[2i], x[2i+1]) are rotated by frequency i and
    the output keeps that interleaved layout (as DeepSeek's own code and vLLM/SGLang do; HF
    de-interleaves, which gives the same scores). Without it, the neox rotate-half form is used.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)
        self.interleave = cfg.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] in `dtype` (computed in fp32, like HF)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (
            (freqs.cos() * self.attention_factor).to(dtype),
            (freqs.sin() * self.attention_factor).to(dtype),
        )

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., R] with cos/sin [T, R/2] -> rotated x, same shape and layout."""
        if self.interleave:
            y = cpu_kernels.rope_interleaved(x, cos, sin)  # fp32 on CPU: one op
            if y is not None:
                return y
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------
def route(
    x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE gate. x [T, H], gate_w [E, H], bias [E] (fp32) or None.

    Returns (topk_idx [T, K] int64 logical experts, topk_weight [T, K] fp32).
    V3 (sigmoid, noaux_tc): the biased scores pick the top-`topk_group` groups (group score =
    sum of its top-2) and the top-K experts inside them; the weights are the *unbiased* scores,
    normalised (+1e-20) when norm_topk_prob, times routed_scaling_factor.
    V2 (softmax, greedy / group_limited_greedy): group score = max, masked with 0.
    """
    T, E, G = x.shape[0], cfg.n_routed_experts, cfg.n_group
    if cfg.scoring_func == "sigmoid" and cfg.topk_method == "noaux_tc":  # fp32 on CPU: one call
        fused = cpu_kernels.route_sigmoid(x, gate_w, bias, G, cfg.topk_group, cfg.num_experts_per_tok,
                                          cfg.norm_topk_prob, cfg.routed_scaling_factor)  # fmt: skip
        if fused is not None:
            return fused
    logits = linear(x.float(), gate_w.float())
    if cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
    else:
        scores = logits.softmax(dim=-1)
        choice = scores

    grouped = cfg.topk_method in ("noaux_tc", "group_limited_greedy") and G > 1
    if grouped:
        per_group = choice.view(T, G, E // G)
        if cfg.topk_method == "noaux_tc":
            group_scores = per_group.topk(2, dim=-1).values.sum(-1)
            fill = float("-inf")
        else:
            group_scores = per_group.max(dim=-1).values
            fill = 0.0
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        choice = choice.masked_fill(~expert_mask, fill)

    topk_idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    topk_weight = scores.gather(1, topk_idx)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        topk_weight = topk_weight / (topk_weight.sum(-1, keepdim=True) + 1e-20)
    return topk_idx, topk_weight * cfg.routed_scaling_factor


# ---------------------------------------------------------------------------------------------
# Routed experts: a grouped FFN over packed expert weights
# ---------------------------------------------------------------------------------------------
def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(g) * u; with `limit` (DeepSeek-V4's swiglu_limit) g is clamped to <= limit and u to
    [-limit, limit] first."""
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def _expert_mlp_grouped_mm(xs, offs, w13, w2, limit=None):
    """One grouped matmul per projection over all experts (torch >= 2.9, CPU and GPU); weights
    stored narrower than xs (bf16 under fp32) are widened for the call."""
    w13, w2 = w13.to(xs.dtype), w2.to(xs.dtype)
    g, u = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return F.grouped_mm(swiglu_act(g, u, limit), w2.transpose(1, 2), offs=offs)


def _expert_mlp_loop(xs, offs, w13, w2, limit=None):
    """One matmul pair per expert that has tokens (CPU, and CUDA without bf16 grouped_mm)."""
    ys = torch.empty(xs.shape[0], w2.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            g, u = linear(xs[start:end], w13[e]).chunk(2, dim=-1)
            ys[start:end] = linear(swiglu_act(g, u, limit), w2[e])
        start = end
    return ys


_HAS_GROUPED_MM = hasattr(F, "grouped_mm")
CPU_LOOP_MAX_PAIRS = 16  # (token, expert) pairs up to which a CPU layer loops over its busy slots


def grouped_expert_ffn(
    x: torch.Tensor,
    slot: torch.Tensor,
    weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Weighted sum of expert outputs per token ("dispatch + combine" in one process).

    x [T, H]; slot [T, K] int64 index into the packed experts (-1 = skip); weight [T, K] fp32;
    w13 [S, 2I, H] (gate rows then up rows); w2 [S, H, I]. Returns [T, H] in x's dtype,
    accumulated in fp32 over the K choices; written into `out` [T, H] (x's dtype) when given
    (e.g. the payload of a gRPC response). swiglu_limit: DeepSeek-V4's clamped SwiGLU (`swiglu_act`).
    (token, choice) pairs are sorted by slot and the SwiGLU FFN runs as one grouped matmul per
    projection over all slots (offsets = cumulative tokens per slot).
    FP8 experts kept FP8 (w13 / w2 float8_e4m3fn) come with their block scales w13_scale [S, 2I/bn,
    H/bk] / w2_scale [S, H/bn, I/bk] and fp8_block (bn, bk): see `_fp8_expert_ffn`.
    """
    T, K = slot.shape
    if w13_scale is not None:
        return _fp8_expert_ffn(x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, fp8_block)
    y = TRITON.fused_moe(x, slot, weight, w13, w2, swiglu_limit, out=out)  # CUDA
    if y is not None:
        return y
    if _cpu_decode(x, slot):
        y = cpu_kernels.expert_ffn(x, slot, weight, w13, w2, swiglu_limit)  # decode sizes, fp32: one call
        if y is not None:
            return y if out is None else out.copy_(y)
    if out is not None and out.dtype == torch.float32:
        acc = out.zero_()  # accumulate in place
    else:
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat_slot = slot.reshape(-1)
    pair = torch.nonzero(flat_slot >= 0).squeeze(1)
    if pair.numel() == 0:
        return acc.to(x.dtype) if out is None else out.zero_()
    pair = pair[torch.argsort(flat_slot[pair], stable=True)]
    token = pair // K
    counts = torch.bincount(flat_slot[pair], minlength=w13.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    # CUDA: one grouped_mm kernel per projection (bf16 only). CPU: the whole layer in one call of
    # cpu_kernels.expert_ffn above while the busy slots have few rows each (decode); otherwise
    # grouped_mm, which loops in C++ over every slot, empty ones included (128 matmul calls per
    # layer at batch 1) with MKL's slow small-M matmuls, so without the kernel a Python loop over
    # the busy slots wins while there are few pairs. Prefill-sized slots go to grouped_mm.
    if x.device.type == "cuda":
        grouped = _HAS_GROUPED_MM and x.dtype == torch.bfloat16
    else:
        grouped = _HAS_GROUPED_MM and pair.numel() > CPU_LOOP_MAX_PAIRS
    mlp = _expert_mlp_grouped_mm if grouped else _expert_mlp_loop
    ys = mlp(x[token], offs, w13, w2, swiglu_limit)
    acc.index_add_(0, token, ys.float() * weight.reshape(-1)[pair].unsqueeze(1))
    if out is None:
        return acc.to(x.dtype)
    return out if acc is out else out.copy_(acc)


def _cpu_decode(x: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether the CPU expert kernel takes this call: fp32 on CPU at decode sizes."""
    T = slot.shape[0]
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and (T <= cpu_kernels.MAX_ROWS or _few_rows_per_slot(slot))
    )


def _fp8_expert_ffn(x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, block):
    """grouped_expert_ffn on FP8 experts kept FP8. The Triton fused MoE (CUDA) and, at decode sizes
    on the CPU, the expert kernel read them as held; otherwise the slots the call touches are
    dequantized (`fp8.dequantize_fp8_blocks`'s values) FP8_DEQUANT_BYTES at a time and run
    on the torch path, their partial sums added in fp32. With one such chunk (every decode, and
    any call touching <= 1 GiB of dequantized experts) the result is that of experts dequantized at
    load, bit for bit; beyond, the same up to the order of the fp32 sums."""
    fp8 = (w13_scale, w2_scale, block)
    y = TRITON.fused_moe(x, slot, weight, w13, w2, swiglu_limit, *fp8, out=out)  # CUDA
    if y is not None:
        return y
    if _cpu_decode(x, slot):
        y = cpu_kernels.expert_ffn(x, slot, weight, w13, w2, swiglu_limit, *fp8)
        if y is not None:
            return y if out is None else out.copy_(y)
    used = slot >= 0
    busy = torch.unique(slot[used])  # sorted: a token's choices keep their slot order
    per_slot = (w13[0].numel() + w2[0].numel()) * x.element_size()
    acc = None
    for chunk in busy.split(max(1, FP8_DEQUANT_BYTES // per_slot)):
        mine = used & torch.isin(slot, chunk)
        local = torch.full_like(slot, -1)
        local[mine] = torch.searchsorted(chunk, slot[mine])
        dequantized = [
            torch.stack([dequantize_fp8_blocks(w[s], scale[s], block) for s in chunk.tolist()]).to(x.dtype)
            for w, scale in ((w13, w13_scale), (w2, w2_scale))
        ]
        y = grouped_expert_ffn(x, local, weight, *dequantized, None, swiglu_limit)
        acc = y.float() if acc is None else acc.add_(y.float())
    if acc is None:  # nothing routed here
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return acc.to(x.dtype) if out is None else out.copy_(acc)


def _few_rows_per_slot(slot: torch.Tensor) -> bool:
    """Whether the busy slots of slot [T, K] get at most cpu_kernels.MAX_ROWS rows on average
    (where the small-batch kernel beats MKL's blocked matmuls)."""
    busy = slot[slot >= 0]
    return busy.numel() <= cpu_kernels.MAX_ROWS * torch.unique(busy).numel()
