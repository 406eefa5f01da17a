"""Batch-invariant kernels: `EngineConfig.deterministic` (issue #53).

With them every row of a step (a token) gets the same bits whatever else is in the step: the
batch's size and other requests, how a prompt was chunked, decode or prefill, and (with the
model's per-choice combine, `expand_dispatch` / `sum_choices`) how many expert workers computed
its experts and where. A greedy request's tokens then depend on nothing but its own tokens.

Why the default kernels are not: a GEMM's reduction order depends on its shape. MKL (torch's
F.linear / matmul on this CPU) already gives row 0 of a 2-row product other bits than the same row
alone; the C++ linear (cpu_kernels) sums each row in one fixed order up to MAX_ROWS rows (8-lane
chains) and in another from 9 to 64 rows (16-lane register tiles), and hands larger calls to MKL;
the MLA absorbed products switch from per-head dots to torch.bmm past 8 tokens; the routed experts
from the C++ kernel to grouped matmuls; prefill attends in the expanded form with an online
softmax over key tiles, decode in the absorbed form; and a cluster sums each token's experts per
worker, then over workers. What is used instead (CPU only; chosen once, by `bind`):

- linears: the C++ linear on row chunks of at most MAX_ROWS (each row summed in its one <= 8-row
  order, so M = 1 is the default path's own call); where it cannot run (not fp32, a width not a
  multiple of 8), F.linear on fixed MAX_ROWS-row tiles (zero-padded, in a fresh buffer: a fixed
  GEMM shape gives each row the same sums here whatever the other rows hold).
- the dense MLPs / shared experts and the routed experts: the C++ expert kernel at every size
  (each (token, expert) pair's dot products in one order, however many rows share the slot);
  without it, the per-slot loop over the deterministic linears.
- MLA: the absorbed products per head and token (C++, any size; else torch.bmm on fixed token
  tiles); decode as chosen (the C++ kernel: each (row, head) over its own context in order; the
  torch path here row by row, over exactly its context); prefill on the decode kernel, each query
  a decode row of its own causal length, so a token attends with the same arithmetic in a prompt
  chunk as in a decode step. The fused decode layer (C++) runs on chunks of MAX_ROWS rows: its
  arithmetic is then that of these single kernels, bit for bit.
- norms, rope, the router: row-local already (chosen as usual), but for torch's sigmoid and SiLU
  (the router's and the MLPs' on the torch path), which compute a tensor's last elements on a
  scalar path of other bits: `sigmoid` / `silu` here instead.
- the MoE combine: each token's expert outputs added in ascending expert order, in fp32, from
  zero; then routed + shared, in that order. The in-process experts' kernels add them so already
  (moe.LocalExperts: slot == expert); for others (expert workers) the model sends one row per
  (token, choice) (`expand_dispatch`), so whichever worker computes a pair returns that pair alone,
  and adds the K rows itself in that order (`sum_choices`).

DeepSeek-V3.2 (its lightning indexer and sparse attention) additionally:

- the indexer's linears (wk, wq_b, weights_proj: F.linear in indexer.py) on the deterministic
  linears; its LayerNorm and rope are row-local.
- its scores: the C++ kernel sums each (query, token) score in one order whatever the batch
  (attention.cpp); on torch the einsums' products were shaped by the batch's queries and the
  decode rows' padded context: `index_scores_torch`, query by query on fixed key tiles.
- its top-k: torch.topk breaks exact ties (relu zeroes whole rows) by an algorithm that depends on
  the row's length, and a decode row is padded to the batch's longest context: `top_indices`, a
  stable sort (ties to the earlier token).
- the sparse attention over the chosen rows (decode and prefill alike): the batched one pads every
  row to the batch's top-k and runs one bmm: `sparse_decode_cpp` (the rows gathered into scratch
  blocks of their own, then the C++ decode kernel) or `sparse_decode_torch` (row by row).

DeepSeek-V4 (deepseek_v4.py, v4_attention.py: torch code, made invariant there with `k.linear`
and the functions here): every F.linear on the deterministic linears (attention, compressors,
indexer, hyper-connections, gate, shared expert, head); torch.sigmoid (hyper-connections),
F.softplus (the sqrtsoftplus gate; torch.log1p has the same scalar tail) and F.silu (the shared
expert) as `sigmoid` / `softplus` / `silu`; the compressors' softmax over a window's slots (not the
last dim: torch's kernel vectorises across windows) as `softmax`; hc_post's torch.matmul and the
grouped output einsum (batched GEMMs shaped by T) as ordered multiply-adds and one linear per
group; the attention one query at a time over exactly its window rows and entries (the batched
paths pad a decode group to its longest context and tile a prefill chunk), the CSA indexer's
top-k with `top_indices`; the routed experts as V3's (in expert order, per-choice rows for
workers). Row-local as they are: RMSNorms, ropes, softmax over a row's last dim, the Sinkhorn and
stream sums (each output over its own M values, in order), the gates' top-k over E.

On CUDA (and on CPU tensors under triton's interpreter, where the Triton kernels are asked for by
name: tests) the same guarantees come from our Triton kernels with batch-invariant configurations
(Thinking Machines' "batch-invariant ops": one kernel configuration for every M, no split-K or
split-KV whose count follows the batch, reductions row-local), chosen by `bind` where triton runs:

- linears: `triton_linear.linear`, one tile shape per dtype whatever M, each output's K loop in
  order (no split-K); FP8 linears `triton_linear.fp8_linear(deterministic=True)` (a fixed M tile,
  K unsplit); where that kernel cannot take the weights, dequantised, then the plain one.
- MLA's absorbed products: the same GEMM kernel with the heads as its batch axis (a linear per
  head: torch.bmm on CUDA picks its cuBLAS kernel, split-K included, by the token count;
  `_tiles` of fixed shapes would hold in one cuBLAS version but costs a launch per 8 tokens).
- the routed experts: `triton_moe.fused_moe(deterministic=True)` (a fixed BLOCK_M; a token's K
  choices added in slot order with elementwise adds, not torch's reduction).
- MLA decode, prefill (on the decode kernel) and V3.2's sparse decode:
  `triton_mla.mla_decode(deterministic=True)`: each row's context cut by its own length, never by
  the batch, and a merge that skips the empty splits; FlashMLA is not chosen (its split schedule
  follows the batch).
- the router: `route_ordered`: torch.topk's algorithm (and its order of the chosen experts, and its
  ties) depends on the number of rows on CUDA, and torch's reductions pick their strategy by the
  tensor's size: a stable sort for every top-k, the chosen experts in ascending order, the top-k
  weights' sum and the group scores as ordered elementwise adds.
- the V3.2 indexer's scores: `index_scores_triton`, `index_scores_torch`'s per-query scores on the
  Triton linear (the heads' sum per query: a reduction over that query's own [n, Hi] scores).
- RMSNorm and the latent's norm / ropes / cache write (Triton): one program per row; torch's
  elementwise ops (ropes, SiLU, the residual adds) compute every element alike on CUDA; its
  softmax over a row's last dim runs one warp or block per row; max / amax are exact in any order.
- DeepSeek-V4 (its attention, compressors and hyper-connections are torch code whose reductions on
  CUDA follow the tensor's size): refused on CUDA for now (an expert worker's store, scope
  "experts", only runs the routed experts: allowed).

The test file tests/test_deterministic_triton.py checks these under triton's interpreter on the
CPU, which shows the structure (one configuration whatever the batch, no batch-dependent split, the
order of the sums) with numpy's arithmetic; bit-identity on a real GPU's tensor cores is checked by
running the same file there (benchmarks/gpu_session.sh, step `deterministic`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.model.fp8 import Fp8Weight
from services.model.kv_cache import BLOCK_SIZE, dequantize_latent_rows
from services.model.messages import ExpertDispatch

from . import torch_ops
from .cpu_kernels import MAX_ROWS

ROWS = MAX_ROWS  # the row chunk / tile every row-wise product runs in
KEY_TILE = 64  # the key tile of the indexer's scores on torch (`index_scores_torch`)


def unsupported(device: torch.device, cfg, scope: str) -> str | None:
    """Why deterministic kernels cannot be chosen for this target (None: they can): the CPU, or
    CUDA with triton (not DeepSeek-V4's model there: module docstring). select.py also refuses a
    CUDA target whose Triton kernels are not allowed (MOE_TRITON=0, `kernels` without triton)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"CPU or CUDA only ({device.type} tensors)"
    if not torch.cuda.is_available():
        return "CPU only on this machine (CUDA target, but torch sees no CUDA device)"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"on CUDA it needs triton ({e})"
    if cfg.is_v4 and scope == "model":
        return (
            "DeepSeek-V4 on CUDA is not batch-invariant yet (its attention, compressors and "
            "hyper-connections are torch code whose CUDA reductions follow the tensor's size); "
            "use the CPU, or V3 / V3.2"
        )
    return None


class _Rows(NamedTuple):
    """What the decode kernels read of batch.DecodeRows: a block table and lengths per row."""

    table: torch.Tensor
    lens: torch.Tensor


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), elementwise. torch.sigmoid and F.silu compute a tensor's last elements
    (here, with AVX-512: the last numel % 32) on a scalar path whose bits differ from their vector
    path's, so a token's value depended on where its row fell in the tensor; exp's, the adds'
    and the division's do not."""
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) with the `sigmoid` above."""
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus(x) (beta 1, threshold 20) on exp, log and the basic operations: F.softplus and
    torch.log1p have the scalar tail path of `sigmoid`. log1p(t) = log(u) * t / (u - 1), u = 1 + t
    (exact where u == 1: t), accurate to a few ulps."""
    t = torch.exp(x)
    u = 1 + t
    return torch.where(x > 20, x, torch.where(u == 1, t, torch.log(u) * (t / (u - 1))))


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.softmax over a dimension that is not the last: torch's kernel for those vectorises
    across the other dimensions and gives a row other bits beside other rows (over the last
    dimension it is row-local: used as it is). exp(x - max) / sum: max is exact in any order,
    the sum over `dim` is summed per output in one order."""
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores.topk(k, dim=-1).indices, ties broken by the lower index: a stable sort. torch.topk
    breaks exact ties (the indexer's scores: relu makes whole rows 0) by its algorithm, which
    depends on the row's length, and a decode row is padded to the batch's longest context."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _tiles(fn, x: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """fn over x's rows in tiles of exactly `rows` rows (the last zero-padded), each in a fresh
    buffer (same shape, same alignment every call) -> fn's rows, concatenated."""
    M = x.shape[0]
    if M == 0:
        return fn(x)
    out = []
    for i in range(0, M, rows):
        n = min(rows, M - i)
        buf = x.new_zeros((rows, *x.shape[1:]))
        buf[:n] = x[i : i + n]
        out.append(fn(buf)[:n])
    return out[0] if len(out) == 1 else torch.cat(out)


