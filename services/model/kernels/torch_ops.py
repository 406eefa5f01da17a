"""The torch implementation of every kernel family: the reference each kernel is tested against,
and what runs where no kernel is chosen (select.py).

Some of them are built from other families (the routed experts' per-slot loop and the dense MLP
are linears, the add + RMSNorm is an add and the RMSNorm): those take the other family's chosen
implementation as an argument (select.py binds it), so a torch path computes with the same
linears as the rest of the model.

Shapes use T = tokens, H = hidden size, N = attention heads, K = experts per token, L = context
length, C = kv_lora_rank, R = qk_rope_head_dim, D = qk_nope_head_dim, V = v_head_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.model import fp8
from services.model.fp8 import Fp8Weight, dequantize_fp8_blocks
from services.model.kv_cache import BLOCK_SIZE, dequantize_latent_rows

Linear = Callable[..., torch.Tensor]  # linear(x, w, bias=None): a plain or FP8 weight


# ---------------------------------------------------------------------------------------------
# Linears
# ---------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) in x's dtype (w stored narrower, bf16 under fp32, is widened for the
    call)."""
    return F.linear(x, w if w.dtype is x.dtype else w.to(x.dtype), bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with a weight kept FP8 (fp8.Fp8Weight): the weight dequantised
    fp8.FP8_DEQUANT_BYTES of rows at a time (whole row blocks), each chunk's columns F.linear's on
    the dequantised rows."""
    N, K = w.shape
    bn = w.block[0]
    rows = max(bn, fp8.FP8_DEQUANT_BYTES // (4 * K) // bn * bn)  # whole row blocks per chunk
    parts = [
        F.linear(
            x, w.dequantize(slice(n, n + rows)).to(x.dtype), None if bias is None else bias[n : n + rows]
        )
        for n in range(0, N, rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------------------------
# Norms, rope, router, MLPs
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., d] -> [..., d]; computed in fp32, cast back before the weight multiply (as HF)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, norm=rms_norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream h [T, H] plus a sublayer's output delta [T, H], and its RMSNorm:
    (h + delta, norm(h + delta)), `norm` the chosen RMSNorm."""
    h = h + delta
    return h, norm(h, weight, eps)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., R] with cos/sin [T, R/2] -> pairs (x[2i], x[2i+1]) rotated by frequency i, the
    output in the same interleaved layout (DeepSeek-V3's weights; as DeepSeek's own code and
    vLLM/SGLang do; HF de-interleaves, which gives the same scores)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half form of `rope_interleaved`: the first and second halves of x's last dim
    are the pairs."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def route(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    bias: torch.Tensor | None,
    cfg,
    linear: Linear = linear,
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE gate. x [T, H], gate_w [E, H], bias [E] (fp32) or None; cfg a ModelConfig.

    Returns (topk_idx [T, K] int64 logical experts, topk_weight [T, K] fp32).
    V3 (sigmoid, noaux_tc): the biased scores pick the top-`topk_group` groups (group score =
    sum of its top-2) and the top-K experts inside them; the weights are the *unbiased* scores,
    normalised (+1e-20) when norm_topk_prob, times routed_scaling_factor.
    V2 (softmax, greedy / group_limited_greedy): group score = max, masked with 0.
    `linear` and `sigmoid`: the chosen linears and the sigmoid (deterministic kernels: one whose
    bits do not depend on the tensor's size).
    """
    T, E, G = x.shape[0], cfg.n_routed_experts, cfg.n_group
    logits = linear(x.float(), gate_w.float())
    if cfg.scoring_func == "sigmoid":
        scores = sigmoid(logits)
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


def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(g) * u; with `limit` (DeepSeek-V4's swiglu_limit) g is clamped to <= limit and u to
    [-limit, limit] first."""
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def dense_ffn(x: torch.Tensor, w13, w2, linear: Linear = linear) -> torch.Tensor:
    """Dense SwiGLU MLP (a dense layer's MLP, the shared experts): x [T, H], w13 [2I, H] (gate rows,
    then up rows), w2 [H, I] -> [T, H]: one gate+up projection, SiLU, down (`linear`: the chosen
    linears, plain or FP8 weights)."""
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


# ---------------------------------------------------------------------------------------------
# Routed experts: a grouped FFN over packed expert weights
# ---------------------------------------------------------------------------------------------
def _expert_mlp_grouped_mm(xs, offs, w13, w2, limit=None):
    """One grouped matmul per projection over all experts (torch >= 2.9, CPU and GPU); weights
    stored narrower than xs (bf16 under fp32) are widened for the call."""
    w13, w2 = w13.to(xs.dtype), w2.to(xs.dtype)
    g, u = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return F.grouped_mm(swiglu_act(g, u, limit), w2.transpose(1, 2), offs=offs)


def _expert_mlp_loop(xs, offs, w13, w2, limit=None, linear: Linear = linear):
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


def expert_ffn(
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
    *,
    linear: Linear = linear,
    plain: Callable | None = None,
) -> torch.Tensor:
    """Weighted sum of expert outputs per token ("dispatch + combine" in one process).

    x [T, H]; slot [T, K] int64 index into the packed experts (-1 = skip); weight [T, K] fp32;
    w13 [S, 2I, H] (gate rows then up rows); w2 [S, H, I]. Returns [T, H] in x's dtype,
    accumulated in fp32 over the K choices; written into `out` [T, H] (x's dtype) when given
    (e.g. the payload of a gRPC response). swiglu_limit: DeepSeek-V4's clamped SwiGLU (`swiglu_act`).
    (token, choice) pairs are sorted by slot and the SwiGLU FFN runs as one grouped matmul per
    projection over all slots (offsets = cumulative tokens per slot). The algorithm, by size: on
    CUDA grouped_mm for bf16 (else a matmul pair per busy slot); on the CPU a Python loop over the
    busy slots (`linear`'s small-batch kernel) up to CPU_LOOP_MAX_PAIRS pairs, grouped_mm beyond
    (it loops in C++ over every slot, empty ones included, with MKL's slow small-M matmuls).
    FP8 experts kept FP8 (w13 / w2 float8_e4m3fn) come with their block scales w13_scale [S, 2I/bn,
    H/bk] / w2_scale [S, H/bn, I/bk] and fp8_block (bn, bk): see `fp8_expert_ffn` (`plain`: the
    experts' implementation its dequantised chunks run on; None: this one).
    """
    if w13_scale is not None:
        plain = plain or (lambda *a: expert_ffn(*a, linear=linear))
        return fp8_expert_ffn(
            x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, fp8_block, plain
        )
    T, K = slot.shape
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
    if x.device.type == "cuda":
        grouped = _HAS_GROUPED_MM and x.dtype == torch.bfloat16
    else:
        grouped = _HAS_GROUPED_MM and pair.numel() > CPU_LOOP_MAX_PAIRS
    if grouped:
        ys = _expert_mlp_grouped_mm(x[token], offs, w13, w2, swiglu_limit)
    else:
        ys = _expert_mlp_loop(x[token], offs, w13, w2, swiglu_limit, linear)
    acc.index_add_(0, token, ys.float() * weight.reshape(-1)[pair].unsqueeze(1))
    if out is None:
        return acc.to(x.dtype)
    return out if acc is out else out.copy_(acc)


def fp8_expert_ffn(x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, block, plain):
    """`expert_ffn` on FP8 experts kept FP8 without a kernel that reads them as held: the slots the
    call touches are dequantized (`fp8.dequantize_fp8_blocks`'s values) fp8.FP8_DEQUANT_BYTES at
    a time and run on `plain(x, slot, weight, w13, w2, out, swiglu_limit)` (the chosen
    implementation for unquantized experts), their partial sums added in fp32. With one such
    chunk (every decode, and any call touching <= 1 GiB of dequantized experts) the result is that
    of experts dequantized at load, bit for bit; beyond, the same up to the order of the fp32 sums."""
    used = slot >= 0
    busy = torch.unique(slot[used])  # sorted: a token's choices keep their slot order
    per_slot = (w13[0].numel() + w2[0].numel()) * x.element_size()
    acc = None
    for chunk in busy.split(max(1, fp8.FP8_DEQUANT_BYTES // per_slot)) if busy.numel() else ():
        mine = used & torch.isin(slot, chunk)
        local = torch.full_like(slot, -1)
        local[mine] = torch.searchsorted(chunk, slot[mine])
        dequantized = [
            torch.stack([dequantize_fp8_blocks(w[s], scale[s], block) for s in chunk.tolist()]).to(x.dtype)
            for w, scale in ((w13, w13_scale), (w2, w2_scale))
        ]
        y = plain(x, local, weight, *dequantized, None, swiglu_limit)
        acc = y.float() if acc is None else acc.add_(y.float())
    if acc is None:  # nothing routed here
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return acc.to(x.dtype) if out is None else out.copy_(acc)


# ---------------------------------------------------------------------------------------------
# MLA attention
# ---------------------------------------------------------------------------------------------
def absorb_q(q_nope: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """The absorbed form's latent queries: q_nope [T, N, D] @ W_UK (kv_b [N, D+V, C]) -> [T, N, C]
    (a batched matmul)."""
    D = q_nope.shape[-1]
    return torch.bmm(q_nope.transpose(0, 1), kv_b[:, :D]).transpose(0, 1)


def absorb_o(o_lat: torch.Tensor, kv_b: torch.Tensor, D: int) -> torch.Tensor:
    """The absorbed form's outputs: o_lat [T, N, C] through W_UV (kv_b [N, D+V, C], its rows from
    D on) -> [T, N, V] (a batched matmul)."""
    return torch.bmm(o_lat.transpose(0, 1), kv_b[:, D:].transpose(1, 2)).transpose(0, 1)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, dec, C: int, scale: float) -> torch.Tensor:
    """Decode attention over each row's paged context: q [Bd, N, C+R] absorbed latent queries,
    cache [blocks, 64, 1, W] (rows [c_kv | k_pe | ...]; uint8: FP8 latent rows, dequantized as
    gathered), dec a batch.DecodeRows -> o_lat [Bd, N, C]: the padded context gathered, scores
    masked past each row's length, softmax, the weighted c_kv."""
    ctx = cache[dec.table].view(q.shape[0], -1, cache.shape[-1])  # [Bd, Lmax, W]
    if ctx.dtype == torch.uint8:
        ctx = dequantize_latent_rows(ctx, C, q.shape[-1] - C, q.dtype)
    scores = torch.bmm(q, ctx[..., : q.shape[-1]].transpose(1, 2)).float() * scale  # [Bd, N, Lmax]
    scores.masked_fill_(dec.pad, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.bmm(probs, ctx[..., :C])  # [Bd, N, C]


def sparse_decode(q, cache, rows, count, C: int, scale: float) -> torch.Tensor:
    """Decode attention over chosen cache rows (V3.2's top-k): q [Bd, N, C+R], rows [Bd, k] flat
    cache rows (block * 64 + offset), the first count[b] of them used -> o_lat [Bd, N, C]: a
    gather (FP8 rows: dequantised as gathered), masked softmax."""
    ctx = cache.view(-1, cache.shape[-1])[rows]  # [Bd, k, W]
    if ctx.dtype == torch.uint8:
        ctx = dequantize_latent_rows(ctx, C, q.shape[-1] - C, q.dtype)
    scores = torch.bmm(q, ctx[..., : q.shape[-1]].transpose(1, 2)).float() * scale  # [Bd, N, k]
    unused = torch.arange(rows.shape[1], device=q.device)[None, :] >= count[:, None]
    probs = scores.masked_fill_(unused[:, None], float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.bmm(probs, ctx[..., :C])


PREFILL_SCORE_BYTES = 4 << 20  # fp32 scores of one (query tile, key tile): ~L2-sized tiles ran fastest here
PREFILL_KEY_TILE = 8 * BLOCK_SIZE  # context tokens whose K/V are expanded at a time


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    L: int,
    kv_b: torch.Tensor,
    C: int,
    scale: float,
    linear: Linear = linear,
) -> torch.Tensor:
    """Causal MLA of one sequence's prefill chunk, tiled: q_nope [n, N, D], q_pe [n, N, R] (the
    queries of positions L-n .. L-1) against the sequence's L context tokens in `cache` [blocks,
    64, 1, W] (its `blocks` [ceil(L / 64)]; a row is [c_kv | k_pe | ...]), kv_b [N, D+V, C] (W_UK
    rows, then W_UV) -> [n, N, V] fp32.

    Keys come PREFILL_KEY_TILE context tokens at a time (their c_kv expanded to per-head K/V for
    that tile only, by `linear`) and queries in tiles whose scores fit PREFILL_SCORE_BYTES; each
    query keeps a running max and sum (flash attention's online softmax), so the scratch is a few
    tiles however long the context. Tiles wholly in a query tile's future are skipped. (V3.2
    attends to gathered top-k rows instead: model.sparse_prefill.)
    """
    q = torch.cat((q_nope, q_pe), dim=-1)  # [n, N, D+R]
    n, N, _ = q.shape
    R = q_pe.shape[-1]
    W, D = cache.shape[-1], q_nope.shape[-1]
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


def latent_to_cache(
    kv: torch.Tensor,
    q_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    eps: float,
    extra: torch.Tensor | None = None,
    *,
    norm=rms_norm,
    rope=rope_interleaved,
    quantize=None,
) -> torch.Tensor:
    """An MLA layer's per-token work between its projections: kv [T, C+R] (kv_a's output), q_pe
    [T, N, R] (the queries' rope part), norm_weight [C], cos / sin [T, R/2], slot_mapping [T]
    -> writes each token's row [norm(c_kv) | rope(k_pe) | extra] (extra: V3.2's indexer key [T,
    Di]) into cache [blocks, 64, 1, W] at its slot (`quantize(*parts)`: FP8 rows,
    kv_cache.quantize_latent_rows) and returns rope(q_pe) [T, N, R]; `norm` and `rope` the
    chosen RMSNorm and rope."""
    C = norm_weight.shape[0]
    q_pe = rope(q_pe, cos, sin)
    rows = [norm(kv[:, :C], norm_weight, eps), rope(kv[:, C:], cos, sin)]
    if extra is not None:
        rows.append(extra)
    written = quantize(*rows) if quantize is not None else torch.cat(rows, dim=-1).to(cache.dtype)
    cache.view(-1, cache.shape[-1])[slot_mapping] = written
    return q_pe


# ---------------------------------------------------------------------------------------------
# Lightning-indexer scores (DeepSeek-V3.2, DeepSeek-V4's CSA)
# ---------------------------------------------------------------------------------------------
def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The indexer's scores: q [Q, Hi, Di], w [Q, Hi] (fp32, Hi^-0.5 folded in), keys [L, Di]
    (one shared context) or [Q, L, Di], lens [Q] int64 (query i sees its first lens[i] tokens)
    -> [Q, L] fp32 = sum_h w[q, h] * relu(q[q, h] . keys[l] * Di^-0.5), -inf beyond each query's
    tokens."""
    qf = q.float()
    if keys.dim() == 2:
        dots = torch.einsum("qhd,ld->qhl", qf, keys.float())
    else:
        dots = torch.einsum("qhd,qld->qhl", qf, keys.float())
    scores = torch.einsum("qh,qhl->ql", w, F.relu(dots * q.shape[-1] ** -0.5))
    visible = torch.arange(keys.shape[-2], device=q.device)[None] < lens[:, None]
    return scores.masked_fill(~visible, float("-inf"))
