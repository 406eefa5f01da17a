"""The GPU kernels as kernel-family implementations: `TritonKernels` (our Triton kernels in
`triton_mla`: MLA decode over the paged latent cache and the latent's per-token work;
`triton_moe`: the routed experts' fused MoE; `triton_norm`: RMSNorm; `triton_linear`: linears
with weights kept FP8) and `FlashMLAKernels` (DeepSeek's FlashMLA, built from source,
docs/kernels.md, for decode attention on Hopper: `flashmla`). select.py decides once per
(device, dtype, model) which of them run, from `triton_unavailable` / `flashmla_unavailable`
and each family's static checks, and binds their methods.

A CPU install never imports triton: the Triton modules import it at the top (`triton.jit`
reads TRITON_INTERPRET when a kernel is defined) and are imported here only when a
`TritonKernels` is made, which selection does only where `import triton` works. On CPU tensors
the Triton kernels run only when asked for by name (`kernels="triton,..."`) under
TRITON_INTERPRET=1 (triton's interpreter, which is how CI tests them; far too slow to serve);
FlashMLA on CPU tensors only when asked for by name (tests, with a torch stand-in for the
library). Each kernel has a torch reference it is tested against (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import os

import torch

TL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton kernels compute in


def triton_unavailable(device: torch.device, asked: bool) -> str | None:
    """Why the Triton kernels cannot run on `device` (None: they can). asked: named in the
    engine's `kernels` (else chosen by default: CUDA only, unless MOE_TRITON=0)."""
    if not asked and os.environ.get("MOE_TRITON") == "0":
        return "MOE_TRITON=0"
    if device.type != "cuda":
        if not asked:
            return (
                "CPU tensors (Triton runs on the CPU only under TRITON_INTERPRET=1, when asked for by name)"
            )
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need TRITON_INTERPRET=1 (triton's interpreter)"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton not installed ({e})"
    return None


def flashmla_unavailable(device: torch.device, asked: bool) -> str | None:
    """Why FlashMLA cannot run on `device` (None: it can): `import flash_mla` must work (built
    from source, docs/kernels.md); on CUDA by default unless MOE_FLASH_MLA=0, on the CPU only when
    asked for by name (a test's stand-in); its dense decode kernel needs an SM90 GPU."""
    if not asked and os.environ.get("MOE_FLASH_MLA") == "0":
        return "MOE_FLASH_MLA=0"
    if device.type != "cuda" and not asked:
        return "CPU tensors (FlashMLA runs on Hopper GPUs)"
    try:
        import flash_mla  # noqa: F401
    except ImportError as e:
        return f"flash_mla not installed ({e}; built from source: docs/kernels.md)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        major, minor = torch.cuda.get_device_capability(device)
        return f"needs SM90 (this GPU: SM{major}{minor})"
    return None


class TritonKernels:
    """Our Triton kernels as kernel-family implementations (`kernels`: the select.Kernels they
    are bound into, whose other choices the prefill's absorbed products use). `interleave`: the
    model's rope layout (the latent kernel's). `deterministic`: their batch-invariant variants
    (kernels/deterministic.py; RMSNorm and the latent's kernel are one program per row anyway),
    and the batch-invariant GEMMs `linear` / `absorb_q` / `absorb_o` (bound by deterministic.bind)."""

    def __init__(self, kernels, interleave: bool = True, deterministic: bool = False):
        from . import triton_linear, triton_mla, triton_moe, triton_norm

        self.k, self.interleave, self.deterministic = kernels, interleave, deterministic
        self._mla, self._moe, self._norm, self._linear = triton_mla, triton_moe, triton_norm, triton_linear

    def mla_decode(self, q, cache, dec, C: int, scale: float):
        """Absorbed MLA decode over each row's paged context (`triton_mla.mla_decode`)."""
        return self._mla.mla_decode(q, cache, dec.table, dec.lens, C, scale, deterministic=self.deterministic)

    def sparse_decode(self, q, cache, rows, count, C: int, scale: float):
        """V3.2's decode over each row's chosen cache rows (`triton_mla.mla_decode` with rows)."""
        return self._mla.mla_decode(
            q, cache, None, count, C, scale, rows=rows, deterministic=self.deterministic
        )

    def mla_prefill(self, q_nope, q_pe, cache, blocks, L: int, kv_b, C: int, scale: float):
        """Causal MLA of one sequence's prefill chunk on the decode kernel: q_nope [n, N, D], q_pe
        [n, N, R] (positions L-n .. L-1), the context's `blocks` [ceil(L / 64)] -> [n, N, V]. Each
        query is a decode row of its own causal length over the same blocks, in the absorbed form:
        ~3.4x the multiply-adds of the expanded form at V3's dims, but no per-head K/V at all; its
        scratch is the chunk's [n, N, C+R] queries and [n, N, C] outputs, whatever the context. On
        an H200 at V3's heads (bench_mla_prefill, 2,048-query chunk) 16-20x torch_ops.
        prefill_attention's time."""
        n = q_nope.shape[0]
        q_full = torch.cat((self.k.absorb_q(q_nope, kv_b), q_pe), dim=-1)  # [n, N, C+R]
        lens = torch.arange(L - n + 1, L + 1, device=q_nope.device, dtype=torch.int32)
        o_lat = self._mla.mla_decode(q_full, cache, blocks[None].expand(n, -1), lens, C, scale,
                                     deterministic=self.deterministic)  # fmt: skip
        return self.k.absorb_o(o_lat, kv_b, q_nope.shape[-1])

    def latent_to_cache(self, kv, q_pe, norm_weight, cos, sin, slot_mapping, cache, eps: float, extra=None):
        """An MLA layer's latent norm, ropes and cache write in one launch
        (`triton_mla.latent_to_cache`; selection leaves V3.2's rows, extra, to torch)."""
        return self._mla.latent_to_cache(
            kv, q_pe, norm_weight, cos, sin, slot_mapping, cache, self.interleave, eps
        )

    def rms_norm(self, x, weight, eps: float):
        """RMSNorm of x's rows (`triton_norm.rms_norm`)."""
        return self._norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps: float):
        """(h + delta, RMSNorm of it) in one launch (`triton_norm.add_rms_norm`)."""
        return self._norm.add_rms_norm(h, delta, weight, eps)

    def expert_ffn(self, x, slot, weight, w13, w2, out=None, swiglu_limit=None, w13_scale=None, w2_scale=None,
                   fp8_block=None):  # fmt: skip
        """A layer's routed experts, bf16 / fp32 or block-FP8 weights (`triton_moe.fused_moe`)."""
        det = self.deterministic
        if w13_scale is None:
            return self._moe.fused_moe(x, slot, weight, w13, w2, swiglu_limit, out=out, deterministic=det)
        return self._moe.fused_moe(
            x, slot, weight, w13, w2, swiglu_limit, w13_scale, w2_scale, fp8_block, out=out, deterministic=det
        )

    def fp8_linear(self, x, w, bias=None):
        """y = x @ W^T (+ bias) with W kept FP8 (`triton_linear.fp8_linear`)."""
        return self._linear.fp8_linear(x, w.weight, w.scale, w.block, bias, deterministic=self.deterministic)

    # ---- the batch-invariant GEMMs (deterministic kernels only) ---------------------------------
    def linear(self, x, w, bias=None):
        """F.linear(x, w, bias), batch-invariant (`triton_linear.linear`)."""
        return self._linear.linear(x, w, bias)

    def absorb_q(self, q_nope, kv_b):
        """torch_ops.absorb_q batch-invariant: q_nope [T, N, D] @ W_UK (kv_b [N, D+V, C]) ->
        [T, N, C], one GEMM per head (`triton_linear.batched_linear`, the heads its batch axis)."""
        D = q_nope.shape[-1]
        y = self._linear.batched_linear(q_nope.transpose(0, 1), kv_b[:, :D].transpose(1, 2))  # [N, T, C]
        return y.transpose(0, 1)

    def absorb_o(self, o_lat, kv_b, D: int):
        """torch_ops.absorb_o batch-invariant: o_lat [T, N, C] through W_UV (kv_b [N, D+V, C], its
        rows from D on) -> [T, N, V], one GEMM per head."""
        return self._linear.batched_linear(o_lat.transpose(0, 1), kv_b[:, D:]).transpose(0, 1)


class FlashMLAKernels:
    """DeepSeek's FlashMLA (services/model/kernels/flashmla.py)."""

    def __init__(self, kernels=None):
        from . import flashmla

        self.k, self._flashmla = kernels, flashmla

    def mla_decode(self, q, cache, dec, C: int, scale: float):
        """V3's dense decode attention (`flashmla.mla_decode`)."""
        return self._flashmla.mla_decode(q, cache, dec, C, scale)
