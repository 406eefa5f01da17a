"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): which context tokens each
query attends to.

Per layer, beside MLA, the indexer projects
    q_idx = wq_b(q_lora)                      [T, Hi, Di]   (q_lora: MLA's q_a_layernorm output)
    k_idx = LayerNorm(wk(x))                  [T, Di]       (weight and bias, eps 1e-6)
and ropes the *first* R = qk_rope_head_dim dims of both with the model's cos/sin in the
rotate-half (neox) layout, unlike MLA's interleaved pairs. A query s scores context token t as

    score[s, t] = sum_h  w[s, h] * relu(q_idx[s, h] . k_idx[t] * Di^-0.5),
    w = weights_proj(x) * Hi^-0.5                                            [T, Hi]

and MLA then attends only to the `index_topk` best-scoring tokens among the causal ones (all of
them while the query sees <= index_topk tokens). This is transformers' `DeepseekV32Indexer`
(which skips DeepSeek's Hadamard rotation and FP8 scoring: both leave q.k unchanged up to
rounding). Tokens with exactly equal scores (relu makes every head 0 for a token whose q.k are
all negative) are broken by `topk`, which is implementation-defined: transformers' own prefill
and decode break such ties differently, so a tie at the top-k boundary has no single answer.

The rope'd, normed key of every token is cached in the last Di columns of the paged cache row
([c_kv | k_pe | k_idx], see `ModelConfig.cache_dim`), so prefix caching, chunked prefill and
failover resume handle it like the latent row.

Shapes: T tokens in the step, H hidden, Hi = index_n_heads, Di = index_head_dim, L context,
q_lora = q_lora_rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kernels.deterministic import top_indices

INDEXER_NORM_EPS = 1e-6  # the k_norm LayerNorm's eps in transformers and DeepSeek's code


@dataclass
class IndexerWeights:
    """One layer's indexer (replicated on every attention tensor-parallel rank)."""

    wq_b: torch.Tensor  # [Hi*Di, q_lora]
    wk: torch.Tensor  # [Di, H]
    k_norm: torch.Tensor  # [Di] LayerNorm weight
    k_norm_bias: torch.Tensor  # [Di] LayerNorm bias
    weights_proj: torch.Tensor  # [Hi, H]

    @classmethod
    def load(cls, get, prefix: str, dtype: torch.dtype) -> IndexerWeights:
        """get(name, dtype) reads a checkpoint tensor; prefix ends with 'self_attn.indexer.'."""
        return cls(
            wq_b=get(prefix + "wq_b.weight", dtype),
            wk=get(prefix + "wk.weight", dtype),
            k_norm=get(prefix + "k_norm.weight", dtype),
            k_norm_bias=get(prefix + "k_norm.bias", dtype),
            weights_proj=get(prefix + "weights_proj.weight", dtype),
        )


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on the first R dims of x [T, ..., Di]; cos/sin [T, R/2]."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def _linear(kernels) -> Callable:
    """The indexer's linears: F.linear, or with deterministic kernels (kernels/deterministic.py)
    the model's batch-invariant ones (MKL's sums for a row depend on the rows beside it)."""
    return kernels.linear if kernels is not None and kernels.deterministic else F.linear


def index_keys(
    x: torch.Tensor, w: IndexerWeights, cos_sin: tuple[torch.Tensor, torch.Tensor], kernels=None
) -> torch.Tensor:
    """The indexer keys of this step's tokens: x [T, H] -> [T, Di] (normed, rope'd), to cache.
    kernels: the model's (None: plain torch). The LayerNorm (over each row's last dim) and the
    rope (elementwise) are row-local as they are."""
    k = F.layer_norm(_linear(kernels)(x, w.wk), (w.wk.shape[0],), w.k_norm, w.k_norm_bias, INDEXER_NORM_EPS)
    return _rope_neox(k, *cos_sin)


@dataclass
class IndexQueries:
    """What a step's queries need to score context tokens: q [T, Hi, Di] (rope'd) and the
    per-head weights w [T, Hi] (fp32, Hi^-0.5 and Di^-0.5 folded in as transformers does);
    `index_scores` the model's kernel for the scores (Kernels.index_scores)."""

    q: torch.Tensor
    weights: torch.Tensor
    topk: int
    index_scores: Callable
    # deterministic kernels: ties at the top-k boundary broken by the lower position (a stable
    # sort), whatever the length the scores are padded to
    stable_topk: bool = False

    @classmethod
    def build(
        cls,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        w: IndexerWeights,
        cfg: ModelConfig,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kernels,
    ) -> IndexQueries:
        """x [T, H] (post input-norm), q_lora [T, q_lora] (MLA's q_a_layernorm output); kernels:
        the model's (kernels/select.py)."""
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        linear = _linear(kernels)
        q = _rope_neox(linear(q_lora, w.wq_b).view(x.shape[0], Hi, Di), *cos_sin)
        weights = linear(x, w.weights_proj).float() * Hi**-0.5
        return cls(q, weights, cfg.index_topk, kernels.index_scores, bool(kernels.deterministic))

    def select(
        self, rows: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context tokens the queries `rows` ([Q] indices into the step's queries) attend to:
        the `topk` best-scoring visible ones (all visible ones when a query sees <= topk), as
        lists for attention to gather. keys [Q, L, Di] or [L, Di] (shared: one sequence's context)
        cached indexer keys, visible [Q, L] bool (causal and within the sequence) -> (positions
        [Q, k] int64 with each row's chosen ones first, count [Q] int64 of them), k = min(topk, L)."""
        k = min(self.topk, keys.shape[-2])
        # [Q, L] scores, -inf where not visible (each query's visible tokens are a prefix of the
        # context: causal, or a decode row's length)
        scores = self.index_scores(self.q[rows], self.weights[rows], keys, visible.sum(1))
        top = top_indices(scores, k) if self.stable_topk else scores.topk(k, dim=-1).indices  # [Q, k]
        chosen = visible.gather(1, top)  # (fewer than k visible: the rest are -inf picks)
        first = torch.sort(chosen.to(torch.int8), dim=1, descending=True, stable=True).indices
        return top.gather(1, first), chosen.sum(1)
