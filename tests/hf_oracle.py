"""Reference checkpoints and outputs from Hugging Face transformers' DeepseekV3, DeepseekV32 and
DeepseekV4 (the oracles).

Checkpoints are written by transformers' own `save_pretrained` (per-expert tensor names,
`rope_parameters`), with every weight, norm and router bias randomised so all code paths are
exercised and greedy choices are well separated.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=163840,
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
)

V3_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=40.0,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    original_max_position_embeddings=4096,
)


# DeepSeek-V3.2's lightning indexer on the BASE dims: 16 of the context tokens per query. 32 heads:
# a token scores exactly 0 (a tie) only when all 32 heads' relu(q.k) are 0, so the top-k is
# well defined (with few heads, zero ties straddle the top-k boundary and transformers' own
# prefill and decode break them differently).
V32_INDEXER = dict(index_n_heads=32, index_head_dim=16, index_topk=16)

# DeepSeek-V4 on tiny dims where every layer type shows within ~100 tokens: a sliding window of 8,
# CSA every 4 tokens with the indexer keeping 4 entries (32 heads, against ties), HCA every 16;
# hash-routed then top-k MoE layers; 4 hyper-connection streams; a SwiGLU clamp of 1.0 that
# bites; YaRN on the compress rope (as published: the sliding layers' rope stays plain).
V4_TINY = dict(
    vocab_size=320,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,  # 8 rope dims
    q_lora_rank=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],  # fmt: skip
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=32,
    index_head_dim=16,
    index_topk=4,
    hc_mult=4,
    swiglu_limit=1.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },  # fmt: skip
    max_position_embeddings=4096,
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
)


def make_hf_checkpoint(
    path: Path, seed: int = 0, model_type: str = "deepseek_v3", tokenizer: bool = False, **overrides
) -> Path:
    """A random checkpoint written by transformers. model_type "deepseek_v32" builds a
    DeepseekV32ForCausalLM (with V32_INDEXER unless overridden; eager attention, one KV head per
    query head as its eager path needs); "deepseek_v4" a DeepseekV4ForCausalLM on V4_TINY (every
    override replaces a V4_TINY key). tokenizer: also write our byte-level tokenizer and chat
    template (services.presets.write_tokenizer)."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV4Config,
        DeepseekV4ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
    )

    if model_type == "deepseek_v4":
        cfg, model_cls = DeepseekV4Config(**{**V4_TINY, **overrides}), DeepseekV4ForCausalLM
        cfg._attn_implementation = "eager"
    elif model_type == "deepseek_v32":
        cfg = DeepseekV32Config(**{**BASE, **V32_INDEXER, **overrides})
        cfg.num_key_value_heads = cfg.num_attention_heads
        cfg._attn_implementation = "eager"
        model_cls = DeepseekV32ForCausalLM
    elif model_type == "deepseek_v3":
        cfg, model_cls = DeepseekV3Config(**{**BASE, **overrides}), DeepseekV3ForCausalLM
    else:
        raise ValueError(f"no transformers oracle for model_type {model_type!r}")
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if "tid2eid" in name:  # V4 hash routing: K distinct experts per token id
                E = cfg.n_routed_experts
                p.copy_(
                    torch.stack([torch.randperm(E, generator=g)[: p.shape[1]] for _ in range(p.shape[0])])
                )
            elif name.endswith(("sinks", "position_bias")) or name.endswith(("hc.base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))  # V4 sinks, compressor gate bias, mHC
            elif "norm" in name or name.endswith(("hc.scale", "hc_scale")):  # (V4 mHC scales too)
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name or name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                gain = 4.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    if tokenizer:
        from services.presets import write_tokenizer

        write_tokenizer(path, cfg.vocab_size)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from HF generate, and HF's logits for the last generated position,
    recomputed by one full forward over prompt + generated[:-1]."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
    )
    tokens = out[0, len(prompt) :].tolist()
    full = torch.tensor([prompt + tokens[:-1]])
    logits = model(full).logits[0, -1].float()
    return tokens, logits


def run_requests(engine, prompts, params, retry_failed_steps=False):
    """What engine.generate does, step by step: the completions in input order, each request's
    logits at its final step, and the routed expert load [num_moe_layers, E] summed over steps.
    retry_failed_steps: a step that raises StepFailed is run again (as the attention worker does)."""
    from services.engine.outputs import Completion, StepFailed

    ids = [engine.add_request(p, params) for p in prompts]
    done = {rid: Completion(rid, list(p), [], "", "", []) for rid, p in zip(ids, prompts, strict=True)}
    last, load = {}, 0
    while engine.has_unfinished():
        try:
            result = engine.step()
        except StepFailed:
            if not retry_failed_steps:
                raise
            continue
        load = load + result.expert_load
        for rid, row in zip(result.logits_ids, result.logits, strict=True):
            last[rid] = row.clone()
        for out in result.outputs:
            done[out.request_id].add(out)
    return [done[rid] for rid in ids], [last[rid] for rid in ids], load


def generate_with_logits(engine, prompts, params):
    """engine.generate, also returning each request's logits at its final step."""
    outs, logits, _ = run_requests(engine, prompts, params)
    return outs, logits


def random_prompts(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given lengths with random ids (above BOS/EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def check_against_transformers(outs, logits, expected, what: str, atol: float = 1e-4) -> float:
    """Our completions and last-step logits vs transformers' (tokens, logits) per prompt: tokens
    identical, logits within `atol`; returns the worst logit difference."""
    worst = 0.0
    for i, (out, row, (tokens, hf_logits)) in enumerate(zip(outs, logits, expected, strict=True)):
        assert out.token_ids == tokens, f"{what} prompt {i}: tokens differ from transformers"
        worst = max(worst, (row - hf_logits).abs().max().item())
    assert worst <= atol, f"{what}: last-step logits differ by {worst}"
    return worst
