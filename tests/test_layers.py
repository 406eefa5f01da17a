"""Unit tests of the model math against transformers' modules and naive references."""

import pytest
import torch

from services.model.batch import StepBatch
from services.model.config import ModelConfig
from services.model.kernels.select import select_kernels
from services.model.kernels.torch_ops import expert_ffn as grouped_expert_ffn
from services.model.kv_cache import BLOCK_SIZE
from services.model.layers import Rope
from services.model.model import mla_forward

from .hf_oracle import BASE, V3_YARN


def _cfg(**kw) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "model_type": "deepseek_v3", "rope_parameters": V3_YARN, **kw})


@pytest.mark.parametrize("groups", [(8, 3), (4, 2), (1, 1)])
def test_router_matches_transformers(groups):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_group, topk_group = groups
    kw = dict(n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group)
    hf_router = DeepseekV3TopkRouter(DeepseekV3Config(**{**BASE, **kw}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(32, 64, generator=g) * 0.3)
        # strongly negative biases: masked groups would win with a 0.0 mask instead of -inf
        hf_router.e_score_correction_bias.copy_(torch.randn(32, generator=g) - 1.5)
    x = torch.randn(50, 64, generator=g)
    _, hf_w, hf_idx = hf_router(x)
    route = select_kernels("cpu", torch.float32, _cfg(**kw)).route  # (the C++ router where built)
    idx, w = route(x, hf_router.weight.data, hf_router.e_score_correction_bias)
    hf_order, order = hf_idx.sort(-1), idx.sort(-1)
    assert torch.equal(hf_order.values, order.values)
    torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices))
    assert torch.allclose(w.sum(-1), torch.full((50,), 2.5))  # normalised x routed_scaling_factor
    if n_group > 1:  # every token's experts come from at most topk_group groups
        for row in idx // (32 // n_group):
            assert len(set(row.tolist())) <= topk_group