def _chunks(fn, x: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """fn over x's rows in chunks of at most `rows` (for kernels whose rows are summed alike
    for any count up to `rows`)."""
    if x.shape[0] <= rows:
        return fn(x)
    return torch.cat([fn(x[i : i + rows]) for i in range(0, x.shape[0], rows)])


class DeterministicImpls:
    """The batch-invariant implementations (module docstring). `k`: the select.Kernels they are
    bound into; `cpp`: the C++ kernels (cpu_kernels.CppKernels) where chosen, else None; `gpu`:
    the Triton kernels (gpu.TritonKernels, made deterministic) where triton runs, else None."""

    def __init__(self, k, cfg, cpp, gpu=None):
        self.k, self.cfg, self.cpp, self.gpu = k, cfg, cpp, gpu
        self._m = None if cpp is None else cpp._m

    # ---- linears -----------------------------------------------------------------------------
    def linear_cpp(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, w, bias): the C++ linear on <= ROWS-row chunks (fp32 x, K % 8 == 0), else
        `linear_torch`."""
        if x.dim() != 2:
            return self.linear_cpp(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])
        if x.dtype is not torch.float32 or x.shape[1] % 8:
            return self.linear_torch(x, w, bias)
        small, w = self._m.small_linear, w.contiguous()
        b = None if bias is None else bias.contiguous()
        return _chunks(lambda c: small(c.contiguous(), w, b), x)

    def linear_torch(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear(x, w, bias) on fixed ROWS-row tiles."""
        if x.dim() != 2:
            return self.linear_torch(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])
        w = w if w.dtype is x.dtype else w.to(x.dtype)  # (widened once, not per tile)
        return _tiles(lambda t: torch_ops.linear(t, w, bias), x)

    def fp8_linear_cpp(self, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A linear kept FP8: the C++ kernel on <= ROWS-row chunks (fp32 x, K % 16 == 0), else
        `fp8_linear_torch`."""
        if x.dim() != 2 or x.dtype is not torch.float32 or x.shape[1] % 16:
            return self.fp8_linear_torch(x, w, bias)
        bn, bk = w.block
        b = None if bias is None else bias.contiguous()
        weight, scale, fp8 = w.weight.contiguous(), w.scale.contiguous(), self._m.small_linear_fp8
        return _chunks(lambda c: fp8(c.contiguous(), weight, scale, bn, bk, b), x)

    def fp8_linear_torch(
        self, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A linear kept FP8: dequantised whole, then `linear_torch`."""
        return self.linear_torch(x, w.dequantize().to(x.dtype), bias)

    def fp8_linear_triton(
        self, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A linear kept FP8 where the Triton FP8 kernel cannot take it: dequantised whole, then the
        Triton linear (gpu.TritonKernels.linear)."""
        return self.gpu.linear(x, w.dequantize().to(x.dtype), bias)

    # ---- MLPs and experts ----------------------------------------------------------------------
    def dense_ffn_cpp(self, x: torch.Tensor, w13, w2) -> torch.Tensor:
        """The dense MLP / shared experts on the C++ expert kernel at every size (one slot)."""
        if x.shape[0] == 0:
            return x.new_zeros(0, x.shape[1])
        if type(w13) is Fp8Weight:
            T = x.shape[0]
            slot, weight = torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1)
            return self.cpp._experts(x, slot, weight, w13.weight[None], w2.weight[None], None, w13.scale[None],
                                     w2.scale[None], w13.block)  # fmt: skip
        return self._m.dense_ffn(x.contiguous(), w13.contiguous(), w2.contiguous())

    def expert_ffn_cpp(self, x, slot, weight, w13, w2, out=None, swiglu_limit=None, w13_scale=None, w2_scale=None,
                       fp8_block=None) -> torch.Tensor:  # fmt: skip
        """The routed experts on the C++ expert kernel at every size."""
        y = self.cpp._experts(x, slot, weight, w13, w2, swiglu_limit, w13_scale, w2_scale, fp8_block)
        return y if out is None else out.copy_(y)

    def dense_ffn_torch(self, x: torch.Tensor, w13, w2) -> torch.Tensor:
        """torch_ops.dense_ffn on the deterministic linears and `silu`."""
        gate, up = self.k.linear(x, w13).chunk(2, dim=-1)
        return self.k.linear(silu(gate) * up, w2)

    def expert_ffn_torch(self, x, slot, weight, w13, w2, out=None, swiglu_limit=None, w13_scale=None,
                         w2_scale=None, fp8_block=None) -> torch.Tensor:  # fmt: skip
        """torch_ops.expert_ffn as a loop over the busy slots in slot order (never the grouped
        matmuls) on the deterministic linears and `silu`; a token's choices added in slot order,
        in fp32."""
        if w13_scale is not None:  # (FP8 experts: their busy slots dequantised, then this)
            return torch_ops.fp8_expert_ffn(x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale,
                                            fp8_block, self.expert_ffn_torch)  # fmt: skip
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        linear = self.k.linear
        for s in torch.unique(slot[slot >= 0]).tolist():  # (sorted)
            token, choice = (slot == s).nonzero(as_tuple=True)  # (a token picks a slot once)
            g, u = linear(x[token], w13[s]).chunk(2, dim=-1)
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(min=-swiglu_limit, max=swiglu_limit)
            y = linear(silu(g) * u, w2[s])
            acc.index_add_(0, token, y.float() * weight[token, choice, None])
        return acc.to(x.dtype) if out is None else out.copy_(acc)

    def route_torch(self, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
        """torch_ops.route on the deterministic linears and `sigmoid`."""
        return torch_ops.route(x, gate_w, bias, self.cfg, self.k.linear, sigmoid=sigmoid)

    def route_ordered(self, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
        """torch_ops.route (V3's sigmoid / noaux_tc, V2's softmax / greedy / group-limited) with
        every step row-local on any device (module docstring): the logits on the deterministic
        linears, `sigmoid`; each top-k a stable sort (`top_indices`); a group's top-2 sum one add;
        the chosen experts in ascending order, their weights' sum K - 1 ordered adds. x [T, H] ->
        (topk_idx [T, K] int64 ascending, topk_weight [T, K] fp32)."""
        cfg = self.cfg
        T, E, G, K = x.shape[0], cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
        logits = self.k.linear(x.float(), gate_w.float())
        if cfg.scoring_func == "sigmoid":
            scores = sigmoid(logits)
            choice = scores + bias if bias is not None else scores
        else:
            scores = logits.softmax(dim=-1)  # (over the last dim: one warp / block per row)
            choice = scores
        if cfg.topk_method in ("noaux_tc", "group_limited_greedy") and G > 1:
            per_group = choice.view(T, G, E // G)
            if cfg.topk_method == "noaux_tc":
                top2 = per_group.gather(-1, top_indices(per_group, 2))
                group_scores, fill = top2[..., 0] + top2[..., 1], float("-inf")
            else:
                group_scores, fill = per_group.amax(dim=-1), 0.0
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
            group_mask.scatter_(1, top_indices(group_scores, cfg.topk_group), True)
            expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
            choice = choice.masked_fill(~expert_mask, fill)
        topk_idx = top_indices(choice, K).sort(dim=-1).values
        topk_weight = scores.gather(1, topk_idx)
        if cfg.norm_topk_prob and K > 1:
            total = topk_weight[:, 0]
            for j in range(1, K):
                total = total + topk_weight[:, j]
            topk_weight = topk_weight / (total[:, None] + 1e-20)
        return topk_idx, topk_weight * cfg.routed_scaling_factor

    # ---- MLA -----------------------------------------------------------------------------------
    def absorb_q_cpp(self, q_nope: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
        """torch_ops.absorb_q as per-head, per-token dot products (C++) at every size."""
        if q_nope.dtype is not torch.float32 or not kv_b.is_contiguous():
            return self.absorb_q_torch(q_nope, kv_b)
        q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
        return self._m.absorb_q(q_nope, kv_b, q_nope.shape[-1])

    def absorb_o_cpp(self, o_lat: torch.Tensor, kv_b: torch.Tensor, D: int) -> torch.Tensor:
        """torch_ops.absorb_o as per-head, per-token dot products (C++) at every size."""
        if o_lat.dtype is not torch.float32 or not kv_b.is_contiguous():
            return self.absorb_o_torch(o_lat, kv_b, D)
        return self._m.absorb_o(o_lat.contiguous(), kv_b, D)

    def absorb_q_torch(self, q_nope: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
        """torch_ops.absorb_q on fixed ROWS-token tiles."""
        return _tiles(lambda t: torch_ops.absorb_q(t, kv_b), q_nope)

    def absorb_o_torch(self, o_lat: torch.Tensor, kv_b: torch.Tensor, D: int) -> torch.Tensor:
        """torch_ops.absorb_o on fixed ROWS-token tiles."""
        return _tiles(lambda t: torch_ops.absorb_o(t, kv_b, D), o_lat)

    @staticmethod
    def mla_decode_torch(q: torch.Tensor, cache: torch.Tensor, dec, C: int, scale: float) -> torch.Tensor:
        """torch_ops.mla_decode row by row over exactly each row's context (the padded gather's
        products are shaped by the longest context in the batch)."""
        W, QD = cache.shape[-1], q.shape[-1]
        flat = cache.view(-1, W)
        out = []
        for b, L in enumerate(dec.lens.tolist()):
            blocks = dec.table[b, : -(-L // BLOCK_SIZE)].long()
            rows = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=q.device)).view(-1)[:L]
            ctx = flat[rows]  # [L, W]
            if ctx.dtype == torch.uint8:
                ctx = dequantize_latent_rows(ctx, C, QD - C, q.dtype)
            # (q's row copied: MKL's sums can depend on an operand's alignment)
            scores = torch.mm(q[b].clone(), ctx[:, :QD].t()).float() * scale  # [N, L]
            out.append(torch.mm(scores.softmax(dim=-1).to(q.dtype), ctx[:, :C]))
        return torch.stack(out) if out else q.new_zeros(0, q.shape[1], C)

    def mla_prefill(self, q_nope, q_pe, cache, blocks, L: int, kv_b, C: int, scale: float) -> torch.Tensor:
        """Causal MLA of one sequence's prefill chunk on the decode path: q_nope [n, N, D], q_pe
        [n, N, R] (positions L-n .. L-1) -> [n, N, V]. Each query is a decode row of its own causal
        length over the same blocks, through the same absorbed products and decode kernel as a
        decode step (so a token gets the same attention in a chunk as decoded)."""
        n, k = q_nope.shape[0], self.k
        q_full = torch.cat((k.absorb_q(q_nope, kv_b), q_pe), dim=-1)  # [n, N, C+R]
        lens = torch.arange(L - n + 1, L + 1, device=q_nope.device, dtype=torch.long)
        rows = _Rows(blocks.long()[None].expand(n, -1).contiguous(), lens)
        return k.absorb_o(k.mla_decode(q_full, cache, rows, C, scale), kv_b, q_nope.shape[-1])

    @staticmethod
    def sparse_decode_torch(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, C: int,
                            scale: float) -> torch.Tensor:  # fmt: skip
        """torch_ops.sparse_decode (V3.2) row by row over exactly each row's first count[b] chosen
        rows (the batched one pads every row to the batch's top-k, its products shaped by it)."""
        W, QD = cache.shape[-1], q.shape[-1]
        flat = cache.view(-1, W)
        out = []
        for b, n in enumerate(count.tolist()):
            ctx = flat[rows[b, :n]]  # [n, W]
            if ctx.dtype == torch.uint8:
                ctx = dequantize_latent_rows(ctx, C, QD - C, q.dtype)
            scores = torch.mm(q[b].clone(), ctx[:, :QD].t()).float() * scale  # [N, n]
            out.append(torch.mm(scores.softmax(dim=-1).to(q.dtype), ctx[:, :C]))
        return torch.stack(out) if out else q.new_zeros(0, q.shape[1], C)

    def sparse_decode_cpp(self, q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, count: torch.Tensor,
                          C: int, scale: float) -> torch.Tensor:  # fmt: skip
        """V3.2's sparse decode on the C++ decode kernel (each (row, head) over its own context, in
        order): each row's chosen cache rows gathered into scratch blocks of its own, its length
        count[b]. fp32 rows only (else `sparse_decode_torch`)."""
        if cache.dtype is not torch.float32 or q.dtype is not torch.float32:
            return self.sparse_decode_torch(q, cache, rows, count, C, scale)
        Bd, k = rows.shape
        if Bd == 0:
            return q.new_zeros(0, q.shape[1], C)
        nb = -(-k // BLOCK_SIZE)
        if nb * BLOCK_SIZE > k:  # (padding: row 0, past count)
            rows = torch.cat((rows, rows.new_zeros(Bd, nb * BLOCK_SIZE - k)), dim=1)
        scratch = cache.view(-1, cache.shape[-1])[rows].view(Bd * nb, BLOCK_SIZE, 1, cache.shape[-1])
        table = torch.arange(Bd * nb, device=q.device).view(Bd, nb)
        return self._m.mla_decode(q.contiguous(), scratch, table, count.contiguous(), C, scale)

    @staticmethod
    def index_scores_torch(
        q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """torch_ops.index_scores (V3.2, V4's CSA) query by query over its visible keys, their dots
        in fixed KEY_TILE-row GEMM tiles, each score's heads summed along its row (the einsums'
        products are shaped by the batch's queries and longest context). The C++ kernel sums each
        score in one order already (attention.cpp: index_scores)."""

        def dots(ki: torch.Tensor, qi: torch.Tensor) -> torch.Tensor:
            qi = qi.clone()  # (a fresh copy: MKL's sums can depend on an operand's alignment)
            return _tiles(lambda t: torch_ops.linear(t, qi), ki, KEY_TILE)

        return _index_scores_by_query(q, w, keys, lens, dots)

    def index_scores_triton(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """`index_scores_torch` with each query's dots on the Triton linear (batch-invariant in
        its keys) instead of fixed torch GEMM tiles."""
        return _index_scores_by_query(q, w, keys, lens, self.gpu.linear)

    def fused_decode_layer(self, fused):
        """The C++ decode layer on <= ROWS-row chunks (its sums are those of the single kernels
        here there; each decode row is a sequence of its own, so chunks share no cache row)."""

        def run(x, w, cos_sin, cache, slot_mapping, table, lens, cfg, eps):
            T = x.shape[0]
            if T <= ROWS:
                return fused(x, w, cos_sin, cache, slot_mapping, table, lens, cfg, eps)
            cos, sin = cos_sin
            parts = []
            for i in range(0, T, ROWS):
                s = slice(i, i + ROWS)
                parts.append(fused(x[s].contiguous(), w, (cos[s].contiguous(), sin[s].contiguous()), cache,
                                   slot_mapping[s].contiguous(), table[s].contiguous(), lens[s].contiguous(), cfg,
                                   eps))  # fmt: skip
            return torch.cat(parts)

        return run


def _index_scores_by_query(q, w, keys, lens, dots) -> torch.Tensor:
    """torch_ops.index_scores one query at a time: q [Q, Hi, Di], w [Q, Hi], keys [L, Di] (shared)
    or [Q, L, Di], lens [Q] -> [Q, L] fp32 (-inf past each query's lens[i] keys). dots(ki [n, Di]
    fp32, qi [Hi, Di] fp32) -> [n, Hi]: the query's dots with its keys, batch-invariant; each
    score the heads' sum over that query's own [n, Hi] dots."""
    Q, Hi, Di = q.shape
    L = keys.shape[-2]
    out = torch.full((Q, L), float("-inf"), dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens.tolist()):
        n = min(n, L)
        if n == 0:
            continue
        ki = (keys if keys.dim() == 2 else keys[i])[:n].float()
        out[i, :n] = (torch.relu(dots(ki, q[i].float()) * Di**-0.5) * w[i]).sum(-1)
    return out


def bind(k, cfg, cpp, gpu=None, guard=None) -> None:
    """Rebind `k`'s (a select.Kernels, families already chosen) batch-variant families to the
    deterministic implementations over the same choices (the C++ kernels where chosen, else
    torch). `cpp`: the C++ kernels' implementations (None where not built). `gpu`: the Triton
    kernels (gpu.TritonKernels made with deterministic=True) where triton runs (then
    `bind_triton`); guard(family, fns): how select.py wraps a GPU implementation's functions."""
    if gpu is not None:
        return bind_triton(k, cfg, gpu, guard or (lambda family, fns: fns))
    names = k.names()
    on_cpp = lambda family: cpp is not None and names.get(family) == "cpp"  # noqa: E731
    d = DeterministicImpls(k, cfg, cpp)
    k._det = d
    rebind = {
        "linear": ((d.linear_cpp,) if on_cpp("linear") else (d.linear_torch,)),
        "fp8_linear": ((d.fp8_linear_cpp,) if on_cpp("fp8_linear") else (d.fp8_linear_torch,)),
        "dense_ffn": ((d.dense_ffn_cpp,) if on_cpp("dense_ffn") else (d.dense_ffn_torch,)),
        "route": (None if on_cpp("route") else (d.route_torch,)),  # (C++: row by row as it is)
        "expert_ffn": ((d.expert_ffn_cpp,) if on_cpp("expert_ffn") else (d.expert_ffn_torch,)),
        "absorb": ((d.absorb_q_cpp, d.absorb_o_cpp) if on_cpp("absorb") else (d.absorb_q_torch, d.absorb_o_torch)),
        "mla_decode": (None if on_cpp("mla_decode") else (d.mla_decode_torch,)),  # (C++: row-local as it is)
        "mla_prefill": (d.mla_prefill,),
        "mla_sparse_decode": (d.sparse_decode_torch,),  # (V3.2; torch is the CPU's only one)
        "index_scores": (None if on_cpp("index_scores") else (d.index_scores_torch,)),  # (C++: row-local)
    }  # fmt: skip
    for family, fns in rebind.items():
        if family in names and fns is not None:
            # (the prefill runs on the decode kernel: named after it)
            k._bind(family, names["mla_decode"] if family == "mla_prefill" else names[family], fns)
            k._next[family] = []  # (no fallback to a batch-variant implementation)
    if "mla_sparse_decode" in names and cpp is not None and k.dtype is torch.float32:
        widths = {cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim}
        if all(w % 8 == 0 for w in widths):  # (the C++ decode kernel's: select.py, mla_decode)
            k._bind("mla_sparse_decode", "cpp", (d.sparse_decode_cpp,))
    if names.get("mla_decode_layer") == "cpp":
        H, N, V = cfg.hidden_size, cfg.num_attention_heads, cfg.v_head_dim
        widths = (H, cfg.q_lora_rank or 0, N * V, cfg.kv_lora_rank)
        if all(w % 8 == 0 for w in widths) and names.get("linear") == "cpp" and on_cpp("absorb"):
            k._bind("mla_decode_layer", "cpp", (d.fused_decode_layer(cpp.mla_decode_layer),))
        else:  # (its linears would not be this module's)
            k._bind("mla_decode_layer", "unfused", (None,))


def bind_triton(k, cfg, gpu, guard) -> None:
    """`bind` where the Triton kernels run (CUDA; CPU tensors under the interpreter): the families
    selection gave Triton already run its deterministic variants (`gpu` was made so: fused MoE,
    FP8 linear, MLA decode / sparse decode / prefill on the decode kernel); the others are rebound
    here (module docstring): the linears and the absorbed products to the Triton GEMM ("triton"
    in names()), the router to `route_ordered`, the MLPs and the torch fallbacks to the
    deterministic torch paths over those linears."""
    names = k.names()
    d = DeterministicImpls(k, cfg, None, gpu)
    k._det = d
    on = lambda family: names.get(family) == "triton"  # noqa: E731
    rebind = {
        "linear": ("triton", (gpu.linear,)),
        "fp8_linear": None if on("fp8_linear") else ("triton", (d.fp8_linear_triton,)),
        "dense_ffn": ("torch", (d.dense_ffn_torch,)),
        "route": ("torch", (d.route_ordered,)),
        "expert_ffn": None if on("expert_ffn") else ("torch", (d.expert_ffn_torch,)),
        "absorb": ("triton", (gpu.absorb_q, gpu.absorb_o)),
        "mla_decode": None if on("mla_decode") else ("torch", (d.mla_decode_torch,)),
        "mla_prefill": None if on("mla_prefill") and on("mla_decode") else ("torch", (d.mla_prefill,)),
        "mla_sparse_decode": None if on("mla_sparse_decode") else ("torch", (d.sparse_decode_torch,)),
        "index_scores": ("triton", (d.index_scores_triton,)),
    }
    for family, choice in rebind.items():
        if family in names and choice is not None:
            name, fns = choice
            k._bind(family, name, guard(family, fns) if name == "triton" else fns)
    for family in names:
        k._next[family] = []  # (no fallback to a batch-variant implementation: torch's RMSNorm included)


# ---------------------------------------------------------------------------------------------
# The MoE combine in a fixed order
# ---------------------------------------------------------------------------------------------
def expand_dispatch(
    decoder_layer: int, moe_layer: int, x, topk_idx, topk_weight, num_experts: int
) -> ExpertDispatch:
    """The routed tokens as one row per (token, choice): x [T, H] repeated K times, each row with
    its one expert and weight. Whichever worker computes a pair returns that pair's weighted
    output alone (nothing of the token's other experts added to it), so `sum_choices` can add a
    token's experts in one order whatever the placement. The per-expert counts are the same."""
    K = topk_idx.shape[1]
    return ExpertDispatch.routed(decoder_layer, moe_layer, x.repeat_interleave(K, dim=0), topk_idx.reshape(-1, 1),
                                 topk_weight.reshape(-1, 1), num_experts)  # fmt: skip


def sum_choices(routed: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """[T * K, H] per-(token, choice) outputs (`expand_dispatch`'s rows, answered) of the experts
    topk_idx [T, K] -> [T, H]: each token's K outputs added in ascending expert order, in fp32, from
    zero: the order in which the in-process expert kernels add them (moe.LocalExperts: slot ==
    expert; the C++ kernel and `expert_ffn_torch` go slot by slot), so that with fp32 activations
    a cluster's sums are bit for bit LocalEngine's."""
    T, K = topk_idx.shape
    rows = torch.arange(T, device=routed.device)[:, None] * K + topk_idx.argsort(dim=1)
    y = routed[rows.reshape(-1)].view(T, K, routed.shape[-1]).float()
    acc = torch.zeros(T, routed.shape[-1], dtype=torch.float32, device=routed.device)
    for j in range(K):
        acc.add_(y[:, j])
    return acc.to(routed.dtype)
