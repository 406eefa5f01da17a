"""The Triton fused MoE (services/model/kernels/triton_moe.py) against the routed experts' torch
implementation (kernels/torch_ops.expert_ffn). Without a GPU it runs under triton's interpreter on
CPU tensors (TRITON_INTERPRET=1), on small shapes."""

import os

import pytest
import torch

pytest.importorskip("triton")

from services.model.fp8 import dequantize_fp8_blocks
from services.model.kernels import hardware, triton_moe
from services.model.kernels.torch_ops import expert_ffn as grouped_expert_ffn


@pytest.fixture
def moe():
    """(the triton_moe module, device). On CPU: the interpreter. The reference, grouped_expert_ffn,
    is the torch implementation."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"  # (set by conftest.py)
    return triton_moe, device


def routing(T, K, S, seed=0, skip=0.2, idle=()):
    """slot [T, K] int64 (about `skip` of the choices -1, none on the slots in `idle`) and weight
    [T, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    busy = torch.tensor([s for s in range(S) if s not in idle])
    slot = busy[torch.randint(0, len(busy), (T, K), generator=g)]
    slot[torch.rand(T, K, generator=g) < skip] = -1
    return slot, torch.rand(T, K, generator=g)


def experts(S, H, I, seed=1):
    """w13 [S, 2I, H], w2 [S, H, I] fp32, scaled so the outputs are O(1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, 2 * I, H, generator=g) / H**0.5, torch.randn(S, H, I, generator=g) / I**0.5


def inputs(T, K, S, H, I, device, dtype=torch.float32, seed=0, **kw):
    slot, weight = routing(T, K, S, seed, **kw)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 7))
    w13, w2 = experts(S, H, I, seed + 1)
    return [t.to(device) for t in (x.to(dtype), slot, weight, w13.to(dtype), w2.to(dtype))]


@pytest.mark.parametrize(
    "T, K, S, H, I, limit",
    [
        (1, 2, 4, 64, 32, None),  # decode: one token
        (5, 3, 6, 96, 48, None),  # H, I not multiples of the 64-wide tiles
        (33, 2, 5, 64, 48, 0.5),  # clamped SwiGLU (the limit bites at this scale)
        (40, 3, 4, 96, 32, None),  # > 16 pairs per slot: 64-row M-blocks
    ],
)
def test_fused_moe_matches_torch(moe, T, K, S, H, I, limit):
    mod, device = moe
    x, slot, weight, w13, w2 = inputs(T, K, S, H, I, device, idle=(1,))  # slot 1 gets no tokens
    y = mod.fused_moe(x, slot, weight, w13, w2, swiglu_limit=limit)
    assert y.shape == (T, H) and y.dtype == x.dtype
    ref = grouped_expert_ffn(x.cpu(), slot.cpu(), weight.cpu(), w13.cpu(), w2.cpu(), swiglu_limit=limit)
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_fused_moe_strided_inputs_and_out(moe):
    """x and w13 as views into wider tensors; the result written into `out` (fp32 and bf16)."""
    mod, device = moe
    T, K, S, H, I = 6, 2, 3, 64, 32
    x, slot, weight, w13, w2 = inputs(T, K, S, H, I, device, seed=3)
    wide_x = torch.zeros(T, H + 16, device=device)
    wide_x[:, 8 : 8 + H] = x
    wide_w13 = torch.zeros(S, 2 * I, H + 32, device=device)
    wide_w13[..., :H] = w13
    ref = grouped_expert_ffn(x.cpu(), slot.cpu(), weight.cpu(), w13.cpu(), w2.cpu())
    out = torch.full((T, H), float("nan"), device=device)
    y = mod.fused_moe(wide_x[:, 8 : 8 + H], slot, weight, wide_w13[..., :H], w2, out=out)
    assert y is out
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    out16 = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    assert mod.fused_moe(x, slot, weight, w13, w2, out=out16) is out16
    torch.testing.assert_close(out16.cpu(), ref.bfloat16())


def test_fused_moe_all_skipped(moe):
    mod, device = moe
    x, slot, weight, w13, w2 = inputs(4, 2, 3, 64, 32, device, skip=1.0)
    out = torch.full((4, 64), float("nan"), device=device)
    assert torch.equal(mod.fused_moe(x, slot, weight, w13, w2, out=out).cpu(), torch.zeros(4, 64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_half(moe, dtype):
    mod, device = moe
    x, slot, weight, w13, w2 = inputs(9, 2, 4, 96, 48, device, dtype=dtype, seed=5)
    y = mod.fused_moe(x, slot, weight, w13, w2, swiglu_limit=0.7)
    assert y.dtype == dtype
    ref = grouped_expert_ffn(x.cpu().float(), slot.cpu(), weight.cpu(), w13.cpu().float(), w2.cpu().float(),
                             swiglu_limit=0.7)  # fmt: skip
    torch.testing.assert_close(y.cpu().float(), ref, rtol=3e-2, atol=3e-2)


def fp8_experts(S, H, I, block, seed=2):
    """FP8 w13 [S, 2I, H], w2 [S, H, I] with random per-block scales (DeepSeek's weight_scale_inv),
    and their dequantised fp32 values."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    out = []
    for rows, cols in ((2 * I, H), (H, I)):
        q = (torch.randn(S, rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        shape = (S, -(-rows // bn), -(-cols // bk))
        scale = (torch.rand(shape, generator=g) + 0.25) / (100 * cols**0.5)  # 4x spread between blocks
        real = torch.stack([dequantize_fp8_blocks(q[s], scale[s], block) for s in range(S)])
        out += [q, scale, real]
    return out


@pytest.mark.parametrize(
    "T, H, I, block, dtype",
    [
        (7, 72, 40, (32, 32), torch.float32),  # up rows start mid-block; partial blocks in H and I
        (3, 64, 48, (128, 128), torch.float32),  # one quantisation block per weight
        (12, 80, 56, (32, 32), torch.bfloat16),
    ],
)
@pytest.mark.parametrize("native", [True, False], ids=["e4m3", "uint8 bits"])
def test_fused_moe_fp8_blocks(moe, monkeypatch, T, H, I, block, dtype, native):
    """FP8 experts with their block scales: as e4m3 (sm_89+) and as uint8 bytes converted with
    integer ops (GPUs without e4m3: A100)."""
    mod, device = moe
    monkeypatch.setattr(hardware, "fp8_native", lambda t: native)
    K, S = 2, 4
    w13, s13, w13_real, w2, s2, w2_real = fp8_experts(S, H, I, block)
    slot, weight = routing(T, K, S, seed=4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    args = [t.to(device) for t in (x, slot, weight, w13, w2)]
    y = mod.fused_moe(*args, w13_scale=s13.to(device), w2_scale=s2.to(device), block_shape=block)
    ref = grouped_expert_ffn(x.float(), slot, weight, w13_real, w2_real)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.cpu().float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("T, K, S, skip", [(1, 2, 4, 0.0), (33, 3, 5, 0.3), (50, 2, 3, 0.1), (4, 2, 3, 1.0)])
def test_align_pairs(moe, T, K, S, skip, block_m):
    """Every valid pair appears once, in its slot's blocks, in order; padding and idle blocks hold
    the sentinel; block_slot is -1 only after the busy blocks."""
    mod, device = moe
    slot, _ = routing(T, K, S, seed=T, skip=skip, idle=(S - 1,))
    P = T * K
    sorted_pair, block_slot = (t.cpu() for t in mod.align_pairs(slot.to(device), S, block_m))
    assert sorted_pair.numel() % block_m == 0 and block_slot.numel() == sorted_pair.numel() // block_m
    valid = sorted_pair[sorted_pair < P]
    assert torch.equal(valid.sort().values, torch.nonzero(slot.reshape(-1) >= 0).squeeze(1))
    busy = block_slot >= 0
    assert torch.equal(busy, torch.arange(busy.numel()) < busy.sum())  # the busy blocks come first
    assert torch.all(block_slot[busy].diff() >= 0)
    assert torch.all(slot.reshape(-1)[valid].diff() >= 0)  # grouped by slot, stable within a slot:
    assert torch.all((slot.reshape(-1)[valid].diff() > 0) | (valid.diff() > 0))
    for b, s in enumerate(block_slot.tolist()):
        rows = sorted_pair[b * block_m : (b + 1) * block_m]
        pairs = rows[rows < P]
        if s < 0:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and torch.all(slot.reshape(-1)[pairs] == s)


def test_fused_moe_long_batches_run_in_token_chunks(moe, monkeypatch):
    mod, device = moe
    monkeypatch.setattr(mod, "MAX_PAIRS", 8)  # 21 tokens x 2 choices: chunks of 4 tokens
    x, slot, weight, w13, w2 = inputs(21, 2, 4, 64, 32, device, seed=5)
    out = torch.full((21, 64), float("nan"), device=device)
    assert mod.fused_moe(x, slot, weight, w13, w2, out=out) is out
    ref = grouped_expert_ffn(x.cpu(), slot.cpu(), weight.cpu(), w13.cpu(), w2.cpu())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_fused_moe_refuses_fp8_weights_without_scales(moe):
    mod, device = moe
    x, slot, weight, w13, w2 = inputs(3, 2, 4, 64, 32, device)
    with pytest.raises(ValueError, match="FP8 scales"):
        mod.fused_moe(x, slot, weight, w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn))
