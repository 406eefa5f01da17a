"""The Triton kernels on a GPU at DeepSeek-V3 shapes (needs CUDA and triton; exits otherwise).

- MLA decode (services/model/triton_mla.py): 128 heads, 576-wide latent rows (512 + 64 rope),
  bf16 paged cache, B sequences of `--context` tokens each. Reported as the bandwidth of reading
  the cache rows (the bytes that must move) against this GPU's measured device-to-device copy
  bandwidth and its nominal peak; beside it the torch path (gather + two bmm) and FlashMLA when
  it is installed.
- Fused MoE (services/model/triton_moe.py): hidden 7168, intermediate 2048, top-8 over
  `--slots` experts on one worker, bf16 and block-FP8 weights, against torch's grouped_mm path
  (layers.grouped_expert_ffn) on the same tokens.
- RMSNorm (services/model/triton_norm.py) at [tokens, 7168] against the torch ops.
- The MLA latent's per-token work (triton_mla.latent_to_cache) against the unfused ops, both
  replayed from CUDA graphs.
- FP8 linears (services/model/triton_linear.py, `keep_fp8_linears`) at V3's MLA shapes against
  cuBLAS on the bf16 weights.

    python -m benchmarks.bench_kernels [--out benchmarks/results/kernels_<gpu>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

NOMINAL_TBPS = {
    "H100 80GB HBM3": 3.35,
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "H200": 4.8,
    "A100-SXM4-80GB": 2.04,
}


def timed_ms(fn, reps: int = 50) -> float:
    """Median milliseconds of fn() over `reps` runs, timed with CUDA events after 5 warm-ups."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (TB/s)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / ms / 1e9


def nominal_tbps() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in NOMINAL_TBPS.items() if k in name), None)


def bench_mla(batch: int, context: int, heads: int = 128, C: int = 512, R: int = 64) -> dict:
    from services.model import triton_mla

    blocks = context // 64
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(batch * blocks, 64, 1, C + R, device="cuda", generator=g).bfloat16()
    table = torch.randperm(batch * blocks, device="cuda", generator=g).view(batch, blocks).int()
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, C + R, device="cuda", generator=g).bfloat16()
    scale = 0.1352338
    moved = cache.numel() * cache.element_size() + 2 * q.numel() * 2  # cache rows, q in, o out (~)
    row = {"batch": batch, "context": context, "heads": heads, "bytes": moved}

    def torch_path():
        ctx = cache[table.long()].view(batch, -1, C + R)
        probs = (torch.bmm(q, ctx.transpose(1, 2)).float() * scale).softmax(-1).to(q.dtype)
        return torch.bmm(probs, ctx[..., :C])

    ref = torch_path()
    out = triton_mla.mla_decode(q, cache, table, lens, C, scale)
    row["max_abs_diff_vs_torch"] = (out.float() - ref.float()).abs().max().item()
    for name, fn in (("triton", lambda: triton_mla.mla_decode(q, cache, table, lens, C, scale)),
                     ("torch", torch_path)):  # fmt: skip
        ms = timed_ms(fn)
        row[f"{name}_ms"], row[f"{name}_tbps"] = ms, moved / ms / 1e9
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata

        meta, splits = get_mla_metadata(lens, heads, 1)
        fn = lambda: flash_mla_with_kvcache(q[:, None], cache, table, lens, C, meta, splits,  # noqa: E731
                                            softmax_scale=scale, causal=True)  # fmt: skip
        ms = timed_ms(fn)
        row["flashmla_ms"], row["flashmla_tbps"] = ms, moved / ms / 1e9
    except ImportError:
        row["flashmla"] = "not installed"
    except Exception as e:  # another FlashMLA version's API
        row["flashmla"] = f"{type(e).__name__}: {e}"
    return row


def graphed_ms(fn) -> float:
    """fn replayed from a CUDA graph (as a decode step runs it): median ms per replay."""
    fn()  # (compiles the Triton kernels outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed_ms(graph.replay)


