"""Model configuration: one dataclass read from a Hugging Face DeepSeek-V3/V2/V3.2/V4 `config.json`.

Both config styles are accepted: the original `rope_scaling` + `rope_theta` keys and the
transformers-v5 `rope_parameters` dict. `head_dim` written by transformers v5 is the rope
dimension, not the attention head size, and is ignored.

Only the model types in `MODEL_TYPES` load; a config naming another one, or an option that would
change the math in a way this code does not implement (sliding windows, hyper-connections, a V3.2
indexer on a non-V3.2 model, ...), is refused with a ValueError naming the key: silently running
such a model as plain DeepSeek-V3 would produce wrong tokens.

DeepSeek-V4 (`deepseek_v4`) has no MLA: its fields (`head_dim`, `layer_types`, compress ratios,
hyper-connections, ...) are read by `config_v4.v4_fields`; the MLA fields then describe its one shared
KV head (qk_nope_head_dim = head_dim - rope dims, v_head_dim = head_dim, kv_lora_rank = 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .config_v4 import v4_fields, validate_v4

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


# model_type -> what it is. V2 and V3 share the MLA + MoE math (routing set by scoring_func /
# topk_method); V3.2 adds the lightning indexer (DeepSeek Sparse Attention) to every layer.
MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2 / V2-Lite",
    "deepseek_v3": "DeepSeek-V3 / R1, Moonlight",
    "kimi_k2": "Kimi-K2 (DeepSeek-V3 architecture)",
    "deepseek_v32": "DeepSeek-V3.2 (V3 + lightning indexer, top-k sparse MLA)",
    "deepseek_v4": "DeepSeek-V4 (shared-KV sliding/compressed attention, mHC, hash-routed MoE)",
}
_V3_LIKE = ("deepseek_v3", "deepseek_v32", "kimi_k2")  # sigmoid / noaux_tc routing defaults
INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")

# Options of other architectures (DeepSeek-V4, Llama/Qwen/Gemma-style models) that change the
# math when set: accepted only at their neutral value (absent, null, or the value given here).
_NEUTRAL = {
    "sliding_window": None,
    "use_sliding_window": False,
    "swiglu_limit": None,
    "hc_mult": 1,
    "o_groups": None,
    "o_lora_rank": None,
    "compress_ratios": None,
    "compress_rates": None,
    "mlp_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "qk_layernorm": False,
    "use_qk_norm": False,
    "num_hash_layers": 0,
}
# DeepSeek-V4's own options, accepted (at any value) for deepseek_v4 only
_V4_OPTIONS = ("sliding_window", "swiglu_limit", "hc_mult", "o_groups", "o_lora_rank", "compress_ratios",
               "compress_rates", "num_hash_layers")  # fmt: skip
_ATTENTION_LAYER_TYPE = {"deepseek_v32": "indexed_attention"}  # others: "full_attention"


def _check_hf_options(hf: dict[str, Any], model_type: str) -> None:
    """Refuse (ValueError naming the key) config options whose math this code does not run."""
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    v4 = model_type == "deepseek_v4"
    for key, neutral in _NEUTRAL.items():
        if v4 and key in _V4_OPTIONS:
            continue
        value = hf.get(key)
        if value is not None and value != neutral and not (neutral is None and value in (0, False)):
            raise ValueError(f"config option {key}={value!r} is not supported by this engine")
    if model_type not in ("deepseek_v32", "deepseek_v4"):
        for key in INDEXER_KEYS:
            if hf.get(key) is not None:
                raise ValueError(
                    f"config option {key} is a DeepSeek-V3.2 indexer option, but model_type is "
                    f"{model_type!r} (expected 'deepseek_v32')"
                )
    if v4:  # V4's layer types are checked by _v4_fields
        return
    want = _ATTENTION_LAYER_TYPE.get(model_type, "full_attention")
    bad = sorted({t for t in hf.get("layer_types") or () if t != want})
    if bad:
        raise ValueError(f"layer_types {bad} not supported for {model_type} (only {want!r})")


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
    # DeepSeek-V3.2 lightning indexer (model_type "deepseek_v32"; all 0 otherwise)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # DeepSeek-V4 (model_type "deepseek_v4"; neutral otherwise). The index_* fields above are its
    # CSA indexer's; qk_rope_head_dim its rope dims.
    head_dim: int = 0  # the one shared K=V head: qk_nope_head_dim + qk_rope_head_dim
    layer_types: tuple[str, ...] = ()  # per layer, one of config_v4.V4_ATTENTION_TYPES
    mlp_layer_types: tuple[str, ...] = ()  # per layer, "hash_moe" (experts from tid2eid) or "moe"
    compress_ratio_csa: int = 0  # source tokens per compressed entry, compressed_sparse_attention
    compress_ratio_hca: int = 0  # ... and heavily_compressed_attention
    sliding_window: int = 0  # every V4 layer attends to its last `sliding_window` tokens
    compress_rope_theta: float = 0.0  # rope of the CSA/HCA layers (sliding ones use rope_theta)
    compress_rope_scaling: RopeScaling | None = None
    hc_mult: int = 1  # hyper-connection residual streams
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    swiglu_limit: float | None = None  # clamp of the SwiGLU gate (max) and up (both sides)
    o_groups: int = 0  # grouped output projection: head groups ...
    o_lora_rank: int = 0  # ... and each group's intermediate width
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
    def has_indexer(self) -> bool:
        """DeepSeek-V3.2: every layer's queries attend only to their indexer's top-k tokens."""
        return self.index_topk > 0 and not self.is_v4

    @property
    def is_v4(self) -> bool:
        return self.model_type == "deepseek_v4"

    @property
    def cache_dim(self) -> int:
        """Width of one paged-cache row: the latent row [c_kv | k_pe], then for V3.2 the
        indexer's key (index_head_dim), so one block table addresses both. (DeepSeek-V4 has no
        uniform row: `v4_state_dim` / `v4_entry_dim`.)"""
        if self.is_v4:
            raise ValueError("a DeepSeek-V4 cache has no uniform row width (see kv_cache.V4Cache)")
        return self.latent_dim + (self.index_head_dim if self.has_indexer else 0)

    def attention_type(self, layer: int) -> str:
        """DeepSeek-V4: decoder layer `layer`'s attention (a `layer_types` entry); an MTP module's
        (`mtp_layers`) is sliding-window only, as DeepSeek's MTPBlock builds it (no compressor)."""
        return self.layer_types[layer] if layer < self.num_hidden_layers else "sliding_attention"

    def compress_ratio(self, layer: int) -> int:
        """DeepSeek-V4: source tokens per compressed KV entry of `layer` (0: sliding only)."""
        kind = self.attention_type(layer)
        if kind == "compressed_sparse_attention":
            return self.compress_ratio_csa
        return self.compress_ratio_hca if kind == "heavily_compressed_attention" else 0

    def v4_state_dim(self, layer_type: str) -> int:
        """Width of a DeepSeek-V4 window-state row (one recent token, one layer) of `layer_type`:
        sliding: [kv (head_dim)];
        HCA: [kv | compressor kv (D) | compressor gate (D)], D = head_dim;
        CSA: [kv | compressor kv (2D) | gate (2D) | indexer kv (2Di) | gate (2Di)],
        Di = index_head_dim (two overlapping series). See v4_attention.py."""
        D, Di = self.head_dim, self.index_head_dim
        if layer_type == "sliding_attention":
            return D
        if layer_type == "heavily_compressed_attention":
            return D + 2 * D
        return D + 4 * D + 4 * Di

    def v4_entry_dim(self, layer_type: str) -> int:
        """Width of a DeepSeek-V4 compressed entry (one per compress ratio tokens): HCA [entry (D)],
        CSA [entry (D) | indexer key (Di)], sliding layers none (0)."""
        if layer_type == "sliding_attention":
            return 0
        if layer_type == "heavily_compressed_attention":
            return self.head_dim
        return self.head_dim + self.index_head_dim

    def v4_state_start(self, end: int) -> int:
        """DeepSeek-V4: the first position whose window-state row (kv, compressor state) a step
        computing tokens from position `end` on still reads: its first query's sliding window,
        and the source tokens of the first compressed entry it can complete (CSA's two
        overlapping series reach one window further back). Non-decreasing in `end`."""
        start = end - self.sliding_window + 1
        for r, overlap in ((self.compress_ratio_csa, True), (self.compress_ratio_hca, False)):
            if r:
                start = min(start, (end // r - overlap) * r)
        return max(0, start)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN (mscale from mscale_all_dim), as in HF."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_hash_layer(self, layer: int) -> bool:
        """DeepSeek-V4: the layer's experts come from the token id (`ffn.gate.tid2eid`); an MTP
        module's are routed by its gate."""
        return layer < len(self.mlp_layer_types) and self.mlp_layer_types[layer] == "hash_moe"

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

    @property
    def mtp_layers(self) -> list[int]:
        """Decoder-layer indices of the multi-token-prediction modules (checkpoint names
        `model.layers.{i}.*`, after the main layers; services/model/mtp.py)."""
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    def moe_index(self, layer: int) -> int:
        """Decoder layer `layer`'s index among the MoE layers (a MoE layer of an MTP module comes
        after the main model's: num_moe_layers + its MTP index); ValueError for a dense layer."""
        if layer >= self.num_hidden_layers and self.is_moe_layer(layer):
            return self.num_moe_layers + self.mtp_layers.index(layer)
        return self.moe_layers.index(layer)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json dict (DeepSeek-V3, V2, V2-Lite, V3.2, V4, Kimi-K2)."""
        model_type = hf.get("model_type") or "deepseek_v3"
        _check_hf_options(hf, model_type)
        max_pos = int(hf.get("max_position_embeddings", 4096))
        if model_type == "deepseek_v4":
            v4 = v4_fields(hf)
            rope_theta, rope_scaling = _parse_rope(v4.pop("main_rope"), 10000.0, max_pos)
            compress = _parse_rope(v4.pop("compress_rope"), 160000.0, max_pos)
            v4["compress_rope_theta"], v4["compress_rope_scaling"] = compress
        else:
            v4 = {}
            merged = {**dict(hf.get("rope_scaling") or {}), **dict(hf.get("rope_parameters") or {})}
            rope_theta, rope_scaling = _parse_rope(merged, float(hf.get("rope_theta") or 10000.0), max_pos)

        eos = hf.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qc = hf.get("quantization_config") or {}
        fp8_block = None
        if qc:
            if qc.get("quant_method") != "fp8":
                raise ValueError(f"unsupported quantization {qc.get('quant_method')!r} (only fp8 blocks)")
            fp8_block = tuple(qc.get("weight_block_size") or (128, 128))

        v3_like = model_type in _V3_LIKE or bool(v4)
        default_scoring = "sqrtsoftplus" if v4 else "sigmoid" if v3_like else "softmax"
        default_topk = "noaux_tc" if v3_like else "greedy"
        n_routed = int(hf.get("n_routed_experts") or 0)
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        known = {f.name for f in fields(cls)}
        cfg = cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["moe_intermediate_size"] if v4 else hf["intermediate_size"]),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            kv_lora_rank=0 if v4 else int(hf["kv_lora_rank"]),
            qk_nope_head_dim=v4.pop("qk_nope_head_dim") if v4 else int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=v4.pop("qk_rope_head_dim") if v4 else int(hf["qk_rope_head_dim"]),
            v_head_dim=v4["head_dim"] if v4 else int(hf["v_head_dim"]),
            q_lora_rank=hf.get("q_lora_rank") or None,
            n_routed_experts=n_routed,
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(
                hf.get("routed_scaling_factor", 1.5 if v4 else 2.5 if v3_like else 1.0)
            ),
            norm_topk_prob=bool(hf.get("norm_topk_prob", v3_like)),
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
            **{k: int(hf.get(k) or 0) for k in INDEXER_KEYS},
            **v4,  # DeepSeek-V4's own fields (empty otherwise)
            extra={k: v for k, v in hf.items() if k not in known},
        )
        cfg.validate()
        mlp_types = hf.get("mlp_layer_types")  # transformers' V3.2 decides dense/MoE per layer by this
        if mlp_types is not None and not v4:
            ours = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]
            if list(mlp_types) != ours:
                raise ValueError(
                    f"mlp_layer_types {mlp_types} disagrees with first_k_dense_replace="
                    f"{cfg.first_k_dense_replace} / moe_layer_freq={cfg.moe_layer_freq} ({ours})"
                )
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
        scoring = ("sqrtsoftplus", "sigmoid") if self.is_v4 else ("sigmoid", "softmax")
        if self.scoring_func not in scoring:
            raise ValueError(f"scoring_func {self.scoring_func!r} not supported for {self.model_type}")
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
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {self.topk_method!r} not supported")
        if self.model_type == "deepseek_v32":
            self._validate_indexer()
        if self.is_v4:
            validate_v4(self)

    def _validate_indexer(self) -> None:
        for key in INDEXER_KEYS:
            if getattr(self, key) <= 0:
                raise ValueError(f"deepseek_v32 needs a positive {key} (got {getattr(self, key)})")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim {self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim}: "
                "the indexer ropes its first qk_rope_head_dim dims"
            )
        if not self.q_lora_rank:
            raise ValueError("deepseek_v32 needs q_lora_rank (the indexer reads the q_lora query)")
        if not self.rope_interleave:
            raise ValueError("rope_interleave=false is not supported for deepseek_v32")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def _parse_rope(params: dict[str, Any], theta: float, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, YaRN parameters or None) of one rope_scaling / rope_parameters dict;
    `theta` when the dict names none."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or theta)
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, yarn)")
    orig = int(params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    return theta, RopeScaling(
        factor=float(factor) if factor is not None else max_pos / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig, compress: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] (fp32) and the cos/sin attention factor, as HF computes them.
    compress: DeepSeek-V4's rope of the compressed (CSA/HCA) layers."""
    dim = cfg.qk_rope_head_dim
    base, rs = (
        (cfg.compress_rope_theta, cfg.compress_rope_scaling)
        if compress
        else (cfg.rope_theta, cfg.rope_scaling)
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
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


def check_weight_dtype(
    weight_dtype: str | None, dtype: torch.dtype, device: str, cfg: ModelConfig | None = None
) -> torch.dtype | None:
    """The weights' storage dtype for `EngineConfig.weight_dtype` (None: the compute dtype); a
    clear error for a combination no kernel serves."""
    wd = None if weight_dtype is None else parse_dtype(weight_dtype)
    if wd is None or wd == dtype:
        return None
    if wd != torch.bfloat16 or dtype != torch.float32 or torch.device(device).type != "cpu":
        raise ValueError(
            f"weight_dtype {weight_dtype} under dtype {dtype} on {device}: weights narrower than the "
            "compute dtype are bfloat16 under float32 on CPU only"
        )
    if cfg is not None and cfg.is_v4:
        raise ValueError("weight_dtype bfloat16 is not supported for DeepSeek-V4 checkpoints yet")
    return wd
