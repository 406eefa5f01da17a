"""The C++ CPU kernels (services/model/kernels/cpu_kernels.py) against torch's ops, as the
implementations selection binds (kernels/select.py): `cpp()` the kernels themselves, `chosen()`
the default selection on this machine (the C++ kernels for fp32), `reference()` torch's."""

import pytest
import torch
import torch.nn.functional as F

from services.model.batch import DecodeRows
from services.model.config import ModelConfig
from services.model.kernels import cpu_kernels
from services.model.kernels.select import select_kernels
from services.presets import PRESETS


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_hf({**PRESETS["tiny"], **overrides})


def chosen(cfg: ModelConfig | None = None, allow: str = "auto"):
    """The kernels selected for an fp32 CPU model of `cfg` (the tiny preset's dims)."""
    return select_kernels("cpu", torch.float32, cfg or _cfg(), allow=allow)


def reference(cfg: ModelConfig | None = None):
    """torch's implementation of every family (the references)."""
    return chosen(cfg, allow="torch")


def cpp(cfg: ModelConfig | None = None) -> cpu_kernels.CppKernels:
    """The C++ kernels, called directly (their size rules leave the rest to `chosen`'s)."""
    return cpu_kernels.CppKernels(cpu_kernels._module(), chosen(cfg))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain: F.linear is used")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_small_linear_matches_torch_and_is_batch_invariant(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (
        torch.randn(rows, 136, generator=g),
        torch.randn(72, 136, generator=g),
        torch.randn(72, generator=g),
    )
    for bias in (None, b):
        y = cpp().linear(x, w, bias)
        torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        for i in range(rows):  # each row alone gives the same bits: no dependence on the batch
            assert torch.equal(cpp().linear(x[i : i + 1], w, bias), y[i : i + 1])


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain: F.linear is used")
@pytest.mark.parametrize("rows", [9, 14, 32])
def test_small_linear_register_tiles_match_torch_and_are_batch_invariant(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (
        torch.randn(rows, 272, generator=g),
        torch.randn(70, 272, generator=g),  # 70 rows: 17 tiles of 4 and 2 rows alone
        torch.randn(70, generator=g),
    )
    y = cpp().linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for lo, hi in ((0, 9), (rows - 9, rows)):  # the same rows in a smaller tiled call: the same bits
        assert torch.equal(cpp().linear(x[lo:hi], w, b), y[lo:hi])


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain: F.linear is used")
def test_the_linears_size_rule_leaves_other_shapes_to_mkl():
    x, w = torch.randn(9, 64), torch.randn(32, 64)  # more rows than MAX_ROWS, K under 256
    assert torch.equal(cpp().linear(x, w), F.linear(x, w))
    x, w = torch.randn(cpu_kernels.TILE_ROWS + 1, 256), torch.randn(32, 256)  # more rows than TILE_ROWS
    assert torch.equal(cpp().linear(x, w), F.linear(x, w))
    x, w = torch.randn(2, 60), torch.randn(32, 60)  # K not a multiple of 8
    assert torch.equal(cpp().linear(x, w), F.linear(x, w))
    # activations other than fp32: no C++ kernel is chosen at all
    k = select_kernels("cpu", torch.float64, _cfg())
    assert k.names()["linear"] == "torch" and "float32" in k.reasons()["linear"]["cpp"]
    x, w = torch.randn(2, 64, dtype=torch.float64), torch.randn(32, 64, dtype=torch.float64)
    assert torch.equal(k.linear(x, w), F.linear(x, w))


needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain: torch ops are used")


@needs_kernels
def test_rms_norm_and_rope_match_torch():
    from services.model.layers import Rope

    k, ref = chosen(), reference()
    assert k.names()["rms_norm"] == k.names()["rope"] == "cpp"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 64, generator=g), torch.randn(64, generator=g)
    y = k.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, ref.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    assert torch.equal(k.rms_norm(x[2:3], w, 1e-6), y[2:3])  # batch invariant

    cfg = _cfg()
    rope = Rope(cfg)
    cos, sin = rope.cos_sin(torch.arange(7, 12), torch.float32)
    q = torch.randn(5, 4, 8 + cfg.qk_rope_head_dim, generator=g)[
        ..., 8:
    ]  # a strided view, as mla_forward passes
    for t in (q, q[:, 0].contiguous()):
        assert torch.equal(k.rope(t, cos, sin), ref.rope(t, cos, sin))
        assert torch.equal(k.rope(t, cos, sin), rope.apply(t, cos, sin))


