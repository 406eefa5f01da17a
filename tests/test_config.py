import json

import pytest

from services.model.config import ModelConfig, parse_dtype

# DeepSeek-V3's own config.json (original style: rope_scaling + rope_theta, FP8 quantization_config)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# DeepSeek-V2-Lite: softmax routing, no q_lora, greedy top-k, mscale 0.707
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "eos_token_id": 100001,
    "bos_token_id": 100000,
}


def test_deepseek_v3_config():
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    assert cfg.softmax_scale == pytest.approx(0.1352338, abs=1e-7)
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.fp8_block_size == (128, 128)
    assert cfg.moe_layers == list(range(3, 61)) and cfg.num_moe_layers == 58
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.rope_scaling.factor == 40 and cfg.rope_scaling.original_max_position_embeddings == 4096


def test_v5_style_matches_original_style():
    v5 = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    v5["rope_parameters"] = {**DEEPSEEK_V3["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000.0}
    v5["dtype"] = "bfloat16"
    v5["head_dim"] = 64  # transformers v5 writes the rope dim here; it must not be read as the head size
    a, b = ModelConfig.from_hf(DEEPSEEK_V3), ModelConfig.from_hf(v5)
    assert a.to_dict() == b.to_dict()


def test_yarn_inv_freq_matches_transformers():
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.model.config import rope_inv_freq

    hf_cfg = DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"})
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours, factor = rope_inv_freq(ModelConfig.from_hf(DEEPSEEK_V3))
    assert torch.equal(ours, hf_inv) and factor == hf_factor == 1.0


def test_v2_lite_config():
    cfg = ModelConfig.from_hf(DEEPSEEK_V2_LITE)
    assert cfg.q_lora_rank is None
    assert cfg.scoring_func == "softmax" and cfg.topk_method == "greedy" and not cfg.norm_topk_prob
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * __import__("math").log(40) + 1) ** 2)
    assert cfg.moe_layers == list(range(1, 27))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 9}, "topk_group"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "rope"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization"),
    ],
)
def test_invalid_configs_name_the_constraint(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**DEEPSEEK_V3, **change})


def test_from_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    assert ModelConfig.from_dir(tmp_path).hidden_size == 7168
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_dir(tmp_path / "missing")


def test_parse_dtype():
    import torch

    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype("int3")
