"""DeepSeek-V4 (`model_type: deepseek_v4`) against transformers' DeepseekV4ForCausalLM (fp32,
eager) on a tiny checkpoint where every layer type shows: sliding window 8, CSA every 4 tokens
with the indexer keeping 4 entries, HCA every 24 tokens (a window that straddles a 64-token
cache block), hash-routed and top-k MoE layers, 4 mHC streams, a SwiGLU clamp that bites.
Prompts cross the window, the compression ratios and index_topk; whole and chunked prefill, a
prefix-cache hit, the expert worker's store, and configs (published / DeepSeek's own key names)."""

import json
import re
import shutil

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig, rope_inv_freq
from services.presets import init_model

from .hf_oracle import (
    check_against_transformers,
    generate_with_logits,
    hf_greedy,
    load_hf,
    make_hf_checkpoint,
    random_prompts,
    run_requests,
)

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [3, 23, 50, 97]  # 3: inside the window, no compressed entry before decoding
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 24}


def _engine(path, **settings) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(path), max_num_seqs=8, max_model_len=512, **settings))


def _prompts(vocab: int, seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return random_prompts(vocab, seed, lengths)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A checkpoint written by transformers' DeepseekV4ForCausalLM, its greedy tokens and logits."""
    path = make_hf_checkpoint(
        tmp_path_factory.mktemp("v4"), seed=3, model_type="deepseek_v4", compress_rates=RATES, tokenizer=True
    )
    hf = load_hf(path)
    assert type(hf).__name__ == "DeepseekV4ForCausalLM"
    prompts = _prompts(hf.config.vocab_size, seed=1)
    return path, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


_check = check_against_transformers


@pytest.mark.parametrize("chunk", [2048, 13], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_tokens_and_logits_match_transformers(oracle, chunk):
    """A batch of four prompts; 13-token chunks end mid-window, so entries are completed from
    compressor states cached by an earlier step."""
    path, _, prompts, expected = oracle
    engine = _engine(path, max_num_batched_tokens=chunk)
    cfg = engine.cfg
    assert cfg.is_v4 and type(engine.model).__name__ == "DeepseekV4"
    state_dims = [state.data.shape[-1] for state, _ in engine.cache.kv]
    assert state_dims[:3] == [32, 32 * 5 + 16 * 4, 32 * 3]  # sliding, CSA, HCA: D = 32, Di = 16
    outs, logits = generate_with_logits(engine, prompts, GREEDY)
    _check(outs, logits, expected, f"chunk {chunk}")
    assert engine.scheduler.num_free_blocks == engine.cache.num_blocks


@pytest.mark.parametrize("chunk", [2048, 13], ids=["whole-prefill", "chunked-prefill"])
def test_prefill_in_tiles_matches_transformers(oracle, monkeypatch, chunk):
    """Prefill attends a tile of queries at a time (v4_attention.PREFILL_QUERIES), each tile to its
    band of window rows and its entries (CSA: each query's top-k, scored and gathered per tile):
    tiles of 5 (less than the window of 8), of whole prompts or of 13-token chunks (tiles
    starting mid-sequence, a last tile of 3), give transformers' tokens and logits too."""
    from services.model import v4_attention

    monkeypatch.setattr(v4_attention, "PREFILL_QUERIES", 5)
    widths = []  # keys each softmax sees: at most a tile's band (5 + 8 - 1) and 4 entries
    for name in ("_attend", "_attend_picked"):
        attend = getattr(v4_attention, name)
        monkeypatch.setattr(
            v4_attention, name, lambda q, keys, *a, f=attend: widths.append(keys.shape[-2]) or f(q, keys, *a)
        )
    path, _, prompts, expected = oracle
    outs, logits = generate_with_logits(_engine(path, max_num_batched_tokens=chunk), prompts, GREEDY)
    _check(outs, logits, expected, f"prefill in tiles of 5, chunks of {chunk}")
    assert max(widths) <= 12 + 4 and max(map(len, prompts)) == 97


@pytest.mark.parametrize(
    "change",
    [
        {"index_topk": 10**6},  # CSA attends to every entry
        {"compress_rates": {**RATES, "heavily_compressed_attention": 10**6}},  # no HCA entries
        {"sliding_window": 10**6},
        {"swiglu_limit": None},
    ],
    ids=["indexer", "hca", "window", "swiglu-clamp"],
)
def test_each_v4_feature_changes_the_tokens(oracle, tmp_path, change):
    """The oracle test is not vacuous: the same weights without one of V4's mechanisms give
    other tokens."""
    path, _, prompts, expected = oracle
    other = shutil.copytree(path, tmp_path / "other")
    hf_cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf_cfg, **change}))
    outs = _engine(other).generate(prompts, GREEDY)
    assert sum(o.token_ids != tokens for o, (tokens, _) in zip(outs, expected, strict=True)) >= 2


