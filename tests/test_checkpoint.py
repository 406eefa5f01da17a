import json

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.checkpoint import (
    CheckpointReader,
    is_routed_expert_tensor,
    load_expert_weights,
    load_expert_weights_fp8,
)
from services.model.config import ModelConfig
from services.model.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from services.model.model import DeepseekV3
from services.model.moe import PackedExperts
from services.presets import init_model, random_weights, save_safetensors

from .hf_oracle import generate_with_logits


@pytest.mark.parametrize("shape", [(576, 7168 // 8), (300, 200), (128, 256), (5, 7)])
def test_fp8_block_dequant_handles_partial_blocks(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.linspace(0.01, 3, shape[1])
    q, scale = quantize_fp8_blocks(w)
    assert scale.shape == ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
    deq = dequantize_fp8_blocks(q, scale, (128, 128))
    # the same multiply, block by block
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            assert torch.equal(deq[blk], q[blk].float() * scale[bi, bj])
    # e4m3 keeps ~2 significant bits of mantissa precision per block scale
    assert (deq - w).abs().max() <= 0.07 * w.abs().max()


def test_fp8_scale_shape_mismatch_is_an_error():
    q, scale = quantize_fp8_blocks(torch.randn(300, 200))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_blocks(q, scale[:1], (128, 128))


def test_fp8_checkpoint_matches_its_dequantised_weights(tmp_path):
    """An FP8 block-quantised checkpoint (shards splitting weights from their scales) gives the
    same tokens and logits as an fp32 checkpoint holding the dequantised weights."""
    fp8_dir = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, shards=3)
    reader = CheckpointReader.for_config(fp8_dir, ModelConfig.from_dir(fp8_dir))
    assert reader.raw("model.layers.1.mlp.experts.0.gate_proj.weight").dtype == torch.float8_e4m3fn
    assert reader.raw("model.embed_tokens.weight").dtype == torch.float32
    deq = {
        name: reader.get(name, torch.float32) for name in reader.names() if not name.endswith("_scale_inv")
    }
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    save_safetensors(deq, ref_dir)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (ref_dir / "config.json").write_text(json.dumps(cfg))

    prompts = [[0, 5, 9, 33, 2], list(range(2, 90))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a, la = generate_with_logits(LocalEngine(EngineConfig(model=str(fp8_dir))), prompts, params)
    b, lb = generate_with_logits(LocalEngine(EngineConfig(model=str(ref_dir))), prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y)


def test_fp8_experts_kept_fp8_give_the_dequantised_engines_bits(tmp_path):
    """keep_fp8_experts holds the routed experts as shipped (float8_e4m3fn + block scales, a
    quarter of fp32's bytes); the torch path dequantizes the slots each call uses, so the engine
    gives the tokens and logits of experts dequantized at load, bit for bit."""
    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, fp8_block=(16, 16))
    reader = CheckpointReader.for_config(path, ModelConfig.from_dir(path))
    w13, w2, s13, s2 = load_expert_weights_fp8(reader, 1, [3, 0])
    assert w13.dtype == w2.dtype == torch.float8_e4m3fn and s13.shape == (2, 64 // 16, 64 // 16)
    ref13, ref2 = load_expert_weights(reader, 1, [3, 0], torch.float32)
    for s in range(2):
        assert torch.equal(dequantize_fp8_blocks(w13[s], s13[s], (16, 16)), ref13[s])
        assert torch.equal(dequantize_fp8_blocks(w2[s], s2[s], (16, 16)), ref2[s])

    prompts = [[0, 5, 9, 33, 2], list(range(2, 90))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kept = LocalEngine(EngineConfig(model=str(path), keep_fp8_experts=True))
    loaded = LocalEngine(EngineConfig(model=str(path)))
    assert kept.experts.packed.w13[1].dtype == torch.float8_e4m3fn
    assert kept.experts.packed.nbytes() < loaded.experts.packed.nbytes() / 3.5  # scales included
    assert_same_bits(
        generate_with_logits(kept, prompts, params), generate_with_logits(loaded, prompts, params)
    )


def assert_same_bits(got, want) -> None:
    """Two generate_with_logits results: the same tokens, and logits equal bit for bit."""
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in want[0]]
    for x, y in zip(got[1], want[1], strict=True):
        assert torch.equal(x, y)


def test_keep_fp8_experts_refuses_what_it_cannot_hold(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="not FP8 block-quantised"):
        LocalEngine(EngineConfig(model=str(tiny_model), keep_fp8_experts=True))
    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True)  # 128-row blocks, 32-wide experts
    with pytest.raises(ValueError, match="not a multiple of the FP8 block"):
        LocalEngine(EngineConfig(model=str(path), keep_fp8_experts=True))
    reader = CheckpointReader.for_config(tiny_model, ModelConfig.from_dir(tiny_model))
    with pytest.raises(ValueError, match="not FP8"):
        load_expert_weights_fp8(reader, 1, [0])


def test_linears_kept_fp8_give_the_tokens_of_linears_dequantized_at_load(tmp_path, monkeypatch):
    """keep_fp8_linears (with the experts kept FP8 too): q_a, q_b, kv_a, o, the dense MLP and the
    shared experts held as the checkpoint ships them, 1 byte per weight plus scales; the C++
    kernels read them as held (the fused MLA decode layer, the dense MLP's and shared experts'
    expert kernel; prefill dequantises them per call) and the engine
    gives the tokens and logits of linears dequantized at load, bit for bit."""
    from services.model.fp8 import Fp8Weight
    from services.model.kernels import cpu_kernels

    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, fp8_block=(16, 16))
    prompts = [[0, 5, 9, 33, 2], list(range(2, 90)), [0] + [9] * 20]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kept = LocalEngine(EngineConfig(model=str(path), keep_fp8_experts=True, keep_fp8_linears=True))
    loaded = LocalEngine(EngineConfig(model=str(path), keep_fp8_experts=True))
    dense, moe = kept.model.layers[0], kept.model.layers[-1]
    held = [
        dense.attn.q_a,
        dense.attn.q_b,
        dense.attn.kv_a,
        dense.attn.o,
        dense.mlp_w13,
        dense.mlp_down,
        moe.mlp_w13,
    ]
    assert all(type(w) is Fp8Weight and w.weight.dtype == torch.float8_e4m3fn for w in held)
    assert torch.equal(dense.mlp_w13.dequantize(), loaded.model.layers[0].mlp_w13)
    module = cpu_kernels._module()
    calls = {}
    for name in ("mla_decode_layer", "expert_ffn_fp8"):
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _k=kernel, _n=name: calls.setdefault(_n, []).append(a) or _k(*a)
        )
    got = generate_with_logits(kept, prompts, params)
    assert calls["expert_ffn_fp8"] and all(len(a[-3]) == 5 for a in calls["mla_decode_layer"])  # FP8 scales
    assert_same_bits(got, generate_with_logits(loaded, prompts, params))


def test_keep_fp8_linears_refuses_what_it_cannot_hold(tmp_path, tiny_model):
    from services.model.weights import shard_heads

    with pytest.raises(ValueError, match="keep_fp8_linears: the checkpoint is not FP8 block-quantised"):
        LocalEngine(EngineConfig(model=str(tiny_model), keep_fp8_linears=True))
    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, fp8_block=(16, 16))
    engine = LocalEngine(EngineConfig(model=str(path), keep_fp8_linears=True))
    with pytest.raises(ValueError, match="attention tensor parallelism"):
        shard_heads(engine.model.layers[0].attn, engine.cfg, 0, 2)
    from services.cluster import ClusterConfig

    with pytest.raises(ValueError, match="keep_fp8_linears with attention_tp"):
        ClusterConfig(keep_fp8_linears=True, attention_tp=2).validate()


