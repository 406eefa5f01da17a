"""DeepSeek-V3.2 (`model_type: deepseek_v32`): the lightning indexer and top-k sparse MLA against
transformers' DeepseekV32ForCausalLM (fp32, eager), with prompts longer than index_topk so the
indexer drops tokens; whole and chunked prefill, a prefix-cache hit, tensor-parallel head
slices; and configs this engine cannot run refused by name."""

import dataclasses
import json
import shutil

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig
from services.presets import init_model

from .hf_oracle import (
    V3_YARN,
    V32_INDEXER,
    check_against_transformers,
    generate_with_logits,
    hf_greedy,
    load_hf,
    make_hf_checkpoint,
    random_prompts,
)

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [5, 40, 70, 100]  # 5: below index_topk (16) until it has generated 12 tokens


def _prompts(vocab: int, seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return random_prompts(vocab, seed, lengths)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A checkpoint written by transformers' DeepseekV32ForCausalLM, its greedy tokens and logits."""
    path = make_hf_checkpoint(
        tmp_path_factory.mktemp("v32"), seed=3, model_type="deepseek_v32", rope_parameters=V3_YARN
    )
    hf = load_hf(path)
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    prompts = _prompts(hf.config.vocab_size, seed=1)
    return path, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


_check = check_against_transformers


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_tokens_and_logits_match_transformers(oracle, chunked):
    path, _, prompts, expected = oracle
    # chunked: 24-token chunks, so a chunk's queries pick their top-k from the cached context
    engine = LocalEngine(
        EngineConfig(model=str(path), max_num_batched_tokens=24 if chunked else 2048, max_num_seqs=8)
    )
    assert engine.cache.kv.shape[-1] == 32 + 8 + V32_INDEXER["index_head_dim"]  # [c_kv | k_pe | k_idx]
    outs, logits = generate_with_logits(engine, prompts, GREEDY)
    _check(outs, logits, expected, "chunked" if chunked else "whole")
    assert engine.scheduler.num_free_blocks == engine.cache.num_blocks


def test_the_indexer_changes_the_tokens(oracle, tmp_path):
    """The oracle test is not vacuous: the same checkpoint run as dense MLA (index_topk larger
    than any context) gives other tokens."""
    path, _, prompts, expected = oracle
    dense = shutil.copytree(path, tmp_path / "dense")
    hf_cfg = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**hf_cfg, "index_topk": 10**6}))
    outs = LocalEngine(EngineConfig(model=str(dense))).generate(prompts, GREEDY)
    assert sum(o.token_ids != tokens for o, (tokens, _) in zip(outs, expected, strict=True)) >= 3


def test_prefix_cache_hit_keeps_the_indexer_keys(oracle):
    """A prompt whose first 64-token block is served from the prefix cache (latent and indexer
    keys written by an earlier request) still matches transformers."""
    path, hf, prompts, _ = oracle
    first = prompts[3]  # 100 tokens: its first block is cached when it finishes
    second = first[:80] + _prompts(hf.config.vocab_size, seed=9, lengths=[20])[0]
    engine = LocalEngine(EngineConfig(model=str(path), max_num_batched_tokens=32, max_num_seqs=8))
    engine.generate([first], GREEDY)
    outs, logits = generate_with_logits(engine, [second], GREEDY)
    _check(outs, logits, [hf_greedy(hf, second, NEW_TOKENS)], "prefix-cached")
    assert engine.scheduler.prefix_hit_tokens == 64


def test_tensor_parallel_head_slices_sum_to_the_whole(oracle):
    """shard_heads keeps the (replicated) indexer: two ranks' partial attention outputs sum to
    the unsharded one, and both ranks write the same cache rows (latent and indexer key)."""
    from services.model.batch import StepBatch
    from services.model.checkpoint import CheckpointReader
    from services.model.kv_cache import BLOCK_SIZE
    from services.model.layers import Rope
    from services.model.model import DeepseekV3, mla_forward
    from services.model.weights import shard_heads

    path = oracle[0]
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3.load(CheckpointReader.for_config(path, cfg), cfg)
    w, rope, k = model.layers[1].attn, Rope(cfg), model.kernels
    x = torch.randn(90, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pre = StepBatch.build([(list(range(80)), 0, [2, 0], False)])
    dec = StepBatch.build([(list(range(10)), 80, [2, 0], False)])  # a 10-token chunk over 80 cached

    def run(weights):
        cache = torch.zeros(3, BLOCK_SIZE, 1, cfg.cache_dim)
        outs = [
            mla_forward(xs, weights, cfg, k, rope.cos_sin(b.positions, torch.float32), cache, b)
            for xs, b in ((x[:80], pre), (x[80:], dec))
        ]
        return torch.cat(outs), cache

    whole, cache = run(w)
    ranks = [run(shard_heads(w, cfg, r, 2)) for r in range(2)]
    torch.testing.assert_close(ranks[0][0] + ranks[1][0], whole, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(c, cache) for _, c in ranks)


def test_tiny_v32_preset_matches_transformers(tmp_path):
    """`moe-cluster init-model --preset tiny-v32` writes a V3.2 checkpoint transformers loads
    (indexer weights included) and agrees with."""
    path = init_model(tmp_path / "tiny-v32", "tiny-v32", seed=0)
    cfg = ModelConfig.from_dir(path)
    assert cfg.model_type == "deepseek_v32" and cfg.index_topk == 16 and cfg.cache_dim == 32 + 8 + 16
    hf = load_hf(path)
    prompts = _prompts(cfg.vocab_size, seed=2, lengths=[30, 75])
    outs, logits = generate_with_logits(LocalEngine(EngineConfig(model=str(path))), prompts, GREEDY)
    _check(outs, logits, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts], "tiny-v32 preset")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2-Exp's own config.json (model dims as published; the keys that matter here)
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
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
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },  # fmt: skip
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}