def test_prefix_cache_hit_keeps_compressor_state(oracle):
    """A prompt whose first 64-token block comes from the prefix cache still matches: the HCA
    window [48, 72) is completed from 16 cached compressor states and 8 new ones."""
    path, hf, prompts, _ = oracle
    first = prompts[3]
    second = first[:80] + _prompts(hf.config.vocab_size, seed=9, lengths=[20])[0]
    engine = _engine(path, max_num_batched_tokens=32)
    engine.generate([first], GREEDY)
    outs, logits = generate_with_logits(engine, [second], GREEDY)
    _check(outs, logits, [hf_greedy(hf, second, NEW_TOKENS)], "prefix-cached")
    assert engine.scheduler.prefix_hit_tokens == 64


def test_few_state_blocks_serve_long_prompts(oracle):
    """Window state is kept for each sequence's last tokens only: with 3 state blocks (one
    sequence needs 2) six sequences of up to 300 tokens in 64-token chunks take, release and
    rewrite state blocks, wait for them and are preempted, and every token still matches."""
    path, hf, _, _ = oracle
    prompts = _prompts(hf.config.vocab_size, seed=5, lengths=[300, 190, 130, 60, 61, 62])
    engine = _engine(path, max_num_batched_tokens=64, num_state_blocks=3)
    assert engine.cache.num_state_blocks == 3 and engine.cache.num_blocks == 8 * 8
    outs, logits = generate_with_logits(engine, prompts, GREEDY)
    _check(outs, logits, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts], "3 state blocks")
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert (stats["state_blocks_total"], stats["state_blocks_used"], stats["kv_blocks_used"]) == (3, 0, 0)


def _poison_unheld(engine, value: float) -> None:
    """Before every step fill each state block no sequence holds and each block nobody references
    with `value`, and restore them after: nothing a step may not read reaches its outputs."""
    forward, alloc = engine.model.forward, engine.scheduler.allocator

    def poisoned(batch, kv):
        held = {alloc.state(b) for b in alloc._state_refs}
        states = [i for i in range(engine.cache.num_state_blocks) if i not in held]
        blocks = [b for b in range(engine.cache.num_blocks) if alloc.refs(b) == 0]
        tensors = [(state.data, None if ent is None else ent.data) for state, ent in kv]
        saved = [
            (state[states].clone(), None if ent is None else ent[blocks].clone()) for state, ent in tensors
        ]
        for state, ent in tensors:
            state[states] = value
            if ent is not None:
                ent[blocks] = value
        out = yield from forward(batch, kv)
        for (state, ent), (old_state, old_ent) in zip(tensors, saved, strict=True):
            state[states] = old_state
            if ent is not None:
                ent[blocks] = old_ent
        return out

    engine.model.forward = poisoned


@pytest.mark.parametrize(
    "value, cache",
    [(1e3, "auto"), (float("nan"), "auto"), (0xFF, "fp8")],
    ids=["garbage", "nan", "fp8-nan-bytes"],
)
def test_unheld_cache_rows_never_reach_the_outputs(oracle, value, cache):
    """Freed and released cache rows are poisoned before every step (NaN too: a masked padding
    row times NaN would be NaN; in FP8 blocks 0xFF bytes: e4m3 and bf16 NaN, a 2^128 scale): tokens
    still match (transformers', or the unpoisoned FP8 cache's). Decode rows of very different
    lengths (1,216 vs 80 tokens) attend in separate padded groups."""
    path, hf, _, _ = oracle
    prompts = _prompts(hf.config.vocab_size, seed=11, lengths=[1200, 300, 170, 64, 65, 3])

    def engine():
        return LocalEngine(EngineConfig(model=str(path), max_num_seqs=8, max_model_len=2048, max_num_batched_tokens=64,
                                        num_state_blocks=3, kv_cache_dtype=cache))  # fmt: skip

    if cache == "fp8":
        clean, clean_logits = generate_with_logits(engine(), prompts, GREEDY)
        expected = [(o.token_ids, row) for o, row in zip(clean, clean_logits, strict=True)]
    else:
        expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    poisoned = engine()
    _poison_unheld(poisoned, value)
    outs, logits = generate_with_logits(poisoned, prompts, GREEDY)
    _check(outs, logits, expected, f"poisoned with {value}", atol=0.0 if cache == "fp8" else 1e-4)