@needs_kernels
def test_add_rms_norm_is_the_add_then_the_norm():
    """The residual update and its norm in one call: the bits of `h + delta` and rms_norm of it,
    row by row whatever the batch; transposed inputs are read as they are; bf16 activations are
    torch's (selected for a bf16 model)."""
    from services.model.model import add_rms_norm

    k, ref = chosen(), reference()
    g = torch.Generator().manual_seed(5)
    h, delta, w = (
        torch.randn(5, 64, generator=g),
        torch.randn(5, 64, generator=g),
        torch.randn(64, generator=g),
    )
    assert k.names()["add_rms_norm"] == "cpp"
    s, x = k.add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(s, h + delta) and torch.equal(x, k.rms_norm(h + delta, w, 1e-6))
    ref_s, ref_x = ref.add_rms_norm(h, delta, w, 1e-6)  # torch's ops
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(x, ref_x, rtol=1e-6, atol=1e-6)
    assert torch.equal(k.add_rms_norm(h[3:4], delta[3:4], w, 1e-6)[1], x[3:4])  # batch invariant
    assert add_rms_norm(k, h, None, w, 1e-6)[0] is h  # nothing to add yet: the first layer's norm
    ht, dt = torch.randn(64, 5, generator=g).T, torch.randn(64, 5, generator=g).T  # transposed
    assert torch.equal(k.add_rms_norm(ht, dt, w, 1e-6)[1], k.rms_norm(ht + dt, w, 1e-6))
    bf16 = select_kernels("cpu", torch.bfloat16, _cfg())
    assert bf16.names()["add_rms_norm"] == "torch" and "float32" in bf16.reasons()["add_rms_norm"]["cpp"]
    hb, xb = bf16.add_rms_norm(h.bfloat16(), delta.bfloat16(), w.bfloat16(), 1e-6)
    assert torch.equal(hb, h.bfloat16() + delta.bfloat16()) and torch.equal(
        xb, bf16.rms_norm(hb, w.bfloat16(), 1e-6)
    )


