"""RMSNorm in Triton: one program per row (layers.rms_norm's math: in fp32, cast to x's dtype,
then times the weight, as transformers' DeepseekV3RMSNorm)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, K, stride_x, eps, BLOCK: tl.constexpr):
    """y[row] = w * cast(x[row] * rsqrt(mean(x[row]^2) + eps)) for row = program id."""
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    ok = k < K
    x = tl.load(x_ptr + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
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
        _rms_norm[(rows.shape[0],)](rows, weight, y, K, rows.stride(0), eps, BLOCK=triton.next_power_of_2(K))
    return y.view(x.shape)
