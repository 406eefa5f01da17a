"""The attention side's weights of a DeepSeek-V3 / V3.2 decoder layer as plain tensors, read from a
checkpoint (`load_layer`), and their head slices for attention tensor parallelism (`shard_heads`).

Shapes use H = hidden size, N = attention heads, C = kv_lora_rank, R = qk_rope_head_dim, D =
qk_nope_head_dim, V = v_head_dim, I = the MLP width, E = routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint import CheckpointReader
from .config import ModelConfig
from .fp8 import Fp8Weight
from .indexer import IndexerWeights


@dataclass
class MLAWeights:
    """One layer's MLA weights. `kv_b` [N*(D+V), C]; q either via q_a/q_b (q_lora) or q_proj. The
    linears (kv_a, o, q_a, q_b, q_proj) are tensors, or Fp8Weight with `keep_fp8` (load_layer)."""

    kv_a: torch.Tensor | Fp8Weight  # [C+R, H]
    kv_a_norm: torch.Tensor  # [C]
    kv_b: torch.Tensor  # [N*(D+V), C]
    o: torch.Tensor | Fp8Weight  # [H, N*V]
    q_a: torch.Tensor | Fp8Weight | None = None  # [q_lora, H]
    q_a_norm: torch.Tensor | None = None  # [q_lora]
    q_b: torch.Tensor | Fp8Weight | None = None  # [N*(D+R), q_lora]
    q_proj: torch.Tensor | Fp8Weight | None = None  # [N*(D+R), H]
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    indexer: IndexerWeights | None = None  # DeepSeek-V3.2 (replicated across tensor-parallel ranks)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: MLAWeights
    # dense MLP (layers < first_k_dense_replace) or MoE shared experts: gate and up packed
    mlp_w13: torch.Tensor | Fp8Weight | None = None  # [2I, H]: gate_proj rows, then up_proj rows
    mlp_down: torch.Tensor | Fp8Weight | None = None  # [H, I]
    # MoE gate
    router: torch.Tensor | None = None  # [E, H] fp32 (the model dtype's values: the gate runs in fp32)
    router_bias: torch.Tensor | None = None  # [E] fp32 e_score_correction_bias
    moe_layer: int | None = None  # index among the MoE layers; None: a dense layer

    @property
    def is_moe(self) -> bool:
        return self.moe_layer is not None


def load_layer(
    reader: CheckpointReader,
    cfg: ModelConfig,
    i: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    keep_fp8: bool = False,
) -> LayerWeights:
    """Layer i's weights in `dtype`; the matrices that only go through `linear` (q_a, q_b / q_proj,
    kv_a, o, the dense MLP or shared experts) in `weight_dtype` when given (bf16 under fp32: see
    the C++ linear kernel), or with `keep_fp8` as the FP8 checkpoint stores them (fp8.Fp8Weight).
    kv_b (the absorbed attention's bmm), the indexer and the router stay in `dtype` (the router in
    fp32)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    get, opt = reader.get, reader.get_optional
    lw = weight_dtype or dtype

    def lin(name: str) -> torch.Tensor | Fp8Weight:
        return reader.get_fp8(name) if keep_fp8 else get(name, lw)

    attn = MLAWeights(
        kv_a=lin(a + "kv_a_proj_with_mqa.weight"),
        kv_a_norm=get(a + "kv_a_layernorm.weight", dtype),
        kv_b=get(a + "kv_b_proj.weight", dtype),
        o=lin(a + "o_proj.weight"),
        kv_a_bias=opt(a + "kv_a_proj_with_mqa.bias", dtype),
        o_bias=opt(a + "o_proj.bias", dtype),
    )
    if cfg.q_lora_rank:
        attn.q_a = lin(a + "q_a_proj.weight")
        attn.q_a_norm = get(a + "q_a_layernorm.weight", dtype)
        attn.q_b = lin(a + "q_b_proj.weight")
        attn.q_a_bias = opt(a + "q_a_proj.bias", dtype)
    else:
        attn.q_proj = lin(a + "q_proj.weight")
    if cfg.has_indexer:
        attn.indexer = IndexerWeights.load(get, a + "indexer.", dtype)
    layer = LayerWeights(
        input_norm=get(p + "input_layernorm.weight", dtype),
        post_norm=get(p + "post_attention_layernorm.weight", dtype),
        attn=attn,
        moe_layer=cfg.moe_index(i) if cfg.is_moe_layer(i) else None,
    )
    mlp = p + ("mlp.shared_experts." if layer.is_moe else "mlp.")
    if layer.is_moe:
        layer.router = get(p + "mlp.gate.weight", dtype).float()  # (once here, not per step)
        layer.router_bias = opt(p + "mlp.gate.e_score_correction_bias", torch.float32)
    if not layer.is_moe or cfg.n_shared_experts:
        gate, up = lin(mlp + "gate_proj.weight"), lin(mlp + "up_proj.weight")
        layer.mlp_w13 = Fp8Weight.stack_rows([gate, up]) if keep_fp8 else torch.cat([gate, up])
        layer.mlp_down = lin(mlp + "down_proj.weight")
    return layer


def load_layers(
    load_layer, reader: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype, progress=None
) -> list:
    """load_layer(reader, cfg, i, dtype) for every decoder layer, reporting progress(done, total)."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        layers.append(load_layer(reader, cfg, i, dtype))
        if progress is not None:
            progress(i + 1, cfg.num_hidden_layers)
    return layers


def shard_heads(w: MLAWeights, cfg: ModelConfig, rank: int, tp: int) -> MLAWeights:
    """The MLA weights of attention tensor-parallel rank `rank` of `tp`: a contiguous slice of
    the heads in q_b/q_proj, kv_b and o (columns); the latent projections and the V3.2 indexer
    are replicated (every rank holds the full latent cache and picks the same top-k tokens); o's
    bias goes to rank 0 so the sum over ranks adds it once."""
    N = cfg.num_attention_heads
    if N % tp:
        raise ValueError(f"attention_tp={tp} does not divide num_attention_heads={N}")
    if isinstance(w.o, Fp8Weight):
        raise ValueError(
            "linears kept FP8 (keep_fp8_linears) with attention tensor parallelism: not supported yet"
        )
    heads = slice(rank * N // tp, (rank + 1) * N // tp)
    D, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def rows(t: torch.Tensor | None, per_head: int) -> torch.Tensor | None:
        return None if t is None else t.view(N, per_head, -1)[heads].reshape(-1, t.shape[-1]).contiguous()

    return MLAWeights(
        kv_a=w.kv_a,
        kv_a_norm=w.kv_a_norm,
        kv_b=rows(w.kv_b, D + V),
        o=w.o.view(w.o.shape[0], N, V)[:, heads].reshape(w.o.shape[0], -1).contiguous(),
        q_a=w.q_a,
        q_a_norm=w.q_a_norm,
        q_b=rows(w.q_b, D + R),
        q_proj=rows(w.q_proj, D + R),
        q_a_bias=w.q_a_bias,
        kv_a_bias=w.kv_a_bias,
        o_bias=w.o_bias if rank == 0 else None,
        indexer=w.indexer,
    )