def test_fp8_cache_follows_the_full_cache(oracle):
    """DeepSeek-V4 on FP8 rows (window rows and compressed entries in MODEL1, the indexer's
    entries as FP8 keys, compressor inputs as they are): the first tokens are the full cache's and
    the top-1 agrees at most positions teacher-forced along the full cache's output (89 % measured:
    71 / 80), prompts past the indexer's top-k and HCA's ratio; the first layer's window rows hold
    the full cache's within each format's rounding; the cache is smaller and status says FP8."""
    from .test_fp8_cache import top1_agreement

    path, hf, _, _ = oracle
    prompts = _prompts(hf.config.vocab_size, seed=1, lengths=[3, 23, 50, 97, 300])
    full, fp8 = _engine(path, prefix_caching=False), _engine(path, prefix_caching=False, kv_cache_dtype="fp8")
    assert fp8.cache.nbytes < full.cache.nbytes and fp8.stats()["kv_cache_dtype"] == "fp8"
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = full.generate(prompts, greedy)
    assert [o.token_ids[:3] for o in outs] == [o.token_ids[:3] for o in fp8.generate(prompts, greedy)]
    agree, total = top1_agreement(full, fp8, prompts, outs)
    assert agree >= 0.75 * total, agree / total
    # layer 0's window rows (sliding: before any FP8 difference upstream) hold the full cache's
    # kv within each format's rounding (e4m3 on 24 no-rope dims, bf16 on 8 rope dims)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # (rows of the prompt only)
    full, fp8 = _engine(path, prefix_caching=False), _engine(path, prefix_caching=False, kv_cache_dtype="fp8")
    full.generate(prompts[-1:], one), fp8.generate(prompts[-1:], one)
    ref, rows = full.cache.kv[0][0], fp8.cache.kv[0][0]
    used = torch.nonzero(ref.flat.abs().sum(-1) > 0)[:, 0]
    assert len(used) >= 64

    def rel(cols):
        got, want = rows.read(used, cols), ref.flat[used, cols]
        return ((got - want).norm() / want.norm()).item()

    assert rel(slice(0, 24)) < 0.04 and rel(slice(24, 32)) < 0.005


def test_fp8_cache_under_chunks_prefix_hits_and_preemption(oracle):
    """The FP8 cache under chunked prefill (entries completed from compressor inputs an earlier
    chunk cached), a prefix hit on FP8 blocks and preemption (3 state blocks): the same tokens as
    one unchunked pass over it."""
    path, hf, prompts, _ = oracle
    second = prompts[3][:80] + _prompts(hf.config.vocab_size, seed=9, lengths=[20])[0]
    todo = [prompts[3], second, *_prompts(hf.config.vocab_size, seed=5, lengths=[300, 190, 130])]
    want = [
        o.token_ids for o in _engine(path, kv_cache_dtype="fp8", prefix_caching=False).generate(todo, GREEDY)
    ]
    engine = _engine(path, kv_cache_dtype="fp8", max_num_batched_tokens=32)
    got = [engine.generate([p], GREEDY)[0].token_ids for p in todo[:2]]
    assert engine.scheduler.prefix_hit_tokens == 64
    tight = _engine(path, kv_cache_dtype="fp8", max_num_batched_tokens=64, num_state_blocks=3)
    got += [o.token_ids for o in tight.generate(todo[2:], GREEDY)]
    assert tight.stats()["preemptions"] > 0
    assert got == want


def test_decode_groups_bound_the_padding():
    from services.model.batch import DecodeRows
    from services.model.v4_attention import _decode_groups

    lens = torch.tensor([40, 6000, 2000, 1500, 30, 900])
    d = DecodeRows(torch.arange(6) * 3, torch.arange(6), torch.zeros(6, 80, dtype=torch.long), lens)
    groups = _decode_groups(d)
    assert [g.lens.tolist() for g in groups] == [[6000], [2000, 1500, 900], [40, 30]]
    assert [g.seqs.tolist() for g in groups] == [[1], [2, 3, 5], [0, 4]]
    assert torch.equal(groups[1].rows, torch.tensor([6, 9, 15]))
    d.lens = torch.tensor([100, 1000, 3])
    assert _decode_groups(d) == [d]  # within 2x + 1,024 tokens: one batch


def test_v4_cache_too_small_for_one_sequence_is_a_clear_error(oracle):
    path = oracle[0]
    with pytest.raises(ValueError, match="DeepSeek-V4 cache.*raise kv_cache_gib"):
        _engine(path, kv_cache_gib=1e-4)
    with pytest.raises(ValueError, match="one 512-token sequence needs 8 and 2"):
        _engine(path, num_state_blocks=1)