def test_sharded_checkpoint_equals_single_file(tmp_path):
    one = init_model(tmp_path / "one", "tiny", seed=1)
    many = init_model(tmp_path / "many", "tiny", seed=1, shards=4)
    assert (many / "model.safetensors.index.json").is_file()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[0, 7, 8, 9]]
    a = LocalEngine(EngineConfig(model=str(one))).generate(prompts, params)
    b = LocalEngine(EngineConfig(model=str(many))).generate(prompts, params)
    assert a[0].token_ids == b[0].token_ids


def test_loading_is_selective(tiny_model):
    cfg = ModelConfig.from_dir(tiny_model)
    reader = CheckpointReader.for_config(tiny_model, cfg)
    DeepseekV3.load(reader, cfg)
    assert reader.names_read and not any(is_routed_expert_tensor(n) for n in reader.names_read)

    reader = CheckpointReader.for_config(tiny_model, cfg)
    layer = cfg.moe_layers[0]
    packed = PackedExperts.load(reader, {layer: [3, 7, 3]}, torch.float32)
    assert packed.w13[layer].shape == (3, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert packed.w2[layer].shape == (3, cfg.hidden_size, cfg.moe_intermediate_size)
    assert all(f"mlp.experts.{e}." in n for n in reader.names_read for e in [n.split(".")[5]])
    assert {int(n.split(".")[5]) for n in reader.names_read} == {3, 7}
    weights = random_weights(json.loads((tiny_model / "config.json").read_text()), seed=0)
    torch.testing.assert_close(
        packed.w13[layer][1, : cfg.moe_intermediate_size],
        weights[f"model.layers.{layer}.mlp.experts.7.gate_proj.weight"],
        rtol=0,
        atol=0,
    )


def test_missing_tensor_names_the_tensor(tiny_model):
    reader = CheckpointReader(tiny_model)
    with pytest.raises(KeyError, match="model.layers.99"):
        reader.get("model.layers.99.input_layernorm.weight")
    with pytest.raises(FileNotFoundError):
        CheckpointReader(tiny_model / "nowhere")
