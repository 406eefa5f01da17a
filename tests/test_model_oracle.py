"""Our model and LocalEngine against Hugging Face transformers' DeepseekV3 (fp32, eager)."""

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .hf_oracle import V3_YARN, generate_with_logits, hf_greedy, load_hf, make_hf_checkpoint

CONFIGS = {
    # q_lora on, V3 YaRN, 1 shared expert, 4 groups / 2 picked, 1 dense layer
    "v3": dict(rope_parameters=V3_YARN),
    # V2-Lite style: no q_lora, plain RoPE, 2 shared experts, no groups, 2 dense layers
    "no_qlora": dict(
        q_lora_rank=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        n_routed_experts=8,
        num_experts_per_tok=3,
        first_k_dense_replace=2,
        num_hidden_layers=4,
    ),
    # YaRN with only a factor (cos/sin scaled by get_mscale(f)), biases, tied embeddings,
    # 8 groups / 3 picked over 32 experts, top-6
    "bias_tied": dict(
        q_lora_rank=24,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
        },
        attention_bias=True,
        tie_word_embeddings=True,
        n_routed_experts=32,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=3,
    ),
    # non-interleaved rope, V2-Lite's mscale 0.707, 2 shared, 2 groups / 1 picked, 2 dense layers
    "neox_rope": dict(
        rope_interleave=False,
        rope_parameters={**V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=2,
        num_hidden_layers=4,
    ),
}

PROMPT_LENGTHS = [5, 33, 64, 100]
NEW_TOKENS = 32


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(CONFIGS))
def oracle(request, tmp_path_factory):
    path = make_hf_checkpoint(
        tmp_path_factory.mktemp(request.param), seed=len(request.param), **CONFIGS[request.param]
    )
    hf = load_hf(path)
    prompts = _prompts(hf.config.vocab_size, seed=1)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return request.param, path, prompts, expected


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_tokens_and_logits_match_transformers(oracle, chunked):
    name, path, prompts, expected = oracle
    # chunked: a 40-token budget splits prompts into chunks mixed with other requests' decodes
    cfg = EngineConfig(model=str(path), max_num_batched_tokens=40 if chunked else 2048, max_num_seqs=8)
    engine = LocalEngine(cfg)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs, last_logits = generate_with_logits(engine, prompts, params)
    for i, (out, logits, (tokens, hf_logits)) in enumerate(zip(outs, last_logits, expected, strict=True)):
        assert out.token_ids == tokens, f"{name} prompt {i}: tokens differ from transformers"
        diff = (logits - hf_logits).abs().max().item()
        assert diff <= 1e-4, f"{name} prompt {i}: last-step logits differ by {diff}"
    assert engine.scheduler.num_free_blocks == engine.cache.num_blocks


def test_config_reads_transformers_v5_style(oracle):
    from services.model.config import ModelConfig

    name, path, _, _ = oracle
    cfg = ModelConfig.from_dir(path)
    expect = CONFIGS[name]
    assert cfg.q_lora_rank == expect.get("q_lora_rank", 32)
    assert cfg.n_shared_experts == expect.get("n_shared_experts", 1)
    assert cfg.first_k_dense_replace == expect.get("first_k_dense_replace", 1)
    assert (cfg.rope_scaling is not None) == (expect["rope_parameters"]["rope_type"] == "yarn")
    assert cfg.rope_interleave == expect.get("rope_interleave", True)
