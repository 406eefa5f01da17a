"""A small-batch fp32 linear for CPU decode, where torch's (MKL's) is slow.

At decode sizes a linear is a weight read: x [M <= 8, K] against w [N, K]. MKL runs those
matrix-vector products on one thread here (10-11 GB/s from memory on this box whatever
torch's thread count, against ~17-20 GB/s with both cores reading) and gets slower per byte
as M grows past 1. This kernel streams each weight row once, dots it with every x row while it
sits in L1, and splits the rows of w over torch's intra-op threads: 1.3-1.8x MKL for M <= 8
on 512-wide experts (benchmarks in the #21 note). Every output is one row's dot product in a
fixed order (no FMA contraction, which the compiler would apply differently to the 4-row and
the 1-row loop), so a token's result does not depend on how many rows share the call.

The extension is compiled on first use with torch.utils.cpp_extension (a C++ compiler and
ninja; ~40 s once, cached under $MOE_CLUSTER_CACHE/torch_extensions). Without them, or with
MOE_CPU_KERNELS=0, `linear` is F.linear.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 8  # beyond this MKL's blocked GEMM wins

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld(const float* p) { v8 v; __builtin_memcpy(&v, p, 32); return v; }
static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]); K % 8 == 0, fp32, contiguous.
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* wr = wp + n * K;
      const float b = bp ? bp[n] : 0.0f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {  // four x rows per weight load; the same order as one row alone
        const float *x0 = xp + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t k = 0; k < K; k += 8) {
          const v8 wv = ld(wr + k);
          a0 += ld(x0 + k) * wv; a1 += ld(x1 + k) * wv; a2 += ld(x2 + k) * wv; a3 += ld(x3 + k) * wv;
        }
        yp[m * N + n] = hsum(a0) + b; yp[(m + 1) * N + n] = hsum(a1) + b;
        yp[(m + 2) * N + n] = hsum(a2) + b; yp[(m + 3) * N + n] = hsum(a3) + b;
      }
      for (; m < M; ++m) {
        const float* xr = xp + m * K;
        v8 a = {0};
        for (int64_t k = 0; k < K; k += 8) a += ld(xr + k) * ld(wr + k);
        yp[m * N + n] = hsum(a) + b;
      }
    }
  });
  return y;
}
"""

_lock = threading.Lock()
_state: dict = {}  # "op": the compiled function, or None when unavailable


def _op():
    if "op" in _state:
        return _state["op"]
    with _lock:
        if "op" not in _state:
            _state["op"] = _build()
    return _state["op"]


def _build():
    if os.environ.get("MOE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        from .presets import cache_root

        build_dir = (
            cache_root() / "torch_extensions" / f"small_linear_torch{torch.__version__.replace('+', '_')}"
        )
        build_dir.mkdir(parents=True, exist_ok=True)
        module = load_inline("moe_small_linear", cpp_sources=_SOURCE, functions=["small_linear"],
                             extra_cflags=["-O3", "-march=native", "-ffp-contract=off"], build_directory=str(build_dir))  # fmt: skip
        return module.small_linear
    except Exception as e:  # no compiler, no ninja, an unsupported CPU: torch's own linear
        log.warning("CPU small-batch linear unavailable (%s: %s); using F.linear", type(e).__name__, e)
        return None


def available() -> bool:
    """Whether the kernel is built (building it on first call)."""
    return _op() is not None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias); x [M, K] with M <= MAX_ROWS, fp32 on CPU, goes through the kernel."""
    if (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.shape[1] % 8 == 0
        and (bias is None or bias.dtype == torch.float32)
    ):
        op = _op()
        if op is not None:
            return op(x.contiguous(), w.contiguous(), bias)
    return F.linear(x, w, bias)
