"""Model configuration: one dataclass read from a Hugging Face DeepSeek-V3/V2 `config.json`.

Both config styles are accepted: the original `rope_scaling` + `rope_theta` keys and the
transformers-v5 `rope_parameters` dict. `head_dim` written by transformers v5 is the rope
dimension, not the attention head size, and is ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16 (float32 and float16 likewise)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.").lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (`rope_type == "yarn"`); absent for plain RoPE."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str = "noaux_tc"  # "noaux_tc" (V3), "greedy" / "group_limited_greedy" (V2)
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    num_nextn_predict_layers: int = 0
    torch_dtype: str = "bfloat16"
    fp8_block_size: tuple[int, int] | None = None  # set for FP8 block-quantised checkpoints
    model_type: str = "deepseek_v3"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent-cache row: [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN (mscale from mscale_all_dim), as in HF."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE decoder layers, in order."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json dict (DeepSeek-V3, V2, V2-Lite, Kimi-K2-style)."""
        model_type = hf.get("model_type", "deepseek_v3")
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling_raw = dict(hf.get("rope_scaling") or {})
        merged = {**rope_scaling_raw, **rope_params}
        rope_type = merged.get("rope_type") or merged.get("type") or "default"
        rope_theta = float(merged.get("rope_theta") or hf.get("rope_theta") or 10000.0)
        max_pos = int(hf.get("max_position_embeddings", 4096))
        rope_scaling = None
        if rope_type == "yarn":
            orig = int(merged.get("original_max_position_embeddings") or max_pos)
            factor = merged.get("factor")
            rope_scaling = RopeScaling(
                factor=float(factor) if factor is not None else max_pos / orig,
                original_max_position_embeddings=orig,
                beta_fast=float(merged.get("beta_fast") or 32),
                beta_slow=float(merged.get("beta_slow") or 1),
                mscale=merged.get("mscale"),
                mscale_all_dim=merged.get("mscale_all_dim"),
                attention_factor=merged.get("attention_factor"),
                truncate=bool(merged.get("truncate", True)),
            )
        elif rope_type != "default":
            raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, yarn)")

        eos = hf.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qc = hf.get("quantization_config") or {}
        fp8_block = None
        if qc:
            if qc.get("quant_method") != "fp8":
                raise ValueError(f"unsupported quantization {qc.get('quant_method')!r} (only fp8 blocks)")
            fp8_block = tuple(qc.get("weight_block_size") or (128, 128))

        default_scoring = "sigmoid" if model_type == "deepseek_v3" else "softmax"
        default_topk = "noaux_tc" if model_type == "deepseek_v3" else "greedy"
        n_routed = int(hf.get("n_routed_experts") or 0)
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        known = {f.name for f in fields(cls)}
        cfg = cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            q_lora_rank=hf.get("q_lora_rank") or None,
            n_routed_experts=n_routed,
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(
                hf.get("routed_scaling_factor", 2.5 if model_type == "deepseek_v3" else 1.0)
            ),
            norm_topk_prob=bool(hf.get("norm_topk_prob", model_type == "deepseek_v3")),
            scoring_func=hf.get("scoring_func") or default_scoring,
            topk_method=hf.get("topk_method") or default_topk,
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(hf.get("moe_layer_freq") or 1),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(hf.get("rope_interleave", True)),
            max_position_embeddings=max_pos,
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id", 0),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(mtp or 0),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            fp8_block_size=fp8_block,
            model_type=model_type,
            extra={k: v for k, v in hf.items() if k not in known},
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf(json.loads(path.read_text()))

    def validate(self) -> None:
        """Raise ValueError naming the first constraint the config breaks."""
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported (only silu)")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func {self.scoring_func!r} not supported")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts {self.n_routed_experts} % n_group {self.n_group} != 0")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
            group_size = self.n_routed_experts // self.n_group
            if self.n_group > 1 and group_size < 2 and self.topk_method == "noaux_tc":
                raise ValueError("each expert group needs >= 2 experts (group score = top-2 sum)")
            if not 1 <= self.num_experts_per_tok <= self.topk_group * group_size:
                raise ValueError(
                    f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of the "
                    f"topk_group={self.topk_group} selected groups ({self.topk_group * group_size})"
                )
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] (fp32) and the cos/sin attention factor, as HF computes them."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0

    if rs.attention_factor is not None:
        attention_factor = float(rs.attention_factor)
    elif rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(
            rs.factor, rs.mscale_all_dim
        )
    else:
        attention_factor = yarn_get_mscale(rs.factor)

    def correction_dim(num_rotations: float) -> float:
        orig = rs.original_max_position_embeddings
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, attention_factor
