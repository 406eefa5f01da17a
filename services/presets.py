"""`moe-cluster init-model`: write a Hugging Face-format DeepSeek-V3 (V3.2, V4) checkpoint with
random weights.

Everything is randomised, biases and norm weights included (transformers initialises norms to 1
and the router bias to 0, which would leave those code paths untested). The checkpoint uses the
original per-expert tensor names, writes `scoring_func`/`topk_method` like DeepSeek's own
configs, and ships a byte-level `tokenizer.json`, so it loads in transformers and other engines.
DeepSeek-V4 (`tiny-v4`) is written under the names transformers' `save_pretrained` writes for
`DeepseekV4ForCausalLM` (DeepSeek's own: `attn.wq_a`, `ffn.experts.E.w1`, `hc_attn_fn`, ...).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.engine.tokenizer import DEFAULT_CHAT_TEMPLATE, MARKER_TOKENS
from services.model.config import ModelConfig
from services.model.fp8 import quantize_fp8_blocks

_YARN = {
    "type": "yarn",
    "factor": 40,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}

_COMMON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": _YARN,
    "max_position_embeddings": 163840,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
}

_TINY_V32 = {  # DeepSeek-V3.2 on the tiny dims: the lightning indexer keeps 16 tokens per query
    # (32 heads: exact zero-score ties, broken arbitrarily by top-k, are all but impossible)
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 16,
}

PRESETS: dict[str, dict] = {
    # seconds to load and run: unit, oracle and cluster tests
    "tiny": {
        **_COMMON,
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
    },
    # ~84M parameters, 8 MoE layers x 64 experts, top-6 of 8 groups: benchmarks
    "small": {
        **_COMMON,
        "vocab_size": 4096,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 9,
        "first_k_dense_replace": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
    },
}

# DeepSeek-V2-Lite's shape (~15.7B parameters, 26 MoE layers x 64 experts, top-6, 2 shared, MLA
# with kv_lora 512 and no q_lora): the GPU benchmarks' model. 31 GB in bf16: generate it on the
# GPU (`init_model(..., dtype="bfloat16", device="cuda")`), never in a CPU test.
PRESETS["medium"] = {
    **_COMMON,
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
}

PRESETS["tiny-v32"] = {**PRESETS["tiny"], **_TINY_V32}  # the V3.2 oracle and cluster tests

# DeepSeek-V4 on tiny dims where every layer type shows within ~100 tokens (tests/hf_oracle.py's
# V4_TINY on the tokenizer's vocabulary): a sliding window of 8, CSA every 4 tokens with the
# indexer keeping 4 entries (32 heads, against score ties), HCA every 16; 2 hash-routed then 3
# top-k MoE layers; 4 hyper-connection streams; a SwiGLU clamp of 1.0 that bites; YaRN on the
# compress rope. The keys are those transformers' DeepseekV4Config writes to config.json.
_V4_LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
PRESETS["tiny-v4"] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 384,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,  # V4's one shared K=V head
    "head_dim": 32,
    "partial_rotary_factor": 0.25,  # 8 rope dims (the last 8 of each head)
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "layer_types": _V4_LAYER_TYPES + _V4_LAYER_TYPES[1:],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 8,
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 1.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "attention_factor": 1.0,
            "partial_rotary_factor": 0.25,
        },
    },
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
}

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]


def random_weights(
    hf: dict, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Random tensors (CPU, `dtype`) under the original DeepSeek-V3 names for HF config dict `hf`
    (with the V3.2 indexer's `self_attn.indexer.*` when the config has `index_topk`;
    DeepSeek-V4's tensors, `random_weights_v4`, for `model_type: deepseek_v4`). They are drawn
    on `device` (a GPU draws the medium preset's 16B values in seconds) one layer at a time, in
    fp32, then cast: the same seed gives the same weights per device.

    Linear weights ~ N(0, 1/fan_in) so activations keep their scale through depth; the LM head
    is scaled so logits spread over a few units (well separated greedy choices). With
    `num_nextn_predict_layers` the MTP modules follow the main layers (drawn after them: the main
    model's weights do not change), in the Hugging Face layout (`_mtp_weights`).
    """
    if hf.get("model_type") == "deepseek_v4":
        return random_weights_v4(hf, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    randn = functools.partial(_randn, g)
    linear, norm = _initialisers(g)
    done: set[str] = set()

    def keep(w: dict) -> None:  # (this layer's tensors to the CPU in `dtype`, as they are made)
        for name in w.keys() - done:
            w[name] = w[name].to(dtype).cpu()
            done.add(name)

    H, N = hf["hidden_size"], hf["num_attention_heads"]
    D, R, V = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    C, Q = hf["kv_lora_rank"], hf.get("q_lora_rank")
    E, I_moe = hf["n_routed_experts"], hf["moe_intermediate_size"]
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": randn(hf["vocab_size"], H),
        "model.norm.weight": norm(H),
        "lm_head.weight": linear(hf["vocab_size"], H, gain=4.0),
    }
    for i in range(hf["num_hidden_layers"] + (hf.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{i}."
        if i >= hf["num_hidden_layers"]:  # an MTP module: its own tensors, then a decoder layer
            _mtp_weights(w, p, H, linear, norm)
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        if Q:
            w[a + "q_a_proj.weight"] = linear(Q, H)
            w[a + "q_a_layernorm.weight"] = norm(Q)
            w[a + "q_b_proj.weight"] = linear(N * (D + R), Q)
        else:
            w[a + "q_proj.weight"] = linear(N * (D + R), H)
        w[a + "kv_a_proj_with_mqa.weight"] = linear(C + R, H)
        w[a + "kv_a_layernorm.weight"] = norm(C)
        w[a + "kv_b_proj.weight"] = linear(N * (D + V), C)
        w[a + "o_proj.weight"] = linear(H, N * V)
        if hf.get("index_topk"):  # DeepSeek-V3.2's lightning indexer
            x, Hi, Di = a + "indexer.", hf["index_n_heads"], hf["index_head_dim"]
            w[x + "wq_b.weight"] = linear(Hi * Di, Q)
            w[x + "wk.weight"] = linear(Di, H)
            w[x + "k_norm.weight"] = norm(Di)
            w[x + "k_norm.bias"] = 0.1 * randn(Di)
            w[x + "weights_proj.weight"] = linear(Hi, H)
        if hf.get("attention_bias"):
            if Q:
                w[a + "q_a_proj.bias"] = 0.1 * randn(Q)
            w[a + "kv_a_proj_with_mqa.bias"] = 0.1 * randn(C + R)
            w[a + "o_proj.bias"] = 0.1 * randn(H)
        if i < hf["first_k_dense_replace"]:
            inter = hf["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = linear(inter, H)
            w[p + "mlp.up_proj.weight"] = linear(inter, H)
            w[p + "mlp.down_proj.weight"] = linear(H, inter)
            keep(w)
            continue
        w[p + "mlp.gate.weight"] = linear(E, H)
        w[p + "mlp.gate.e_score_correction_bias"] = 0.1 * randn(E)
        for e in range(E):
            x = f"{p}mlp.experts.{e}."
            w[x + "gate_proj.weight"] = linear(I_moe, H)
            w[x + "up_proj.weight"] = linear(I_moe, H)
            w[x + "down_proj.weight"] = linear(H, I_moe)
        if hf.get("n_shared_experts"):
            inter = I_moe * hf["n_shared_experts"]
            w[p + "mlp.shared_experts.gate_proj.weight"] = linear(inter, H)
            w[p + "mlp.shared_experts.up_proj.weight"] = linear(inter, H)
            w[p + "mlp.shared_experts.down_proj.weight"] = linear(H, inter)
        keep(w)
    keep(w)
    return w


def _mtp_weights(w: dict, p: str, H: int, linear, norm) -> None:
    """An MTP module's own tensors under prefix `p` (model.layers.{num_hidden_layers + j}.) as
    DeepSeek-V3 ships them: enorm, hnorm, eh_proj [H, 2H], shared_head.norm, and copies of the
    main model's embedding and LM head (DeepSeek shares them; other engines read the copies)."""
    w[p + "enorm.weight"] = norm(H)
    w[p + "hnorm.weight"] = norm(H)
    w[p + "eh_proj.weight"] = linear(H, 2 * H)
    w[p + "shared_head.norm.weight"] = norm(H)
    w[p + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=g.device)


def _initialisers(g: torch.Generator):
    """(linear(out, in, gain) ~ N(0, gain^2 / in), norm(n) ~ 1 + 0.2 N(0, 1)) drawing from `g`
    (on its device)."""

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return _randn(g, out_f, in_f) * (gain / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * _randn(g, n)

    return linear, norm


def random_weights_v4(hf: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors of a DeepSeek-V4 checkpoint (`model_type: deepseek_v4`), under the
    names transformers' `save_pretrained` writes and both it and deepseek_v4.py read, with
    tests/hf_oracle.py's scales: linears (and the mHC `*_fn`) N(0, 1/fan_in), the LM head x4,
    norms and mHC scales 1 + 0.2 N, attention sinks, mHC bases and the compressors' gate bias
    (`ape`) 0.5 N, router bias 0.1 N, and per token id `num_experts_per_tok` distinct experts
    (`tid2eid`) in the hash-routed layers. With `num_nextn_predict_layers` the MTP modules
    (DeepSeek's MTPBlock: `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`, `hc_head_{fn,base,scale}`
    and a sliding-window V4 block with routed experts) follow as `model.layers.{n + j}.*`."""
    cfg = ModelConfig.from_hf(hf)
    g = torch.Generator().manual_seed(seed)
    linear, norm = _initialisers(g)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return std * torch.randn(*shape, generator=g)

    H, N, D, Q, M = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    E, K, I, V = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.vocab_size
    G, O = cfg.o_groups, cfg.o_lora_rank
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g),
        "model.norm.weight": norm(H),
        "head.weight": linear(V, H, gain=4.0),
        "model.hc_head.hc_fn": linear(M, M * H),
        "model.hc_head.hc_base": normal(M, std=0.5),
        "model.hc_head.hc_scale": norm(1),
    }

    def compressor(prefix: str, ratio: int, dim: int, overlap: bool) -> None:
        width = (2 if overlap else 1) * dim  # CSA: two overlapping series
        w[prefix + "wkv.weight"] = linear(width, H)
        w[prefix + "wgate.weight"] = linear(width, H)
        w[prefix + "ape"] = normal(ratio, width, std=0.5)
        w[prefix + "norm.weight"] = norm(dim)

    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{i}."
        a = p + "attn."
        if i >= cfg.num_hidden_layers:  # an MTP module (DeepSeek's MTPBlock): its own tensors, then a block
            for name in ("e_proj", "h_proj"):
                w[f"{p}{name}.weight"] = linear(H, H)
            for name in ("enorm", "hnorm", "norm"):
                w[f"{p}{name}.weight"] = norm(H)
            w[p + "hc_head_fn"] = linear(M, M * H)
            w[p + "hc_head_base"] = normal(M, std=0.5)
            w[p + "hc_head_scale"] = norm(1)
        w[p + "attn_norm.weight"] = norm(H)
        w[p + "ffn_norm.weight"] = norm(H)
        for hc in ("hc_attn", "hc_ffn"):  # pre (M), post (M) and comb (M x M) mixes
            w[f"{p}{hc}_fn"] = linear((2 + M) * M, M * H)
            w[f"{p}{hc}_base"] = normal((2 + M) * M, std=0.5)
            w[f"{p}{hc}_scale"] = norm(3)
        w[a + "wq_a.weight"] = linear(Q, H)
        w[a + "q_norm.weight"] = norm(Q)
        w[a + "wq_b.weight"] = linear(N * D, Q)
        w[a + "wkv.weight"] = linear(D, H)
        w[a + "norm.weight"] = norm(D)
        w[a + "wo_a.weight"] = linear(G * O, N * D // G)
        w[a + "wo_b.weight"] = linear(H, G * O)
        w[a + "attn_sink"] = normal(N, std=0.5)
        kind = cfg.attention_type(i)
        if kind != "sliding_attention":
            csa = kind == "compressed_sparse_attention"
            compressor(a + "compressor.", cfg.compress_ratio(i), D, overlap=csa)
            if csa:  # the lightning indexer, with its own compressor at Di
                w[a + "indexer.wq_b.weight"] = linear(Hi * Di, Q)
                w[a + "indexer.weights_proj.weight"] = linear(Hi, H)
                compressor(a + "indexer.compressor.", cfg.compress_ratio_csa, Di, overlap=True)
        f = p + "ffn."
        w[f + "gate.weight"] = linear(E, H)
        if cfg.is_hash_layer(i):
            w[f + "gate.tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)])
        else:
            w[f + "gate.bias"] = normal(E, std=0.1)
        for e in range(E):
            x = f"{f}experts.{e}."
            w[x + "w1.weight"] = linear(I, H)
            w[x + "w3.weight"] = linear(I, H)
            w[x + "w2.weight"] = linear(H, I)
        inter = I * cfg.n_shared_experts
        w[f + "shared_experts.w1.weight"] = linear(inter, H)
        w[f + "shared_experts.w3.weight"] = linear(inter, H)
        w[f + "shared_experts.w2.weight"] = linear(H, inter)
    return w


# not FP8: embeddings, LM heads (V3 `lm_head`, V4 `head`), norms, routers (V3 `mlp.gate.`, V4 `ffn.gate.`)
# nor the MTP module's eh_proj (BF16 in DeepSeek-V3's checkpoint)
FP8_SKIP = ("embed_tokens", "head.weight", "layernorm", "norm.weight", "mlp.gate.", "ffn.gate.", "eh_proj")


def quantize_checkpoint_fp8(
    weights: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)
) -> dict[str, torch.Tensor]:
    """FP8 e4m3 block-quantise every linear weight as DeepSeek does (not embeddings, LM head,
    norms or the router), adding `<name>_scale_inv` tensors."""
    out = {}
    for name, t in weights.items():
        if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in FP8_SKIP):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t, block)
        else:
            out[name] = t
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level tokenizer: ids 0-3 special, then 256 byte tokens, DeepSeek's reasoning and
    tool-call markers (ordinary tokens, as in DeepSeek's vocabulary), then reserved specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    if vocab_size < len(SPECIAL_TOKENS) + 256 + len(MARKER_TOKENS):
        raise ValueError("vocab_size too small for a byte-level tokenizer")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(ByteLevel.alphabet(), key=lambda c: ord(c)):
        vocab[ch] = len(vocab)
    for t in MARKER_TOKENS:
        vocab[t] = len(vocab)
    reserved = [f"<｜reserved_{i}｜>" for i in range(vocab_size - len(vocab))]
    for t in reserved:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS + reserved)
    tok.add_tokens(MARKER_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[0],
                "eos_token": SPECIAL_TOKENS[1],
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 163840,
                "chat_template": DEFAULT_CHAT_TEMPLATE,  # DeepSeek-V3's turn markers: other engines can chat
            },
            indent=2,
        )
    )


def save_safetensors(weights: dict[str, torch.Tensor], out: Path, shards: int = 1) -> None:
    """One model.safetensors, or `shards` files plus model.safetensors.index.json."""
    if shards <= 1:
        save_file(
            {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), {"format": "pt"}
        )
        return
    names = list(weights)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: weights[k].contiguous() for k in part}, str(out / fname), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())}}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({**index, "weight_map": weight_map}, indent=2)
    )


def init_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    fp8: bool = False,
    overrides: dict | None = None,
    tokenizer: bool = True,
    shards: int = 1,
    fp8_block: tuple[int, int] = (128, 128),
    dtype: str = "float32",
    device: str = "cpu",
    mtp: bool = False,
) -> Path:
    """Write config.json, safetensors (per-expert names; `shards` > 1 writes
    model-0000i-of-0000n.safetensors + model.safetensors.index.json) and a tokenizer. fp8: the
    linear weights block-quantised to FP8 e4m3 as DeepSeek ships them, in `fp8_block` blocks.
    `dtype`: of the tensors written ("bfloat16" halves a large preset); `device`: where they are
    drawn ("cuda" for the medium preset). mtp: with one multi-token-prediction module
    (`num_nextn_predict_layers: 1`, `model.layers.{num_hidden_layers}.*`; the drafter of
    speculative decoding), its weights random like the rest."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = {**PRESETS[preset], **({"num_nextn_predict_layers": 1} if mtp else {}), **(overrides or {}),
          "torch_dtype": dtype}  # fmt: skip
    if hf.get("model_type") == "deepseek_v4" and (dtype, device) != ("float32", "cpu"):
        raise ValueError("V4 presets are drawn in float32 on the CPU")
    weights = random_weights(hf, seed, getattr(torch, dtype), device)
    if fp8:
        weights = quantize_checkpoint_fp8(weights, fp8_block)
        hf["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
        }
        hf["torch_dtype"] = "bfloat16"
    save_safetensors(weights, out, shards)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}, indent=2)
    )
    if tokenizer:
        write_tokenizer(out, hf["vocab_size"])
    return out


def cache_root() -> Path:
    """This user's moe-cluster cache: $MOE_CLUSTER_CACHE, default ~/.cache/moe-cluster."""
    return Path(os.environ.get("MOE_CLUSTER_CACHE", Path.home() / ".cache" / "moe-cluster"))


def default_model_dir(preset: str = "tiny") -> Path:
    """The generated preset checkpoint in the user cache ($MOE_CLUSTER_CACHE, default
    ~/.cache/moe-cluster), written on first use."""
    path = cache_root() / f"preset-{preset}"
    if not (path / "config.json").is_file():
        print(f"generating the {preset!r} preset checkpoint in {path} ...", file=sys.stderr)
        init_model(path, preset)
    return path