@pytest.mark.parametrize("state_blocks, hit", [(None, 128), (2, 0)], ids=["kept", "taken-back"])
def test_prefix_hit_needs_its_lookback_state(oracle, state_blocks, hit):
    """A prefix hit resumes from the window state of its last tokens: kept (idle, attached to
    the cached blocks) it serves the hit; taken back by another request's prefill, the hit is
    not used and the prompt is computed again. Tokens match either way."""
    path, hf, prompts, _ = oracle
    first = _prompts(hf.config.vocab_size, seed=7, lengths=[150])[0]
    second = first[:140] + _prompts(hf.config.vocab_size, seed=8, lengths=[20])[0]
    engine = _engine(path, num_state_blocks=state_blocks)
    engine.generate([first], GREEDY)
    engine.generate([prompts[3]], GREEDY)  # another request in between
    before = engine.scheduler.prefix_hit_tokens
    outs, logits = generate_with_logits(engine, [second], GREEDY)
    _check(outs, logits, [hf_greedy(hf, second, NEW_TOKENS)], f"state blocks {state_blocks}")
    assert engine.scheduler.prefix_hit_tokens - before == hit


def test_hash_layers_route_by_token_id(oracle):
    """Hash-routed layers pass the experts `tid2eid[token]` to the backend like any routing, so the
    per-expert load (EPLB's input) counts them."""
    path, hf, prompts, _ = oracle
    engine = _engine(path)
    _, _, load = run_requests(engine, [prompts[3]], SamplingParams(max_tokens=1, temperature=0.0))
    for layer in (0, 1):
        tid2eid = hf.model.layers[layer].mlp.gate.tid2eid
        want = torch.bincount(tid2eid[torch.tensor(prompts[3])].reshape(-1), minlength=16)
        assert torch.equal(load[layer], want)
    assert load[2].sum() == len(prompts[3]) * 4


def test_expert_worker_store_runs_the_clamped_swiglu(oracle):
    """The expert worker's SlotStore reads V4's `ffn.experts.E.w1/w2/w3` and applies the clamp:
    it agrees with transformers' DeepseekV4Experts."""
    from services.experts.store import SlotStore

    path, hf, _, _ = oracle
    cfg = ModelConfig.from_dir(path)
    store = SlotStore(cfg, path, torch.float32)
    order = list(range(cfg.n_routed_experts))[::-1]  # slot s holds logical expert 15 - s
    store.load(1, {layer: order for layer in cfg.moe_layers})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, cfg.hidden_size, generator=g) * 3
    logical = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(10)])
    weight = torch.rand(10, 4, generator=g)
    for layer in (0, 3):
        got = store.forward(1, layer, x, (15 - logical).int(), weight)
        with torch.no_grad():
            want = hf.model.layers[layer].mlp.experts(x, logical, weight)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tiny_v4_preset_matches_transformers(tmp_path):
    """`moe-cluster init-model --preset tiny-v4` writes, without transformers, a V4 checkpoint
    transformers loads with no missing, unexpected or mismatched tensor, and agrees with (every
    layer type: a 40-token prompt crosses the window, CSA's index_topk and the HCA ratio)."""
    from transformers import AutoModelForCausalLM

    path = init_model(tmp_path / "tiny-v4", "tiny-v4", seed=0)
    cfg = ModelConfig.from_dir(path)
    assert cfg.is_v4 and set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                                  "heavily_compressed_attention"}  # fmt: skip
    assert cfg.mlp_layer_types.count("hash_moe") == 2 and cfg.swiglu_limit == 1.0
    hf, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )  # fmt: skip
    assert type(hf).__name__ == "DeepseekV4ForCausalLM" and not any(info.values()), info
    hf.eval()
    for layer in (0, 1):  # hash routing: distinct experts per token id
        tid2eid = hf.model.layers[layer].mlp.gate.tid2eid
        assert tid2eid.shape == (cfg.vocab_size, 4) and all(len(set(row)) == 4 for row in tid2eid.tolist())
    engine = _engine(path)
    tok = engine.tokenizer  # the byte-level tokenizer: text prompts and detokenized outputs
    assert tok is not None and tok.decode(tok.encode("Hi, V4")) == "Hi, V4"
    prompts = _prompts(cfg.vocab_size, seed=2, lengths=[5, 40])
    outs, logits = generate_with_logits(engine, prompts, GREEDY)
    _check(outs, logits, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts], "tiny-v4 preset")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
# DeepSeek-V4's published dims in DeepSeek's own key names (compress_ratios, num_hash_layers,
# qk_rope_head_dim, a flat rope_scaling that is the compressed layers' YaRN)
RATIOS = [0, 0] + [4 if i % 2 else 128 for i in range(41)]
DEEPSEEK_V4 = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 3,
    "compress_ratios": RATIOS,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },  # fmt: skip
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
}