def bench_latent(tokens: int, heads: int = 128, C: int = 512, R: int = 64, D: int = 128) -> dict:
    """An MLA layer's per-token work at V3's shapes (latent RMSNorm, rope of k_pe and of the
    heads' q_pe, the cache write): triton_mla.latent_to_cache against the ops of the unfused path
    (model.mla_forward: the Triton RMSNorm, Rope.apply's torch ops, cat and index write), both
    replayed from CUDA graphs."""
    from services.model import triton_mla
    from services.model.layers import rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(tokens, C + R, device="cuda", generator=g).bfloat16()
    q = torch.randn(tokens, heads, D + R, device="cuda", generator=g).bfloat16()
    norm = torch.rand(C, device="cuda", generator=g).bfloat16()
    angles = torch.rand(tokens, R // 2, device="cuda", generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cache = torch.zeros(max(4, tokens), 64, 1, C + R, device="cuda").bfloat16()
    slots = torch.randperm(cache.shape[0] * 64, device="cuda", generator=g)[:tokens]

    def rope(x):  # Rope.apply, interleaved
        c, s = (
            cos.view(tokens, *(1,) * (x.dim() - 2), R // 2),
            sin.view(tokens, *(1,) * (x.dim() - 2), R // 2),
        )
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)

    def unfused():
        cache.view(-1, C + R)[slots] = torch.cat((rms_norm(kv[:, :C], norm, 1e-6), rope(kv[:, C:])), dim=-1)
        return rope(q[..., D:])

    def fused():
        return triton_mla.latent_to_cache(kv, q[..., D:], norm, cos, sin, slots, cache, True, 1e-6)

    q_pe = unfused()
    want = cache.view(-1, C + R)[slots].clone()
    row = {"tokens": tokens, "heads": heads, "q_pe_equal": torch.equal(fused(), q_pe)}
    row["cache_rows_max_abs_diff"] = (cache.view(-1, C + R)[slots].float() - want.float()).abs().max().item()
    row["fused_ms"], row["unfused_ms"] = graphed_ms(fused), graphed_ms(unfused)
    return row


def bench_moe(tokens: int, slots: int, H: int = 7168, I: int = 2048, top_k: int = 8) -> dict:
    from services.model import triton_moe
    from services.model.checkpoint import quantize_fp8_blocks
    from services.model.layers import grouped_expert_ffn

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(slots, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(slots, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    slot = torch.rand(tokens, slots, device="cuda", generator=g).topk(min(top_k, slots), -1).indices
    weight = torch.rand(slot.shape, device="cuda", generator=g)
    row = {"tokens": tokens, "slots": slots, "hidden": H, "intermediate": I, "top_k": slot.shape[1]}
    busy = slot.unique().numel()
    moved = busy * 3 * H * I * 2  # the busy experts' bf16 weights: the floor at decode sizes
    ref = grouped_expert_ffn(x, slot, weight, w13, w2)
    out = triton_moe.fused_moe(x, slot, weight, w13, w2)
    row["max_abs_diff_vs_grouped_mm"] = (out.float() - ref.float()).abs().max().item()
    for name, fn in (("triton_bf16", lambda: triton_moe.fused_moe(x, slot, weight, w13, w2)),
                     ("grouped_mm_bf16", lambda: grouped_expert_ffn(x, slot, weight, w13, w2))):  # fmt: skip
        ms = timed_ms(fn, reps=20)
        row[f"{name}_ms"], row[f"{name}_weight_tbps"] = ms, moved / ms / 1e9
    q13, s13 = zip(*(quantize_fp8_blocks(w, (128, 128)) for w in w13.float()), strict=True)
    q2, s2 = zip(*(quantize_fp8_blocks(w, (128, 128)) for w in w2.float()), strict=True)
    q13, s13, q2, s2 = (torch.stack(t) for t in (q13, s13, q2, s2))
    fp8 = lambda: triton_moe.fused_moe(x, slot, weight, q13, q2, w13_scale=s13, w2_scale=s2)  # noqa: E731
    ms = timed_ms(fp8, reps=20)
    row["triton_fp8_ms"], row["triton_fp8_weight_tbps"] = ms, moved / 2 / ms / 1e9
    return row


V3_LINEARS = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "o": (7168, 16384)}  # [N, K]


def bench_fp8_linear(tokens: int, name: str) -> dict:
    """A DeepSeek-V3 MLA linear kept FP8 (triton_linear.fp8_linear, bf16 activations) against
    cuBLAS on the bf16 weight; bandwidth of reading the weight (the floor at decode sizes)."""
    from services.model import triton_linear
    from services.model.checkpoint import quantize_fp8_blocks

    N, K = V3_LINEARS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    q, scale = (t.cuda() for t in quantize_fp8_blocks(w.float().cpu(), (128, 128)))
    x = torch.randn(tokens, K, device="cuda", generator=g).bfloat16()
    fp8 = lambda: triton_linear.fp8_linear(x, q, scale, (128, 128))  # noqa: E731
    row = {"linear": name, "tokens": tokens, "out": N, "in": K}
    row["max_abs_diff_vs_bf16"] = (
        (fp8().float() - torch.nn.functional.linear(x, w).float()).abs().max().item()
    )
    for label, fn, nbytes in (("triton_fp8", fp8, N * K), ("cublas_bf16", lambda: x @ w.T, 2 * N * K)):
        ms = timed_ms(fn)
        row[f"{label}_ms"], row[f"{label}_weight_tbps"] = ms, nbytes / ms / 1e9
    return row


def bench_norm(tokens: int, H: int = 7168) -> dict:
    from services.model import triton_norm

    x = torch.randn(tokens, H, device="cuda").bfloat16()
    w = torch.randn(H, device="cuda").bfloat16()

    def torch_path():
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    return {"tokens": tokens, "triton_ms": timed_ms(lambda: triton_norm.rms_norm(x, w, 1e-6)),
            "torch_ms": timed_ms(torch_path)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=32, help="experts held by one expert worker")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA device (and triton: pip install -e '.[gpu]')")
    os.environ.setdefault("MOE_TRITON", "1")
    name = torch.cuda.get_device_name()
    result = {
        "device": name,
        "torch": torch.__version__,
        "copy_tbps": copy_bandwidth_tbps(),
        "nominal_tbps": nominal_tbps(),
        "mla_decode": [bench_mla(b, args.context) for b in (1, 8, 64)],
        "fused_moe": [bench_moe(t, args.slots) for t in (1, 8, 64, 512)],
        "rms_norm": [bench_norm(t) for t in (1, 64, 4096)],
        "mla_latent": [bench_latent(t) for t in (1, 64)],
        "fp8_linear": [bench_fp8_linear(t, n) for n in V3_LINEARS for t in (1, 64, 512)],
    }
    for row in result["mla_decode"]:
        row["triton_vs_copy"] = row["triton_tbps"] / result["copy_tbps"]
        if result["nominal_tbps"]:
            row["triton_vs_nominal"] = row["triton_tbps"] / result["nominal_tbps"]
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or Path("benchmarks/results") / f"kernels_{name.replace(' ', '_')}.json"
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
