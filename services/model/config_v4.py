"""DeepSeek-V4's config.json fields (`model_type: deepseek_v4`), read as transformers'
`DeepseekV4Config` reads them, and their checks. `ModelConfig.from_hf` (config.py) calls these.
"""

from __future__ import annotations

from typing import Any

V4_ATTENTION_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_MLP_TYPES = ("hash_moe", "moe")
# transformers folds DeepSeek's per-layer `compress_ratios` into layer_types with this map
_V4_RATIO_TO_TYPE = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}


def v4_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V4's fields from its config.json, with transformers' defaults (DeepseekV4Config) for
    absent keys and its folding of DeepSeek's own names (`compress_ratios`, `compress_rate_csa` /
    `_hca`, `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling` that is the compress rope)."""

    def opt(key: str, default: Any) -> Any:  # transformers' default for an absent (or null) key
        value = hf.get(key)
        return default if value is None else value

    n = int(hf["num_hidden_layers"])
    for key, neutral in (
        ("first_k_dense_replace", 0),
        ("moe_layer_freq", 1),
        ("n_group", 1),
        ("topk_group", 1),
    ):
        if opt(key, neutral) != neutral:
            raise ValueError(f"config option {key}={hf[key]!r} is not supported for deepseek_v4")
    expert_dtype = hf.get("expert_dtype") or (hf.get("quantization_config") or {}).get("expert_dtype")
    if expert_dtype is not None:  # e.g. FP4 experts: read only as FP8 blocks or plain floats here
        raise ValueError(f"config option expert_dtype={expert_dtype!r} is not supported by this engine")
    head_dim = int(opt("head_dim", 512))
    rates = dict(
        opt("compress_rates", {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    )
    for short, kind in (("csa", "compressed_sparse_attention"), ("hca", "heavily_compressed_attention")):
        if hf.get(f"compress_rate_{short}") is not None:
            rates[kind] = hf[f"compress_rate_{short}"]
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("compress_ratios") is not None:
        try:
            layer_types = [_V4_RATIO_TO_TYPE[r] for r in hf["compress_ratios"]]
        except KeyError as e:
            raise ValueError(
                f"compress_ratios entry {e.args[0]} is not one of {sorted(_V4_RATIO_TO_TYPE)}"
            ) from None
    if layer_types is None:  # transformers' default: 2 HCA, then CSA / HCA alternating
        layer_types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))
        ]
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = int(opt("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    for name, types, allowed in (("layer_types", layer_types, V4_ATTENTION_TYPES),
                                 ("mlp_layer_types", mlp_types, V4_MLP_TYPES)):  # fmt: skip
        bad = sorted({t for t in types if t not in allowed})
        if bad or len(types) < n:
            raise ValueError(f"{name} {list(types)} must give each of the {n} layers one of {allowed}")

    prf = hf.get("partial_rotary_factor")
    if prf is None:
        prf = hf["qk_rope_head_dim"] / head_dim if hf.get("qk_rope_head_dim") else 64 / 512
    rope_dim = int(head_dim * prf)
    rp = dict(hf.get("rope_parameters") or {})
    main_theta, compress_theta = (
        float(opt("rope_theta", 10000.0)),
        float(opt("compress_rope_theta", 160000.0)),
    )
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:  # a flat dict is the compress rope's (YaRN); the sliding layers' rope is plain
        flat = {
            **dict(hf.get("rope_scaling") or {}),
            **{k: v for k, v in rp.items() if k not in ("main", "compress")},
        }
        main = {"rope_type": "default", "rope_theta": main_theta}
        compress = {**flat, "rope_theta": compress_theta}
    for name, params in (("main", main), ("compress", compress)):
        if int(head_dim * params.get("partial_rotary_factor", prf)) != rope_dim:
            raise ValueError(f"rope_parameters[{name!r}] partial_rotary_factor disagrees with {prf}")
        if (params.get("rope_type") or params.get("type")) == "yarn":
            params.setdefault("attention_factor", 1.0)  # transformers: V4 does not scale cos/sin
            params["truncate"] = True  # transformers' V4 reads `truncate` where it never is
    limit = hf.get("swiglu_limit", 10.0)
    return dict(
        head_dim=head_dim,
        qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        layer_types=tuple(layer_types[:n]),
        mlp_layer_types=tuple(mlp_types[:n]),
        compress_ratio_csa=int(rates.get("compressed_sparse_attention") or 0),
        compress_ratio_hca=int(rates.get("heavily_compressed_attention") or 0),
        sliding_window=int(opt("sliding_window", 128)),
        hc_mult=int(opt("hc_mult", 4)),
        hc_sinkhorn_iters=int(opt("hc_sinkhorn_iters", 20)),
        hc_eps=float(opt("hc_eps", 1e-6)),
        swiglu_limit=None if limit is None else float(limit),
        o_groups=int(opt("o_groups", 8)),
        o_lora_rank=int(opt("o_lora_rank", 1024)),
        main_rope=main,  # rope parameter dicts, parsed by config._parse_rope
        compress_rope=compress,
    )


def validate_v4(cfg: Any) -> None:
    """Raise ValueError naming the first DeepSeek-V4 constraint `cfg` breaks."""
    R, N = cfg.qk_rope_head_dim, cfg.num_attention_heads
    checks = [
        (0 < R < cfg.head_dim and R % 2 == 0, f"rope dims {R} must be even and in (0, head_dim={cfg.head_dim})"),
        (cfg.sliding_window >= 1, "sliding_window must be >= 1"),
        (cfg.hc_mult >= 1 and cfg.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1"),
        (cfg.o_groups >= 1 and N % cfg.o_groups == 0 and cfg.o_lora_rank >= 1,
         f"o_groups {cfg.o_groups} must divide num_attention_heads {N} (and o_lora_rank be >= 1)"),
        (bool(cfg.q_lora_rank), "deepseek_v4 needs q_lora_rank"),
        (cfg.n_routed_experts > 0 and cfg.num_experts_per_tok <= cfg.n_routed_experts,
         "deepseek_v4 needs n_routed_experts >= num_experts_per_tok"),
        (cfg.n_shared_experts == 1, f"n_shared_experts {cfg.n_shared_experts}: deepseek_v4 has one shared expert"),
        (cfg.topk_method == "noaux_tc", f"topk_method {cfg.topk_method!r} not supported for deepseek_v4"),
        (cfg.norm_topk_prob, "norm_topk_prob=false is not supported for deepseek_v4 (weights are normalised)"),
        (not cfg.attention_bias, "attention_bias is not supported for deepseek_v4"),
        (not cfg.tie_word_embeddings, "tie_word_embeddings is not supported for deepseek_v4"),
        (cfg.swiglu_limit is None or cfg.swiglu_limit > 0, "swiglu_limit must be > 0"),
    ]  # fmt: skip
    kinds = set(cfg.layer_types)
    if "compressed_sparse_attention" in kinds:
        checks += [
            (cfg.compress_ratio_csa >= 1, "compress_rates: compressed_sparse_attention must be >= 1"),
            (
                min(cfg.index_n_heads, cfg.index_topk) >= 1,
                "deepseek_v4 CSA layers need index_n_heads, index_topk",
            ),
            (cfg.index_head_dim >= R, f"index_head_dim {cfg.index_head_dim} < rope dims {R}"),
        ]
    if "heavily_compressed_attention" in kinds:
        checks.append(
            (cfg.compress_ratio_hca >= 1, "compress_rates: heavily_compressed_attention must be >= 1")
        )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
