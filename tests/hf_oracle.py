"""Reference checkpoints and outputs from Hugging Face transformers' DeepseekV3 (the oracle).

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


def make_hf_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name or name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                gain = 4.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
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
    from services.model.engine import Completion, StepFailed

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