def test_v4_config_is_read_as_transformers_reads_it():
    """DeepSeek's key names and transformers' (what save_pretrained writes) give one config, and
    both ropes have transformers' frequencies."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cfg = ModelConfig.from_hf(DEEPSEEK_V4)
    hf = DeepseekV4Config(**{k: v for k, v in DEEPSEEK_V4.items() if k != "model_type"})
    assert ModelConfig.from_hf(json.loads(hf.to_json_string())) == cfg
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.mlp_layer_types == tuple(hf.mlp_layer_types)
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim) == (512, 64, 448)
    assert (cfg.compress_ratio_csa, cfg.compress_ratio_hca, cfg.sliding_window) == (4, 128, 128)
    assert cfg.moe_layers == list(range(43)) and [cfg.is_hash_layer(i) for i in range(4)] == [True] * 3 + [
        False
    ]
    assert cfg.intermediate_size == 2048 and cfg.swiglu_limit == 10.0 and cfg.hc_mult == 4
    rotary = DeepseekV4RotaryEmbedding(hf)
    for compress, theirs in ((False, rotary.main_inv_freq), (True, rotary.compress_inv_freq)):
        inv_freq, factor = rope_inv_freq(cfg, compress=compress)
        torch.testing.assert_close(inv_freq, theirs, rtol=1e-6, atol=0)
        assert factor == 1.0
    # state rows: sliding [kv], HCA [kv | compressor 2D], CSA [kv | compressor 4D | indexer 4Di];
    # entries: HCA [entry], CSA [entry | indexer entry]
    kinds = ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention")
    assert [cfg.v4_state_dim(t) for t in kinds] == [512, 512 * 3, 512 * 5 + 128 * 4]
    assert [cfg.v4_entry_dim(t) for t in kinds] == [0, 512, 512 + 128]


def test_transformers_defaults_are_the_published_model():
    from transformers import DeepseekV4Config

    cfg = ModelConfig.from_hf(json.loads(DeepseekV4Config().to_json_string()))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.index_topk) == (4096, 43, 512, 512)
    assert cfg.layer_types.count("compressed_sparse_attention") == 20 and cfg.compress_ratio_hca == 128


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "deepseek_v5"}, "model_type 'deepseek_v5' is not supported"),
        ({"compress_ratios": [8] * 43}, "compress_ratios entry 8"),
        ({"compress_ratios": None, "layer_types": ["full_attention"] * 43}, "layer_types"),
        ({"num_hash_layers": None, "mlp_layer_types": ["dense"] * 43}, "mlp_layer_types"),
        ({"n_group": 8}, "n_group"),
        ({"first_k_dense_replace": 1}, "first_k_dense_replace"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"o_groups": 6}, "o_groups"),
        ({"index_topk": 0}, "index_topk"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"type": "longrope"}}, "rope type"),
        ({"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4"}}, "expert_dtype"),
    ],
)
def test_v4_configs_this_engine_cannot_run_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**DEEPSEEK_V4, **change})


@pytest.mark.parametrize("key, value", [("hc_mult", 4), ("num_hash_layers", 3), ("sliding_window", 128)])
def test_v4_options_are_refused_on_other_models(key, value):
    from .test_deepseek_v32 import DEEPSEEK_V32

    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf({**DEEPSEEK_V32, "model_type": "deepseek_v3", "index_n_heads": None,
                             "index_head_dim": None, "index_topk": None, key: value})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Over the API: router -> attention worker -> gRPC expert workers
# ---------------------------------------------------------------------------------------------
@pytest.mark.cluster
def test_cluster_api_serves_v4_like_the_local_engine(oracle):
    import httpx
    import openai

    from .clusters import tiny_cluster

    path, _, prompts, _ = oracle
    want = _engine(path).generate(prompts[2:], GREEDY)
    want_states = EngineConfig(model=str(path), max_num_seqs=8, max_num_batched_tokens=32).state_blocks(
        ModelConfig.from_hf(json.loads((path / "config.json").read_text())), 4096
    )
    with tiny_cluster(path, expert_workers=2, max_num_seqs=8, max_num_batched_tokens=32,
                      balancer_period_s=0) as cluster:  # fmt: skip
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=prompts[2:], max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        got = [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    assert got == [w.token_ids for w in want]
    total = re.search(r'^moe_state_blocks_total\{worker="[^"]+"\} (\S+)$', metrics, re.M)
    assert total and float(total.group(1)) == want_states