def test_rope_interleaved_equals_transformers_up_to_layout():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    cfg = _cfg()
    rope = Rope(cfg)
    pos = torch.arange(0, 300, 7)
    x = torch.randn(len(pos), 4, 8)
    cos, sin = rope.cos_sin(pos, torch.float32)
    ours = rope.apply(x, cos, sin)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    xt = x.transpose(0, 1)[None]  # HF layout [batch, heads, T, R]
    hf, _ = apply_rotary_pos_emb_interleave(xt, xt, full_cos[None], full_sin[None])
    # HF de-interleaves its output: [evens..., odds...]
    deinterleaved = torch.cat((ours[..., 0::2], ours[..., 1::2]), -1)
    torch.testing.assert_close(deinterleaved, hf[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_grouped_expert_ffn_matches_per_token_loop():
    g = torch.Generator().manual_seed(0)
    S, H, I, T, K = 6, 16, 8, 20, 3
    w13, w2 = torch.randn(S, 2 * I, H, generator=g), torch.randn(S, H, I, generator=g)
    x = torch.randn(T, H, generator=g)
    slot = torch.randint(0, S, (T, K), generator=g)
    slot[3, 1] = -1  # skipped pair
    weight = torch.rand(T, K, generator=g)
    out = grouped_expert_ffn(x, slot, weight, w13, w2)
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            s = int(slot[t, k])
            if s < 0:
                continue
            gate, up = (w13[s] @ x[t]).chunk(2)
            ref[t] += weight[t, k] * (w2[s] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    empty = grouped_expert_ffn(x, torch.full((T, K), -1), weight, w13, w2)
    assert torch.equal(empty, torch.zeros(T, H))
    # into a given output (a response's payload): fp32 accumulates in place, bf16 is cast into it
    for dtype in (torch.float32, torch.bfloat16):
        xd, w13d, w2d = x.to(dtype), w13.to(dtype), w2.to(dtype)
        into = torch.full((T, H), float("nan"), dtype=dtype)
        assert grouped_expert_ffn(xd, slot, weight, w13d, w2d, out=into) is into
        assert torch.equal(into, grouped_expert_ffn(xd, slot, weight, w13d, w2d))
        grouped_expert_ffn(xd, torch.full((T, K), -1), weight, w13d, w2d, out=into)
        assert torch.equal(into, torch.zeros(T, H, dtype=dtype))


def _random_mla(cfg, g):
    from services.model.weights import MLAWeights

    N, D, R, V, C, Q, H = 4, 16, 8, 16, 32, 32, 64
    r = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    return MLAWeights(
        kv_a=r(C + R, H),
        kv_a_norm=1 + 0.1 * torch.randn(C, generator=g),
        kv_b=r(N * (D + V), C),
        o=r(H, N * V),
        q_a=r(Q, H),
        q_a_norm=1 + 0.1 * torch.randn(Q, generator=g),
        q_b=r(N * (D + R), Q),
    )


def test_absorbed_decode_equals_naive_prefill():
    """The last token computed by decode (absorbed, paged) equals it computed inside a prefill
    (naive, expanded K/V), with a scrambled block table."""
    cfg = _cfg()
    g = torch.Generator().manual_seed(1)
    w = _random_mla(cfg, g)
    rope, k = Rope(cfg), select_kernels("cpu", torch.float32, cfg)
    n = 150
    x = torch.randn(n, 64, generator=g)
    blocks = [5, 1, 3]
    cache_a = torch.zeros(8, BLOCK_SIZE, 1, cfg.latent_dim)
    full = StepBatch.build([(list(range(n)), 0, blocks, True)])
    out_full = mla_forward(x, w, cfg, k, rope.cos_sin(full.positions, torch.float32), cache_a, full)

    cache_b = torch.zeros_like(cache_a)
    pre = StepBatch.build([(list(range(n - 1)), 0, blocks, True)])
    mla_forward(x[:-1], w, cfg, k, rope.cos_sin(pre.positions, torch.float32), cache_b, pre)
    dec = StepBatch.build([([0], n - 1, blocks, True)])
    out_dec = mla_forward(x[-1:], w, cfg, k, rope.cos_sin(dec.positions, torch.float32), cache_b, dec)
    torch.testing.assert_close(out_dec[0], out_full[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_a, cache_b)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="Linux /proc")
def test_a_cpu_cache_is_zero_and_resident_only_where_used():
    """The paged cache's pages come zeroed from the OS on first touch: a 1 GiB cache costs
    neither a fill nor resident memory until its blocks are written."""
    from services.model.kv_cache import PagedLatentCache

    before = _rss_bytes()
    cache = PagedLatentCache(num_layers=4, num_blocks=2**30 // (4 * BLOCK_SIZE * 64 * 4), latent_dim=64,
                             dtype=torch.float32)  # fmt: skip
    assert cache.nbytes == 2**30 and cache.kv.is_contiguous() and cache.kv.dtype is torch.float32
    assert _rss_bytes() - before < 2**27  # not filled
    cache.kv[1, 7] = 3.0  # writable, zeros around it
    assert float(cache.kv[1, 6:9].sum()) == 3.0 * BLOCK_SIZE * 64
    assert not cache.kv[:, 100::101].any()  # untouched blocks read zero
    assert PagedLatentCache(2, 3, 8, torch.bfloat16).kv.eq(0).all()


def test_fp8_experts_beyond_decode_sizes_dequantize_a_bounded_chunk_at_a_time(monkeypatch):
    """Kept-FP8 experts on the torch path (a prefill): the slots a call touches are dequantized
    FP8_DEQUANT_BYTES at a time. In one chunk the result is that of experts dequantized at load,
    bit for bit; in several, the same up to the order of the fp32 sums."""
    from services.model import fp8
    from services.model.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

    g = torch.Generator().manual_seed(6)
    S, H, I, T, K, block = 6, 64, 32, 40, 3, (16, 16)
    q13, s13 = zip(
        *(quantize_fp8_blocks(torch.randn(2 * I, H, generator=g), block) for _ in range(S)), strict=True
    )
    q2, s2 = zip(*(quantize_fp8_blocks(torch.randn(H, I, generator=g), block) for _ in range(S)), strict=True)
    q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
    real13 = torch.stack([dequantize_fp8_blocks(q13[s], s13[s], block) for s in range(S)])
    real2 = torch.stack([dequantize_fp8_blocks(q2[s], s2[s], block) for s in range(S)])
    x, weight = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    slot = torch.randint(-1, S - 1, (T, K), generator=g)  # slot S - 1 unused
    want = grouped_expert_ffn(x, slot, weight, real13, real2)
    assert torch.equal(grouped_expert_ffn(x, slot, weight, q13, q2, None, None, s13, s2, block), want)
    monkeypatch.setattr(fp8, "FP8_DEQUANT_BYTES", 1)  # one slot per chunk
    out = torch.empty(T, H)
    got = grouped_expert_ffn(x, slot, weight, q13, q2, out, None, s13, s2, block)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    none = torch.full_like(slot, -1)
    assert not grouped_expert_ffn(x, none, weight, q13, q2, None, None, s13, s2, block).any()