@needs_kernels
@pytest.mark.parametrize("groups", [1, 4])
def test_route_matches_torch(groups):
    overrides = dict(hidden_size=64, n_routed_experts=16, num_experts_per_tok=3, n_group=groups,
                     topk_group=min(groups, 2), scoring_func="sigmoid", topk_method="noaux_tc",
                     norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    cfg = _cfg(**overrides)
    k, ref = chosen(cfg), reference(cfg)
    assert k.names()["route"] == "cpp"
    g = torch.Generator().manual_seed(groups)
    x, gate, bias = (
        torch.randn(9, 64, generator=g),
        torch.randn(16, 64, generator=g),
        torch.randn(16, generator=g),
    )
    for b in (bias, None):
        idx, weight = k.route(x, gate, b)
        ref_idx, ref_weight = ref.route(x, gate, b)
        order, ref_order = idx.argsort(1), ref_idx.argsort(1)
        assert torch.equal(idx.gather(1, order), ref_idx.gather(1, ref_order))
        torch.testing.assert_close(weight.gather(1, order), ref_weight.gather(1, ref_order))
    empty = k.route(x[:0], gate, bias)  # (no tokens: empty choices, as torch's)
    assert [t.shape for t in empty] == [t.shape for t in ref.route(x[:0], gate, bias)] == [(0, 3), (0, 3)]


@needs_kernels
@pytest.mark.parametrize("limit", [None, 0.5])
def test_expert_ffn_matches_torch_and_is_batch_invariant(limit):
    g = torch.Generator().manual_seed(1)
    S, H, I, T = 6, 32, 16, 7
    x, w13, w2 = (
        torch.randn(T, H, generator=g),
        torch.randn(S, 2 * I, H, generator=g),
        torch.randn(S, H, I, generator=g),
    )
    slot = torch.stack([torch.randperm(S, generator=g)[:3] for _ in range(T)])
    slot[2, 1] = -1  # a choice served elsewhere
    weight = torch.rand(T, 3, generator=g)
    ffn, ref = cpp().expert_ffn, reference().expert_ffn
    y = ffn(x, slot, weight, w13, w2, swiglu_limit=limit)
    torch.testing.assert_close(
        y, ref(x, slot, weight, w13, w2, swiglu_limit=limit), rtol=1e-5, atol=1e-4
    )  # ~30
    for t in range(T):
        assert torch.equal(ffn(x[t : t + 1], slot[t : t + 1], weight[t : t + 1], w13, w2, swiglu_limit=limit),
                           y[t : t + 1])  # fmt: skip
    out = torch.empty(T, H)
    assert ffn(x, slot, weight, w13, w2, out=out, swiglu_limit=limit) is out
    assert torch.equal(out, y)
    slot[0, 0] = S  # a slot this worker does not hold: an error, not a wild read
    with pytest.raises(RuntimeError, match="out of range"):
        ffn(x, slot, weight, w13, w2)


@needs_kernels
@pytest.mark.parametrize("block", [(32, 32), (32, 64), (16, 128)])  # (64: a partial last column block)
@pytest.mark.parametrize("H", [96, 80])  # 80: rows end in 16 values (the 16-wide conversion)
def test_expert_ffn_on_fp8_experts_is_the_kernel_on_their_dequantized_values(block, H):
    """FP8 experts kept FP8: every e4m3fn bit pattern (subnormals, both zeros, the largest) times
    its block's scale, as fp8.dequantize_fp8_blocks gives it: the fp32 kernel's bits. Blocks the
    kernel cannot read are refused when the kernels are selected, with the reason."""
    from services.model.fp8 import dequantize_fp8_blocks

    g = torch.Generator().manual_seed(block[1])
    S, I, T, K = 5, 64, 7, 3
    bn, bk = block

    def fp8(*shape):  # random bytes, every pattern but NaN (0x7F, 0xFF)
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return b.masked_fill((b & 0x7F) == 0x7F, 0).view(torch.float8_e4m3fn)

    w13, w2 = fp8(S, 2 * I, H), fp8(S, H, I)
    s13 = torch.rand(S, 2 * I // bn, -(-H // bk), generator=g) / 64
    s2 = torch.rand(S, -(-H // bn), -(-I // bk), generator=g) / 64
    real13 = torch.stack([dequantize_fp8_blocks(w13[s], s13[s], block) for s in range(S)])
    real2 = torch.stack([dequantize_fp8_blocks(w2[s], s2[s], block) for s in range(S)])
    x, weight = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    slot = torch.randint(-1, S, (T, K), generator=g)
    ffn = cpp().expert_ffn
    y = ffn(x, slot, weight, w13, w2, None, None, s13, s2, block)
    assert torch.equal(y, ffn(x, slot, weight, real13, real2))
    w2_nan = w2.clone()
    w2_nan.view(torch.uint8)[slot[0, 0].clamp(min=0), 5, 0] = 0x7F  # NaN stays NaN
    y = ffn(x, slot, weight, w13, w2_nan, None, None, s13, s2, block)
    assert bool(y[0, 5].isnan()) == bool(slot[0, 0] >= 0)
    for bad, why in (((48, bk), "FP8 row block 48"), ((bn, 24), "FP8 column block 24")):  # 48 does not
        # divide I; 24 % 16
        cfg = _cfg(hidden_size=H, moe_intermediate_size=I, quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(bad), "activation_scheme": "dynamic"})  # fmt: skip
        k = select_kernels("cpu", torch.float32, cfg, fp8_experts=True)
        assert k.names()["expert_ffn"] == "torch" and why in k.reasons()["expert_ffn"]["cpp"]


def random_fp8(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random e4m3fn values: every bit pattern but NaN (0x7F, 0xFF)."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return b.masked_fill((b & 0x7F) == 0x7F, 0).view(torch.float8_e4m3fn)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 13, 32, 33, 64])  # 1-8-row paths, register tiles
@pytest.mark.parametrize("block", [(16, 32), (32, 128)])  # (128: a partial last column block)
def test_linear_kept_fp8_is_the_kernel_on_its_dequantized_values(rows, block):
    """A linear kept FP8 (fp8.Fp8Weight): each row dequantised as it is read gives the bits
    of the fp32 kernel on dequantize_fp8_blocks's values, bias included, 70 output rows (a partial
    row block, pairs and a single row, tiles of 4 and 2 alone). Beyond TILE_ROWS (where the fp32
    path has MKL) up to FP8_TILE_ROWS the register tiles still read it as held: F.linear's values,
    and each row's bits those of a 32-row call."""
    from services.model.fp8 import Fp8Weight, dequantize_fp8_blocks, fp8_scale_shape

    g = torch.Generator().manual_seed(rows)
    K, N = 272, 70
    w = Fp8Weight(random_fp8(g, N, K), torch.rand(fp8_scale_shape((N, K), block), generator=g) / 64, block)
    real = dequantize_fp8_blocks(w.weight, w.scale, block)
    x, b = torch.randn(rows, K, generator=g), torch.randn(N, generator=g)
    k = cpp()
    for bias in (None, b):
        y = k.fp8_linear(x, w, bias)
        torch.testing.assert_close(y, F.linear(x, real, bias), rtol=1e-4, atol=1e-4)
        if rows <= cpu_kernels.TILE_ROWS:
            assert torch.equal(y, k.linear(x, real, bias))
        else:
            assert torch.equal(y[-32:], k.fp8_linear(x[-32:], w, bias))  # (tiles: batch invariant)


def test_linear_kept_fp8_beyond_the_kernel_dequantises_in_row_chunks(monkeypatch):
    """More rows than the kernel takes (a prefill): the weight is dequantised a few row blocks at a
    time (fp8.FP8_DEQUANT_BYTES), each chunk's columns F.linear's on the dequantised rows."""
    from services.model import fp8
    from services.model.fp8 import Fp8Weight, dequantize_fp8_blocks, fp8_scale_shape
    from services.model.kernels import torch_ops

    g = torch.Generator().manual_seed(0)
    K, N, block = 64, 80, (16, 32)
    w = Fp8Weight(random_fp8(g, N, K), torch.rand(fp8_scale_shape((N, K), block), generator=g) / 64, block)
    real = dequantize_fp8_blocks(w.weight, w.scale, block)
    x, b = torch.randn(cpu_kernels.TILE_ROWS + 7, K, generator=g), torch.randn(N, generator=g)
    whole = torch_ops.fp8_linear(x, w, b)
    if cpu_kernels.available():  # (the C++ kernel's size rule leaves this to the chunks)
        assert torch.equal(cpp().fp8_linear(x, w, b), whole)
    assert torch.equal(whole, F.linear(x, real, b))  # (one chunk: the bias added as F.linear adds it)
    monkeypatch.setattr(fp8, "FP8_DEQUANT_BYTES", 2 * 16 * K * 4)  # two row blocks per chunk
    dequantized = []
    dequantize = Fp8Weight.dequantize
    monkeypatch.setattr(
        Fp8Weight, "dequantize", lambda self, rows: dequantized.append(rows) or dequantize(self, rows)
    )
    chunked = torch_ops.fp8_linear(x, w, b)
    assert [(r.start, r.stop) for r in dequantized] == [(0, 32), (32, 64), (64, 96)]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, I", [(48, 24), (64, 32)])  # the 8-lane loops; the 16-lane ones (% 32)
def test_dense_ffn_is_the_swiglu_mlp_and_batch_invariant(weight_dtype, H, I):
    from services.model.kernels import torch_ops

    k = cpp()
    dense_ffn = k.dense_ffn
    g = torch.Generator().manual_seed(3)
    T = 8
    x = torch.randn(T, H, generator=g)
    w13, w2 = (
        torch.randn(2 * I, H, generator=g).to(weight_dtype),
        torch.randn(H, I, generator=g).to(weight_dtype),
    )
    y = dense_ffn(x, w13, w2)
    gate, up = x @ w13[:I].float().T, x @ w13[I:].float().T
    torch.testing.assert_close(y, (F.silu(gate) * up) @ w2.float().T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y, reference().dense_ffn(x, w13, w2), rtol=1e-5, atol=1e-4)
    one_slot = k.expert_ffn(x, torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1), w13[None], w2[None])
    assert torch.equal(y, one_slot)  # the kernel ran: the one-slot experts' bits
    for t in range(T):  # each token alone gives the same bits
        assert torch.equal(dense_ffn(x[t : t + 1], w13, w2), y[t : t + 1])
    more = torch.randn(cpu_kernels.MAX_ROWS + 1, H, generator=g)  # beyond the size rule: two linears
    assert torch.equal(dense_ffn(more, w13, w2), torch_ops.dense_ffn(more, w13, w2, k.linear))


@needs_kernels
def test_absorbed_products_match_bmm_and_are_batch_invariant():
    g = torch.Generator().manual_seed(5)
    T, N, D, V, C, R = 5, 3, 12, 20, 40, 8
    kv_b = torch.randn(N, D + V, C, generator=g)
    q = torch.randn(T, N, D + R, generator=g)[..., :D]  # a strided slice, as mla_forward passes it
    o_lat = torch.randn(T, N, C, generator=g)
    k, ref = cpp(), reference()
    q_lat, o = k.absorb_q(q, kv_b), k.absorb_o(o_lat, kv_b, D)
    torch.testing.assert_close(q_lat, torch.einsum("tnd,ndc->tnc", q, kv_b[:, :D]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, torch.einsum("tnc,nvc->tnv", o_lat, kv_b[:, D:]), rtol=1e-5, atol=1e-5)
    for t in range(T):
        assert torch.equal(k.absorb_q(q[t : t + 1], kv_b), q_lat[t : t + 1])
        assert torch.equal(k.absorb_o(o_lat[t : t + 1], kv_b, D), o[t : t + 1])
    more = torch.randn(cpu_kernels.MAX_ROWS + 1, N, D)  # beyond the size rule: bmm's
    assert torch.equal(k.absorb_q(more, kv_b), ref.absorb_q(more, kv_b))


@needs_kernels
def test_mla_decode_reads_the_paged_cache_in_place():
    g = torch.Generator().manual_seed(2)
    B, N, C, R, blocks = 3, 6, 32, 8, 7  # 6 heads: a group of 4 and one of 2
    cache = torch.randn(blocks, 64, 1, C + R, generator=g)
    table = torch.tensor([[5, 2, 0], [1, 0, 0], [6, 3, 4]])
    lens = torch.tensor([100, 1, 150])
    q = torch.randn(B, N, C + R, generator=g)
    k = cpp()
    o = k.mla_decode(q, cache, DecodeRows(None, None, table, lens), C, 0.3)
    for b in range(B):
        ctx = cache[table[b]].view(-1, C + R)[: lens[b]]
        probs = (q[b] @ ctx.T * 0.3).softmax(-1)
        torch.testing.assert_close(o[b], probs @ ctx[:, :C], rtol=1e-5, atol=1e-5)
        assert torch.equal(
            k.mla_decode(
                q[b : b + 1], cache, DecodeRows(None, None, table[b : b + 1], lens[b : b + 1]), C, 0.3
            ),
            o[b : b + 1],
        )


@needs_kernels
@pytest.mark.parametrize(
    "preset, tokens", [("tiny", 3), ("small", 3), ("small", 12)]
)  # 12: bmm, not per-head dots
def test_fused_mla_decode_layer_equals_the_op_by_op_path(tmp_path, monkeypatch, preset, tokens):
    """The decode-only MLA layer in one C++ call gives the bits of mla_forward's torch-level path
    (which itself uses the single kernels), outputs and cache rows alike."""
    from services.model import model as model_mod
    from services.model.config import ModelConfig
    from services.presets import PRESETS

    cfg = ModelConfig.from_hf(PRESETS[preset])
    C, R, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    N, D, V, Q = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    w = model_mod.MLAWeights(
        kv_a=torch.randn(C + R, H, generator=g) / H**0.5, kv_a_norm=torch.rand(C, generator=g) + 0.5,
        kv_b=torch.randn(N * (D + V), C, generator=g) / C**0.5, o=torch.randn(H, N * V, generator=g) / (N * V) ** 0.5,
        q_a=torch.randn(Q, H, generator=g) / H**0.5, q_a_norm=torch.rand(Q, generator=g) + 0.5,
        q_b=torch.randn(N * (D + R), Q, generator=g) / Q**0.5,
    )  # fmt: skip
    rope = model_mod.Rope(cfg)
    rows = [([5], 70, [2, 0], True), ([7], 10, [3], True), ([9], 0, [1], True)]
    rows += [([11 + i], 20 + i, [4 + i], True) for i in range(tokens - 3)]  # more sequences, a block each
    batch = model_mod.StepBatch.build(rows)
    cos_sin = rope.cos_sin(batch.positions, torch.float32)
    x, cache = torch.randn(tokens, H, generator=g), torch.randn(4 + tokens, 64, 1, C + R, generator=g)
    fused, k, unfused = [], chosen(cfg), chosen(cfg)
    assert k.names()["mla_decode_layer"] == "cpp"
    original = k.mla_decode_layer
    k.mla_decode_layer = lambda *a: fused.append(1) or original(*a)
    unfused.mla_decode_layer = None  # (op by op, on the single kernels)
    c1, c2 = cache.clone(), cache.clone()
    y1 = model_mod.mla_forward(x, w, cfg, k, cos_sin, c1, batch)
    assert fused  # the fused call took it
    y2 = model_mod.mla_forward(x, w, cfg, unfused, cos_sin, c2, batch)
    assert torch.equal(y1, y2) and torch.equal(c1, c2)
    assert not torch.equal(c1, cache)  # this step's rows were written


@needs_kernels
def test_bad_inputs_get_errors_never_wild_reads():
    cfg = _cfg()
    g = torch.Generator().manual_seed(4)
    x, gate = (
        torch.randn(2, cfg.hidden_size, generator=g),
        torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g),
    )
    x[0, 5] = float("nan")  # a NaN still routes to valid experts
    idx, _ = chosen().route(x, gate, None)
    assert bool(((idx >= 0) & (idx < cfg.n_routed_experts)).all()), idx

    q, cache, k = torch.randn(1, 4, 40), torch.randn(2, 64, 1, 40), cpp()
    with pytest.raises(RuntimeError, match="outside the cache"):
        k.mla_decode(q, cache, DecodeRows(None, None, torch.tensor([[7]]), torch.tensor([10])), 32, 0.1)
    with pytest.raises(RuntimeError, match="context length"):
        k.mla_decode(q, cache, DecodeRows(None, None, torch.tensor([[0]]), torch.tensor([65])), 32, 0.1)
    with pytest.raises(RuntimeError):  # (int64 tables: what batch.DecodeRows holds)
        k.mla_decode(q, cache, DecodeRows(None, None, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3])),
                     32, 0.1)  # fmt: skip

    from services.model import model as model_mod

    C, R, H, N = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.hidden_size, cfg.num_attention_heads
    D, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    mla = model_mod.MLAWeights(
        kv_a=torch.randn(C + R, H), kv_a_norm=torch.ones(C), kv_b=torch.randn(N * (D + V), C),
        o=torch.randn(H, N * V), q_proj=torch.randn(N * (D + R), H),
    )  # fmt: skip
    cos_sin = model_mod.Rope(cfg).cos_sin(torch.tensor([3, 4]), torch.float32)
    cache = torch.zeros(2, 64, 1, C + R)
    for bad in (128, -1):  # the fused layer writes no row, not even the first token's valid one
        with pytest.raises(RuntimeError, match=f"cache slot {bad} outside"):
            k.mla_decode_layer(torch.randn(2, H), mla, cos_sin, cache, torch.tensor([0, bad]),
                               torch.tensor([[0], [1]]), torch.tensor([4, 4]), cfg, 1e-6)  # fmt: skip
        assert not cache.any()

    w, bias = torch.randn(8, 16, generator=g), torch.arange(16.0)[::2]  # a strided bias
    x = torch.randn(2, 16, generator=g)
    torch.testing.assert_close(k.linear(x, w, bias), F.linear(x, w, bias))


@needs_kernels
def test_kernels_let_other_python_threads_run():
    """The kernels release the GIL: an expert worker's other gRPC threads (or an attention
    worker's dispatch thread) go on while one runs. The kernel runs on one torch thread, so a
    spinning Python thread has the other core; over >= 0.3 s of back-to-back kernel calls it must
    count at least a third of its free rate. Holding the GIL, a call of >= 20 ms would let it
    run one 5 ms switch interval per call at most (< 25 %)."""
    import threading
    import time

    S, H, I, T = 16, 512, 512, 256
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(S, 2 * I, H, generator=g), torch.randn(S, H, I, generator=g)
    slot = torch.stack([torch.randperm(S, generator=g)[:6] for _ in range(T)])
    x, weight = torch.randn(T, H, generator=g), torch.rand(T, 6, generator=g)
    spins, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            spins[0] += 1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kernel = cpp()._experts  # (the kernel itself, whatever the size rule would pick here)
    kernel(x, slot, weight, w13, w2, None, None, None, None)  # warm: the first call may build or load
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        before, t0 = spins[0], time.perf_counter()
        time.sleep(0.1)
        free_rate = (spins[0] - before) / (time.perf_counter() - t0)
        before, t0, call_s = spins[0], time.perf_counter(), []
        while time.perf_counter() - t0 < 0.3:
            t1 = time.perf_counter()
            kernel(x, slot, weight, w13, w2, None, None, None, None)
            call_s.append(time.perf_counter() - t1)
        elapsed = time.perf_counter() - t0
        during = spins[0] - before
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    assert min(call_s) > 0.02, call_s  # each call long enough to tell a held GIL
    assert during > elapsed * free_rate / 3, (during, free_rate, elapsed)
