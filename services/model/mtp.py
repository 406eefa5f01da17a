"""DeepSeek-V3's multi-token prediction (MTP) module: the draft model of speculative decoding.

Hugging Face checkpoints keep module j at decoder-layer index `num_hidden_layers + j`
(`num_nextn_predict_layers` of them; DeepSeek-V3: one, `model.layers.61.*`):

    enorm, hnorm                RMSNorm of the next token's embedding and of the main model's state
    eh_proj [H, 2H]             cat(enorm(embed(next token)), hnorm(h)) -> H
    self_attn.*, mlp.*, input_layernorm, post_attention_layernorm
                                a full decoder layer (MLA, and MoE in V3): its own latent-cache slot
                                (index num_hidden_layers + j), its routed experts named by that index
    shared_head.norm, shared_head.head
                                the final norm and LM head of the module's prediction
    embed_tokens                a copy of the main embedding (shared: the main one is used)

At position p the module reads h(p), the main model's final-normed hidden state there (the LM
head's input, as vLLM passes `previous_hidden_states`), and the embedding of token p + 1, and
predicts token p + 2 (DeepSeek-V3 report, eq. 21-23; vLLM's deepseek_mtp.py): its rows run one
position behind the main model's. As in vLLM, the embedding at position 0 is zeroed. Drafting k > 1
tokens chains the module (DeepSeek's and vLLM's way with one MTP layer): the pass at p + 1 reads the
module's own output state at p (before `shared_head`) and the embedding of the token it drafted.

In the cluster the expert workers serve the module's routed experts like any other layer's:
`served_experts` is the model config as the expert pool sees it when the cluster speculates (its
MoE layers end with the module's, so placements, load counts and EPLB have a row for it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .checkpoint import CheckpointReader
from .config import ModelConfig
from .fp8 import Fp8Weight
from .messages import StepGen
from .weights import LayerWeights


@dataclass
class MTPWeights:
    index: int  # decoder-layer index (num_hidden_layers + j): its cache slot, its experts' layer
    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: torch.Tensor | Fp8Weight  # [H, 2H]: columns for the embedding, then for the hidden state
    layer: LayerWeights
    head_norm: torch.Tensor  # shared_head.norm [H]
    head: torch.Tensor  # shared_head.head [V, H] (the main LM head's tensor where they are equal)

    def tensors(self) -> list:
        """Every tensor it holds (the decoder layer's too), for byte counts."""
        layer = [*vars(self.layer).values(), *vars(self.layer.attn).values()]
        if self.layer.attn.indexer is not None:
            layer += vars(self.layer.attn.indexer).values()
        return [self.enorm, self.hnorm, self.eh_proj, self.head_norm, self.head, *layer]

    def to(self, device: torch.device) -> MTPWeights:
        def move(obj):
            for k, v in vars(obj).items():
                if isinstance(v, torch.Tensor | Fp8Weight):
                    setattr(obj, k, v.to(device))

        for obj in (self, self.layer, self.layer.attn, self.layer.attn.indexer):
            if obj is not None:
                move(obj)
        return self


def load_mtp(
    reader: CheckpointReader,
    cfg: ModelConfig,
    dtype: torch.dtype,
    load_layer,
    main_head: torch.Tensor,
    weight_dtype: torch.dtype | None = None,
    keep_fp8: bool = False,
) -> list[MTPWeights]:
    """The checkpoint's MTP modules (cfg.mtp_layers); `load_layer(reader, cfg, i, dtype)` reads
    a decoder layer as the main model's are read. ValueError where the config declares a module
    the checkpoint lacks."""
    out = []
    for i in cfg.mtp_layers:
        p = f"model.layers.{i}."
        if p + "eh_proj.weight" not in reader:
            raise ValueError(f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the checkpoint has no "
                             f"{p}eh_proj.weight (its MTP weights were dropped)")  # fmt: skip
        eh = p + "eh_proj.weight"
        fp8 = keep_fp8 and eh + "_scale_inv" in reader  # (DeepSeek-V3 ships eh_proj in BF16)
        head = reader.get_optional(p + "shared_head.head.weight", weight_dtype or dtype)
        if head is None or (head.shape == main_head.shape and torch.equal(head, main_head)):
            head = main_head  # (shared, as DeepSeek trains it: held once)
        out.append(MTPWeights(
            index=i,
            enorm=reader.get(p + "enorm.weight", dtype),
            hnorm=reader.get(p + "hnorm.weight", dtype),
            eh_proj=reader.get_fp8(eh) if fp8 else reader.get(eh, weight_dtype or dtype),
            layer=load_layer(reader, cfg, i, dtype),
            head_norm=reader.get(p + "shared_head.norm.weight", dtype),
            head=head,
        ))  # fmt: skip
    return out


def mtp_forward(
    model, w: MTPWeights, batch: StepBatch, hidden: torch.Tensor, latent_cache: torch.Tensor
) -> StepGen:
    """One pass of MTP module `w` of `model` (a model.DeepseekV3) over `batch`, whose rows are
    positions p with input_ids token p + 1, and `hidden` [T, H] the main model's final-normed
    state at p. Writes the module's latent rows at p into its cache slot (latent_cache[w.index]);
    yields expert messages at its MoE layer; returns fp32 logits [len(batch.logits_index), vocab]
    of token p + 2. With `batch.keep_hidden` it also sets `batch.hidden` [len(batch.logits_index),
    H]: the module's output state at those rows before `shared_head` (its residual stream), what
    a chained pass at p + 1 reads in place of the main model's state (more than one draft token)."""
    k, eps = model.kernels, model.cfg.rms_norm_eps
    h = module_input(model, w, batch, hidden)
    cos_sin = model.rope.cos_sin(batch.positions, model.dtype)
    h, delta = yield from model.decoder_layers(h, [(w.index, w.layer)], cos_sin, latent_cache, batch)
    rows = batch.logits_index
    out, last = k.add_rms_norm(h[rows], delta[rows], w.head_norm, eps)
    if batch.keep_hidden:
        batch.hidden = out
    return k.linear(last, w.head).float()


def module_input(model, w: MTPWeights, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
    """The module's residual stream [T, H] before its decoder layer:
    eh_proj(cat(enorm(embed(token p + 1)), hnorm(h(p)))), for `batch` and `hidden` as `mtp_forward`
    takes them."""
    k, eps = model.kernels, model.cfg.rms_norm_eps
    e = F.embedding(batch.input_ids, model.embed).masked_fill((batch.positions == 0)[:, None], 0.0)
    x = torch.cat((k.rms_norm(e, w.enorm, eps), k.rms_norm(hidden.to(e.dtype), w.hnorm, eps)), dim=-1)
    return k.linear(x, w.eh_proj)


def mtp_moe_layers(cfg: ModelConfig) -> list[int]:
    """Decoder-layer indices of the MTP modules' MoE layers (their routed experts)."""
    return [i for i in cfg.mtp_layers if cfg.is_moe_layer(i)]


@dataclass(frozen=True)
class WithMTPExperts(ModelConfig):
    """A model config whose MoE layers include the MTP modules' (`mtp_moe_layers`), after the main
    model's: what the expert pool serves when the cluster speculates. Its placement, load counts and
    EPLB cover num_moe_layers + the MTP MoE layers, each numbered by `moe_index` as the model's
    dispatches number them (model/weights.py: num_moe_layers of the main model + its MTP index)."""

    @property
    def moe_layers(self) -> list[int]:
        return ModelConfig.moe_layers.fget(self) + mtp_moe_layers(self)

    def moe_index(self, layer: int) -> int:
        return self.moe_layers.index(layer)


def served_experts(cfg: ModelConfig, mtp: bool) -> ModelConfig:
    """The config whose MoE layers the expert workers serve: with `mtp` (the cluster speculates) the
    MTP modules' too (`WithMTPExperts`), else `cfg` itself."""
    if not mtp or not mtp_moe_layers(cfg) or isinstance(cfg, WithMTPExperts):
        return cfg
    return WithMTPExperts(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig) if f.init})