def test_v32_config_fields_and_cache_row():
    cfg = ModelConfig.from_hf(DEEPSEEK_V32)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert cfg.has_indexer and cfg.latent_dim == 576 and cfg.cache_dim == 576 + 128
    assert cfg.scoring_func == "sigmoid" and cfg.moe_layers == list(range(3, 61))
    v3 = ModelConfig.from_hf({**DEEPSEEK_V32, "model_type": "deepseek_v3", "index_n_heads": None,
                              "index_head_dim": None, "index_topk": None})  # fmt: skip
    assert not v3.has_indexer and v3.cache_dim == 576
    hf_style = {**DEEPSEEK_V32, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 58,
                "layer_types": ["indexed_attention"] * 61}  # fmt: skip
    assert ModelConfig.from_hf(hf_style) == cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "deepseek_v5"}, "model_type 'deepseek_v5' is not supported"),
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"model_type": "deepseek_v3"}, "index_n_heads is a DeepSeek-V3.2 indexer option"),
        ({"index_topk": None}, "index_topk"),
        ({"index_head_dim": 32}, "index_head_dim"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"sliding_window": 128}, "sliding_window"),
        ({"hc_mult": 4}, "hc_mult"),
        ({"swiglu_limit": 10.0}, "swiglu_limit"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"topk_method": "sinkhorn"}, "topk_method"),
        ({"layer_types": ["sliding_attention"] * 61}, "layer_types"),
        ({"mlp_layer_types": ["sparse"] * 61}, "mlp_layer_types"),
    ],
)
def test_configs_this_engine_cannot_run_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**DEEPSEEK_V32, **change})


def test_neutral_values_of_foreign_options_are_accepted():
    cfg = ModelConfig.from_hf({**DEEPSEEK_V32, "sliding_window": None, "hc_mult": 1, "mlp_bias": False})
    assert dataclasses.replace(cfg) == ModelConfig.from_hf(DEEPSEEK_V32)


# ---------------------------------------------------------------------------------------------
# Over the API: router -> attention worker -> gRPC expert workers
# ---------------------------------------------------------------------------------------------
@pytest.mark.cluster
def test_cluster_api_serves_v32_like_the_local_engine(tmp_path):
    import openai

    from .clusters import tiny_cluster

    path = init_model(tmp_path / "tiny-v32", "tiny-v32", seed=1)
    prompts = _prompts(384, seed=4, lengths=[40, 90])
    want = LocalEngine(EngineConfig(model=str(path))).generate(prompts, GREEDY)
    with tiny_cluster(path, expert_workers=2, max_num_seqs=8, max_num_batched_tokens=32,
                      balancer_period_s=0) as cluster:  # fmt: skip
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        got = [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]
    assert got == [w.token_ids for w in want]


@pytest.mark.parametrize("Hi", [6, 32, 64])  # (a multiple of 8: the heads across the vector lanes)
def test_fused_index_scores_equal_the_torch_math(Hi):
    """The C++ index_scores (the indexer's scores in one call) against the torch math, for a
    shared prefill context and per-query decode contexts, with prefix visibility."""
    import torch.nn.functional as F

    from services.model.kernels import cpu_kernels, torch_ops

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    index_scores = cpu_kernels.CppKernels(cpu_kernels._module(), None).index_scores
    g = torch.Generator().manual_seed(0)
    Q, Di, L = 5, 16, 200
    q, w = torch.randn(Q, Hi, Di, generator=g), torch.randn(Q, Hi, generator=g)
    lens = torch.tensor([1, 64, 65, 150, 200])
    visible = torch.arange(L)[None, :] < lens[:, None]
    for keys in (torch.randn(L, Di, generator=g), torch.randn(Q, L, Di, generator=g)):
        dots = (
            torch.einsum("qhd,ld->qhl", q, keys) if keys.dim() == 2 else torch.einsum("qhd,qld->qhl", q, keys)
        )
        want = torch.einsum("qh,qhl->ql", w, F.relu(dots * Di**-0.5)).masked_fill(~visible, float("-inf"))
        torch.testing.assert_close(index_scores(q, w, keys, lens), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch_ops.index_scores(q, w, keys, lens), want)
