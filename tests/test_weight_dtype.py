"""bf16 weight storage under an fp32 CPU engine (`EngineConfig.weight_dtype`): the linears, the
LM head and the routed experts are kept in bf16 and computed in fp32, so the engine must give
transformers' fp32 tokens and logits on the same checkpoint with those weights rounded to bf16."""

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import check_weight_dtype
from services.model.kernels import cpu_kernels

from .hf_oracle import (
    V3_YARN,
    check_against_transformers,
    generate_with_logits,
    hf_greedy,
    load_hf,
    make_hf_checkpoint,
    random_prompts,
)

NEW_TOKENS = 24
# transformers' parameters stored in bf16 by weight_dtype: the linears that only go through
# `linear` (not kv_b, absorbed in the attention; not the router) and the routed experts
BF16_PARAMS = ("q_a_proj", "q_b_proj", "q_proj.", "kv_a_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "experts.", "lm_head")  # fmt: skip


def _round_to_bf16(hf) -> int:
    n = 0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(k in name for k in BF16_PARAMS):
                p.copy_(p.bfloat16().float())
                n += 1
    return n


@pytest.fixture(scope="module")
def rounded(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("bf16w"), seed=3, rope_parameters=V3_YARN)
    hf = load_hf(path)
    assert _round_to_bf16(hf) > 0
    prompts = random_prompts(hf.config.vocab_size, seed=4, lengths=[5, 40, 90])
    return path, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_bf16_weights_match_transformers_on_rounded_weights(rounded, chunked):
    path, prompts, expected = rounded
    cfg = EngineConfig(model=str(path), weight_dtype="bfloat16", max_num_seqs=4,
                       max_num_batched_tokens=32 if chunked else 2048)  # fmt: skip
    engine = LocalEngine(cfg)
    layer = engine.model.layers[1]
    assert layer.attn.q_a.dtype == torch.bfloat16 and layer.attn.kv_b.dtype == torch.float32
    assert engine.model.lm_head.dtype == torch.bfloat16 and layer.router.dtype == torch.float32
    assert all(w.dtype == torch.bfloat16 for w in engine.experts.packed.w13.values())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs, logits = generate_with_logits(engine, prompts, params)
    check_against_transformers(outs, logits, expected, "bf16 weights")


def test_the_rounding_is_what_the_test_sees(rounded):
    """The fp32 engine on the unrounded weights is off from the rounded oracle by more than the
    test's 1e-4: the oracle test above can tell the two apart."""
    path, prompts, expected = rounded
    engine = LocalEngine(EngineConfig(model=str(path), max_num_seqs=4))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    _, logits = generate_with_logits(engine, prompts[:1], params)
    assert (logits[0] - expected[0][1]).abs().max().item() > 1e-3


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels")
@pytest.mark.parametrize(
    "M, K", [(1, 136), (3, 136), (4, 136), (8, 136), (13, 272), (32, 256)]
)  # row streams; tiles
def test_bf16_linear_is_the_fp32_kernel_on_rounded_weights(M, K):
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(72, K, generator=g).bfloat16(), torch.randn(72)
    linear = cpu_kernels.CppKernels(cpu_kernels._module(), None).linear
    assert torch.equal(linear(x, w, b), linear(x, w.float(), b))
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w.float(), b),
                               rtol=1e-5, atol=1e-4)  # fmt: skip


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels")
@pytest.mark.parametrize("H,I", [(64, 32), (40, 24)])  # 16-lane path; 8-lane path
def test_bf16_expert_ffn_is_the_fp32_kernel_on_rounded_weights(H, I):
    g = torch.Generator().manual_seed(H)
    S, T, K = 6, 7, 3
    w13, w2 = torch.randn(S, 2 * I, H, generator=g).bfloat16(), torch.randn(S, H, I, generator=g).bfloat16()
    slot, x, weight = (
        torch.randint(-1, S, (T, K), generator=g),
        torch.randn(T, H, generator=g),
        torch.rand(T, K),
    )
    expert_ffn = cpu_kernels.CppKernels(cpu_kernels._module(), None).expert_ffn  # (T = 7: the kernel)
    got = expert_ffn(x, slot, weight, w13, w2)
    assert torch.equal(got, expert_ffn(x, slot, weight, w13.float(), w2.float()))


def test_unserved_weight_dtypes_are_refused():
    assert check_weight_dtype(None, torch.float32, "cpu") is None
    assert check_weight_dtype("float32", torch.float32, "cpu") is None  # the compute dtype: no-op
    assert check_weight_dtype("bfloat16", torch.bfloat16, "cpu") is None
    assert check_weight_dtype("bf16", torch.float32, "cpu") == torch.bfloat16
    for wd, dtype, device in [("float16", torch.float32, "cpu"), ("float32", torch.bfloat16, "cpu"),
                              ("bfloat16", torch.float32, "cuda")]:  # fmt: skip
        with pytest.raises(ValueError, match="weight_dtype"):
            check_weight_dtype(wd, dtype, device)


def test_cluster_config_refuses_unserved_weight_dtypes():
    from services.cluster import ClusterConfig

    ClusterConfig(weight_dtype="bfloat16").validate()
    for settings in [dict(weight_dtype="float16"), dict(weight_dtype="bfloat16", expert_gpus=1)]:
        with pytest.raises(ValueError, match="weight_dtype"):
            ClusterConfig(**settings).validate()
