"""MLA prefill attention at DeepSeek-V3's head shapes on a GPU: time and scratch memory.

One sequence's last prefill chunk (`--chunk` queries at the end of an L-token context held in the
paged bf16 latent cache), 128 heads, c_kv 512 + rope 64, q/k nope 128, v 128; three ways:

- `tiled`: torch_ops.prefill_attention, the torch implementation of the `mla_prefill` kernel
  family (the engine's where Triton is not chosen, e.g. on the CPU: key tiles expanded to per-head
  K/V one at a time, query tiles, online softmax): its scratch is a few tiles however long the
  context.
- `absorbed`: the Triton implementation (gpu.TritonKernels.mla_prefill), the engine's on a GPU,
  as `select_kernels(..., allow="triton,torch")` binds it at V3's shapes (`Kernels.mla_prefill`;
  the absorbed products with kv_b are torch's there, as in an engine on a GPU): the Triton decode
  kernel (triton_mla.mla_decode) with one row per query, each query's own causal length over the
  same block table: absorbed queries (q_nope @ W_UK | q_pe) against the latent rows, then W_UV; no
  expansion at all, ~3.4x the multiply-adds of the expanded form. A row whose kernel failed (and
  whose family moved on to torch) records the error instead of a time.
- `dense`: torch's scaled_dot_product_attention on the whole context's expanded K/V with a
  causal (lower-right) mask: the speed a user gets from a fused attention when memory allows it,
  and the scratch that costs (skipped where it would need more than --dense-max-gib).

Each row: milliseconds (CUDA events, median of a few runs), peak memory allocated during the call
beyond what was held before it, and the largest difference from `tiled`. The JSON's `kernels`:
the family's implementation an engine of V3's shapes in bf16 on this GPU would run ("auto").

    python -m benchmarks.bench_mla_prefill [--lengths 4096,16384,32768] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.bench_kernels import chosen_kernels, v3_config

N, C, R, D, V = 128, 512, 64, 128, 128


def measure(fn, reps: int = 3) -> tuple[float, int, torch.Tensor]:
    """(median ms over `reps` after one warm-up, peak bytes allocated beyond the start, output)."""
    out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        del out
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() - base
    return sorted(times)[len(times) // 2], peak, out


def bench(L: int, n: int, dense_max_gib: float) -> list[dict]:
    from services.model.kernels import torch_ops, triton_mla
    from services.model.kernels.select import select_kernels
    from services.model.kv_cache import BLOCK_SIZE

    g = torch.Generator(device="cuda").manual_seed(0)
    nb = -(-L // BLOCK_SIZE)
    cache = (torch.randn(nb + 7, BLOCK_SIZE, 1, C + R, device="cuda", generator=g) * 0.5).bfloat16()
    blocks = torch.randperm(nb + 7, device="cuda", generator=g)[:nb]
    kv_b = (torch.randn(N, D + V, C, device="cuda", generator=g) / C**0.5).bfloat16()
    q = torch.randn(n, N, D + R, device="cuda", generator=g).bfloat16()
    scale = (D + R) ** -0.5
    rows = []

    def tiled():
        return torch_ops.prefill_attention(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, scale)

    ms, peak, ref = measure(tiled)
    rows.append({"method": "tiled", "ms": ms, "peak_bytes": peak})

    kernels = select_kernels("cuda", torch.bfloat16, v3_config(), allow="triton,torch")

    def absorbed():
        return kernels.mla_prefill(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, scale).float()

    tiles = triton_mla.decode_tiles(n, N, q.dtype, q.device)
    rows.append(
        {"method": "absorbed", "tiles": [tiles.block_h, tiles.block_n, tiles.num_warps, tiles.num_stages]}
    )
    try:
        if kernels.names()["mla_prefill"] != "triton":
            raise RuntimeError(f"Triton not chosen: {kernels.reasons()['mla_prefill']}")
        ms, peak, got = measure(absorbed)
        if kernels.names()["mla_prefill"] != "triton":  # (failed, and torch ran it from then on)
            raise RuntimeError(kernels.reasons()["mla_prefill"]["triton"])
        rows[-1] |= {"ms": ms, "peak_bytes": peak, "max_abs_diff_vs_tiled": (got - ref).abs().max().item()}
    except Exception as e:
        rows[-1]["error"] = f"{type(e).__name__}: {str(e)[:200]}"

    expanded = L * N * (2 * (D + R) + V) * 2  # k, k's copy in the cat, v (bf16)
    rows.append({"method": "dense"})
    if expanded > dense_max_gib * 2**30:
        rows[-1]["skipped"] = f"expanded K/V would take {expanded / 2**30:.1f} GiB"
    else:

        def dense():
            flat = cache.view(-1, C + R)[(blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda"))
                                         .view(-1)[:L]]  # fmt: skip
            kv = torch.einsum("lc,nec->nle", flat[:, :C], kv_b)  # [N, L, D+V]
            k = torch.cat((kv[..., :D], flat[None, :, C:].expand(N, -1, -1)), dim=-1)
            visible = (
                torch.arange(L, device="cuda")[None, :] <= torch.arange(L - n, L, device="cuda")[:, None]
            )
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k, kv[..., D:], attn_mask=visible, scale=scale
            )
            return o.transpose(0, 1).float()

        try:
            ms, peak, got = measure(dense)
            rows[-1] |= {
                "ms": ms,
                "peak_bytes": peak,
                "max_abs_diff_vs_tiled": (got - ref).abs().max().item(),
            }
        except Exception as e:
            rows[-1]["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for row in rows:
        row |= {"context": L, "chunk": n}
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--chunk", type=int, default=2048, help="queries: the chunk's tokens")
    ap.add_argument("--dense-max-gib", type=float, default=24.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_prefill needs a CUDA device")
    name = torch.cuda.get_device_name()
    out = args.out or Path("benchmarks/results") / f"mla_prefill_{name.replace(' ', '_')}.json"
    result = {"benchmark": "MLA prefill attention, V3 heads, bf16", "device": name, "torch": torch.__version__,
              "heads": N, "rows": []}  # fmt: skip
    try:
        stats = chosen_kernels()
        result["kernels"] = {"mla_prefill": stats["kernels"].get("mla_prefill"),
                             "reasons": stats["kernel_reasons"].get("mla_prefill")}  # fmt: skip
    except Exception as e:  # (a record only)
        result["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    for L in map(int, args.lengths.split(",")):
        result["rows"] += bench(L, min(args.chunk, L), args.dense_max_gib)
        torch.cuda.empty_cache()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
