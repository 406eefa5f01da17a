"""RMSNorm in Triton: one program per row (torch_ops.rms_norm's math: in fp32, cast to x's dtype,
then times the weight, as transformers' DeepseekV3RMSNorm), optionally after adding a sublayer's
output to the residual stream (torch_ops.add_rms_norm, as vLLM's fused_add_rms_norm)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, delta_ptr, w_ptr, y_ptr, sum_ptr, K, stride_x, eps, HAS_DELTA: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
    """y[row] = w * cast(x[row] * rsqrt(mean(x[row]^2) + eps)) for row = program id; HAS_DELTA:
    x[row] = cast(x[row] + delta[row]) first, stored to sum[row]."""
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    ok = k < K
    x = tl.load(x_ptr + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:  # (the sum in fp32, rounded once: a bf16 add's bits)
        x += tl.load(delta_ptr + row * K + k, mask=ok, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * K + k, x, mask=ok)
        x = x.to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, 0) / K + eps)).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + k, mask=ok, other=0.0).to(tl.float32)
    # (the product in fp32, rounded once: a bf16 multiply's bits, also under triton's interpreter,
    # which multiplies bf16 values' raw bits)
    tl.store(y_ptr + row * K + k, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] (last dim contiguous; rows may be strided), weight [K] -> [..., K] in x's dtype."""
    K = x.shape[-1]
    rows = x.reshape(-1, K) if x.stride(-1) == 1 else x.contiguous().view(-1, K)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm[(rows.shape[0],)](rows, rows, weight, y, y, K, rows.stride(0), eps, HAS_DELTA=False,
                                    BLOCK=triton.next_power_of_2(K))  # fmt: skip
    return y.view(x.shape)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, K] of one dtype -> (h + delta, rms_norm(h + delta)) in one launch (ValueError
    for other shapes or mixed dtypes)."""
    if h.dim() != 2 or h.shape != delta.shape or h.dtype != delta.dtype:
        raise ValueError(
            f"add_rms_norm: h {h.dtype} {list(h.shape)}, delta {delta.dtype} {list(delta.shape)}"
        )
    h = h if h.stride(-1) == 1 else h.contiguous()
    T, K = h.shape
    delta = delta.contiguous()
    total, y = (
        torch.empty(T, K, dtype=h.dtype, device=h.device),
        torch.empty(T, K, dtype=h.dtype, device=h.device),
    )
    if T:
        _rms_norm[(T,)](h, delta, weight, y, total, K, h.stride(0), eps, HAS_DELTA=True,
                        BLOCK=triton.next_power_of_2(K))  # fmt: skip
    return total, y
