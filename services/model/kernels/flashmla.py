"""FlashMLA (deepseek-ai/FlashMLA) as the decode attention of `model.mla_forward` on Hopper.

FlashMLA's dense decode kernel reads the paged latent cache in exactly our layout (`[blocks, 64,
1, 576]`, rows `[c_kv (512) | k_pe (64)]`, V = the first 512 channels of each row), so it drops in
behind the same call as the Triton split-KV kernel. It applies to DeepSeek-V3's bf16/fp16 cache on
an SM90 GPU; everything else (V3.2's wider rows with indexer keys, fp32, other GPUs, other widths)
goes to the Triton kernel. It is chosen (kernels/select.py, once per engine) when `import
flash_mla` works (built from source, docs/kernels.md), MOE_FLASH_MLA is not "0" and the model's
rows are V3's; a call that fails is logged and the family's next kernel takes over.

FlashMLA has published three APIs (../shared/reference/deepseek-v3.md, section 3.1); this call
works with all of them: `get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)` once per step
(Feb / Sep 2025: the split schedule as tensors; since Jan 2026 it ignores its arguments and the
schedule is computed on the first kernel call), shared by every layer of the step as FlashMLA's
README does, then `flash_mla_with_kvcache(q [b, 1, h, 576], cache, block_table int32,
cache_seqlens int32, 512, metadata, num_splits, softmax_scale=..., causal=True)` per layer. The
softmax scale is always passed: FlashMLA's default, 1/sqrt(576), is wrong for DeepSeek-V3.
"""

from __future__ import annotations

import torch

from services.model.kv_cache import BLOCK_SIZE

LATENT, ROPE = 512, 64  # the dense decode kernel's only row layout: head_size_k 576, head_size_v 512


def unsupported(dtype: torch.dtype, cache_dtype: torch.dtype, C: int, R: int, W: int) -> str | None:
    """Why FlashMLA's dense decode cannot take queries of `dtype` over `cache_dtype` rows of width
    W, latent C and rope R (None: it can)."""
    if (C, R) != (LATENT, ROPE):
        return f"V3's {LATENT} + {ROPE} latent rows only (this model: {C} + {R})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 / fp16 only ({dtype})"
    if cache_dtype != dtype:
        return f"a {cache_dtype} cache (FP8 rows: the Triton kernel reads them)"
    if W != LATENT + ROPE:
        return f"rows of {LATENT + ROPE} values only (this cache: {W}; V3.2's carry indexer keys)"
    return None


def mla_decode(q: torch.Tensor, cache: torch.Tensor, dec, latent_dim: int, scale: float) -> torch.Tensor:
    """q [B, N, C+R] (the absorbed latent query), cache [blocks, 64, 1, W], dec a batch.DecodeRows
    (its block table and context lengths; the step's schedule is kept in `dec.scratch`) -> o [B,
    N, C] in q's dtype, as triton_mla.mla_decode. ValueError where FlashMLA does not apply
    (`unsupported`: what selection checks; the GPU's SM90, gpu.flashmla_unavailable)."""
    import flash_mla  # (built from source where it runs; tests install a stand-in)

    B, N, D = q.shape
    problem = unsupported(q.dtype, cache.dtype, latent_dim, D - latent_dim, cache.shape[-1])
    if problem or tuple(cache.shape[1:3]) != (BLOCK_SIZE, 1) or cache.stride(-1) != 1:
        raise ValueError(f"FlashMLA: {problem or 'a cache not [blocks, 64, 1, W] with contiguous rows'}")
    step = dec.scratch.get("flashmla")
    if step is None or step[0] != N:  # once per step and head count (every layer shares it)
        lens, table = dec.lens.to(torch.int32), dec.table.to(torch.int32)
        metadata, splits = flash_mla.get_mla_metadata(lens, N, 1)
        step = dec.scratch["flashmla"] = (N, lens, table, metadata, splits)
    _, lens, table, metadata, splits = step
    o, _ = flash_mla.flash_mla_with_kvcache(
        q.contiguous()[:, None], cache, table, lens, latent_dim, metadata, splits,
        softmax_scale=scale, causal=True,
    )  # fmt: skip
    return o[:, 0]
