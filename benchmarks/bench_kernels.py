"""The Triton kernels on a GPU at DeepSeek-V3 shapes (needs CUDA and triton; exits otherwise).

Every time is GPU time per call: the calls replayed back to back from one CUDA graph (as a graphed
decode step runs them, so the host's launch overhead is not counted), each on its own copy of the
data it reads where one call reads less than twice the L2 (up to MAX_COPIES copies), so that no call
finds its data there: the bandwidths of the MLA, MoE and linear cases are HBM's. The smallest
cases (RMSNorm at 1 and 64 tokens, the latent work) are latency-bound: their times are what counts.

Each implementation is called directly (its module's function: triton_mla, triton_moe,
triton_norm, triton_linear, flash_mla, and the torch references in
services/model/kernels/torch_ops.py), whatever the engine would choose; the JSON's `kernels` records
what `select_kernels` chooses at V3's shapes in bf16 on this GPU ("auto", as an engine would).

- MLA decode (services/model/kernels/triton_mla.py): 128 heads, 576-wide latent rows (512 + 64 rope),
  bf16 paged cache, B sequences of `--context` tokens each. Reported as the bandwidth of reading
  the cache rows (the bytes that must move) against this GPU's measured device-to-device copy
  bandwidth and its nominal peak; beside it the torch path (gather + two bmm) and FlashMLA when
  it is installed.
- Fused MoE (services/model/kernels/triton_moe.py): hidden 7168, intermediate 2048, top-8 over
  `--slots` experts on one worker, bf16 and block-FP8 weights, against torch's grouped_mm on the
  same (token, expert) pairs already sorted by expert (its two grouped GEMMs and the SwiGLU,
  graphed), and the whole torch layer as the engine runs it where expert_ffn is torch's
  (torch_ops.expert_ffn: it sorts with synchronising ops, so it is timed eagerly).
- RMSNorm (services/model/kernels/triton_norm.py) at [tokens, 7168] against the torch ops.
- The MLA latent's per-token work (triton_mla.latent_to_cache) against the unfused ops
  (torch_ops.latent_to_cache with the Triton RMSNorm).
- FP8 linears (services/model/kernels/triton_linear.py, `keep_fp8_linears`) at V3's MLA shapes against
  cuBLAS on the bf16 weights.

The JSON is written after each section (a section that fails records its error; the others run).

    python -m benchmarks.bench_kernels [--out benchmarks/results/kernels_<gpu>.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from services.engine.decode_graphs import capturing

NOMINAL_TBPS = {
    "H100 80GB HBM3": 3.35,
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "H200": 4.8,
    "A100-SXM4-80GB": 2.04,
}


V3_DIMS = {  # DeepSeek-V3's shapes (config.json), over the tiny preset's other keys
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
}  # fmt: skip


def v3_config():
    """A ModelConfig with DeepSeek-V3's shapes (what kernel selection looks at)."""
    from services.model.config import ModelConfig
    from services.presets import PRESETS

    return ModelConfig.from_hf({**PRESETS["tiny"], **V3_DIMS})


def chosen_kernels(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """What an engine of V3's shapes in `dtype` on `device` runs ("auto" selection): family ->
    implementation, and why each better one was not taken."""
    from services.model.kernels.select import select_kernels

    return select_kernels(device, dtype, v3_config()).stats()


def timed_ms(fn, reps: int = 30) -> float:
    """Median milliseconds of fn() over `reps` runs, timed with CUDA events after 3 warm-ups."""
    for _ in range(3):
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


MAX_COPIES = 64


def copies(nbytes: int) -> int:
    """How many copies of a call's data (nbytes read per call) make the calls of one graph read
    more than twice the L2 between two uses of the same bytes (at most MAX_COPIES)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(MAX_COPIES, math.ceil(2 * l2 / max(nbytes, 1))))


def graphed_ms(calls, reps: int = 20) -> float:
    """Milliseconds per call of `calls` (one closure per copy of the data) replayed back to back
    from one CUDA graph: the GPU's time, as a graphed decode step spends it (median replay / calls)."""
    for fn in calls:
        fn()  # (Triton compiles outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(torch.device("cuda", torch.cuda.current_device())), torch.cuda.graph(graph):
        for fn in calls:
            fn()
    ms = timed_ms(graph.replay, reps) / len(calls)
    del graph
    return ms


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (TB/s)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / ms / 1e9


def nominal_tbps() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in NOMINAL_TBPS.items() if k in name), None)


def mla_decode_inputs(batch: int, context: int, heads: int, C: int, R: int, width: int | None):
    """One V3 decode case's inputs on the GPU, `copies` of them (each call reads its own):
    (blocks per row, table width, copies, cache [n * batch * blocks, 64, 1, C+R] bf16, tables [n,
    batch, width] int32, lens [batch], queries [n, batch, heads, C+R] bf16, bytes a call moves:
    the rows read, q in, o out)."""
    blocks = context // 64
    width = width or blocks
    n = copies(batch * blocks * 64 * (C + R) * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(n * batch * blocks, 64, 1, C + R, device="cuda", generator=g).bfloat16()
    tables = torch.zeros(n, batch, width, dtype=torch.int32, device="cuda")
    tables[..., :blocks] = torch.randperm(n * batch * blocks, device="cuda", generator=g).view(
        n, batch, blocks
    )
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    qs = torch.randn(n, batch, heads, C + R, device="cuda", generator=g).bfloat16()
    moved = batch * blocks * 64 * (C + R) * 2 + batch * heads * (2 * C + R) * 2
    return blocks, width, n, cache, tables, lens, qs, moved


def bench_mla(
    batch: int, context: int, heads: int = 128, C: int = 512, R: int = 64, width: int | None = None
) -> dict:
    """`width`: the block table's width in blocks (a graphed decode step's static table covers
    max_model_len: the split count comes from it, each row splits its own blocks)."""
    from services.model.kernels import triton_mla

    blocks, width, n, cache, tables, lens, qs, moved = mla_decode_inputs(batch, context, heads, C, R, width)
    scale = 0.1352338
    row = {
        "batch": batch,
        "context": context,
        "table_blocks": width,
        "heads": heads,
        "bytes": moved,
        "copies": n,
    }

    def torch_path(i):
        ctx = cache[tables[i, :, :blocks].long()].view(batch, -1, C + R)
        probs = (torch.bmm(qs[i], ctx.transpose(1, 2)).float() * scale).softmax(-1).to(qs.dtype)
        return torch.bmm(probs, ctx[..., :C])

    def triton_path(i):
        return triton_mla.mla_decode(qs[i], cache, tables[i], lens, C, scale)

    ref = torch_path(0).float()
    groups = -(-heads // triton_mla.decode_tiles(batch, heads, torch.bfloat16, torch.device("cuda")).block_h)
    row["splits"] = triton_mla._splits(batch, groups, width, torch.device("cuda"))
    row["max_abs_diff_vs_torch"] = (triton_path(0).float() - ref).abs().max().item()
    for name, fn in (("triton", triton_path), ("torch", torch_path)):
        ms = graphed_ms([lambda i=i, fn=fn: fn(i) for i in range(n)])
        row[f"{name}_ms"], row[f"{name}_tbps"] = ms, moved / ms / 1e9
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata

        meta, splits = get_mla_metadata(lens, heads, 1)
        got = flash_mla_with_kvcache(qs[0][:, None], cache, tables[0], lens, C, meta, splits,
                                     softmax_scale=scale, causal=True)[0]  # fmt: skip
        row["flashmla_max_abs_diff_vs_torch"] = (got[:, 0].float() - ref).abs().max().item()
        calls = [lambda i=i: flash_mla_with_kvcache(qs[i][:, None], cache, tables[i], lens, C, meta, splits,
                                                    softmax_scale=scale, causal=True) for i in range(n)]  # fmt: skip
        ms = graphed_ms(calls)
        row["flashmla_ms"], row["flashmla_tbps"] = ms, moved / ms / 1e9
    except ImportError:
        row["flashmla"] = "not installed"
    except Exception as e:  # another FlashMLA version's API
        row["flashmla"] = f"{type(e).__name__}: {e}"
    return row


def flashmla_load() -> tuple[object | None, dict]:
    """Import FlashMLA (`flash_mla`: the sgl-flash-mla wheel, or a build from source) and say what
    loaded: its version, file, whether its legacy extension (`torch.ops.flash_mla_legacy`: SM90's
    kernels and the V3.2 / V4 cache formats) loaded and why not, and the ops it registered; or,
    where the import fails, the exception (a newer torch's stable ABI, a missing CUDA library)."""
    info: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import flash_mla
    except BaseException as e:  # (an extension that will not load can raise more than ImportError)
        info.update(loaded=False, error=f"{type(e).__name__}: {e}"[:3000])
        return None, info
    loader = sys.modules.get("flash_mla._loader")
    has_legacy = getattr(flash_mla, "has_legacy", None)
    info.update(loaded=True, version=getattr(flash_mla, "__version__", None), file=flash_mla.__file__,
                legacy=has_legacy() if callable(has_legacy) else None,
                legacy_unavailable=getattr(loader, "_LEGACY_UNAVAILABLE", None))  # fmt: skip
    try:
        ops = torch._C._dispatch_get_all_op_names()
        info["ops"] = sorted(n for n in ops if n.startswith(("flash_mla::", "flash_mla_legacy::")))
    except Exception as e:
        info["ops"] = f"{type(e).__name__}: {e}"
    return flash_mla, info


def flashmla_dense(fm, lens, heads: int, C: int, scale: float):
    """FlashMLA's dense bf16 decode as a call (q [B, N, C+R], cache, table) -> o [B, N, C], one
    schedule for every call of the step (same lengths): the sgl-flash-mla wheel's API (an empty
    FlashMLASchedMeta filled by the first call, `use_legacy=True`: dense decode and SM90 live on the
    legacy side only) where `has_legacy` says it is that wheel, else the Feb / Sep 2025 API
    (get_mla_metadata(lens, heads, 1) -> tensors)."""
    if hasattr(fm, "has_legacy"):
        sched = fm.get_mla_metadata()[0]
        return lambda q, cache, table: fm.flash_mla_with_kvcache(
            q[:, None], cache, table, lens, C, sched, None, softmax_scale=scale, causal=True, use_legacy=True
        )[0][:, 0]
    meta, splits = fm.get_mla_metadata(lens, heads, 1)
    return lambda q, cache, table: fm.flash_mla_with_kvcache(
        q[:, None], cache, table, lens, C, meta, splits, softmax_scale=scale, causal=True
    )[0][:, 0]


def bench_flashmla_dense(fm, batch: int, context: int, heads: int = 128, C: int = 512, R: int = 64) -> dict:
    """V3's dense decode over bf16 paged rows (576 wide): FlashMLA against our Triton kernel and
    the torch path (gather + two bmm, dense bf16), each graphed as bench_mla times them; the
    largest difference of each from the torch path in fp32."""
    from services.model.kernels import triton_mla

    blocks, _, n, cache, tables, lens, qs, moved = mla_decode_inputs(batch, context, heads, C, R, None)
    scale = 0.1352338

    def torch_path(i):
        ctx = cache[tables[i, :, :blocks].long()].view(batch, -1, C + R)
        probs = (torch.bmm(qs[i], ctx.transpose(1, 2)).float() * scale).softmax(-1).to(qs.dtype)
        return torch.bmm(probs, ctx[..., :C])

    ref = torch_path(0).float()
    row = {"batch": batch, "context": context, "heads": heads, "bytes": moved, "copies": n}
    paths = {"triton": lambda i: triton_mla.mla_decode(qs[i], cache, tables[i], lens, C, scale),
             "torch_bf16": torch_path}  # fmt: skip
    try:
        flash = flashmla_dense(fm, lens, heads, C, scale)
        paths = {"flashmla": lambda i: flash(qs[i], cache, tables[i]), **paths}
    except Exception as e:
        row["flashmla"] = f"{type(e).__name__}: {str(e)[:500]}"
    for name, fn in paths.items():
        try:
            row[f"{name}_max_abs_diff_vs_torch"] = (fn(0).float() - ref).abs().max().item()
            ms = graphed_ms([lambda i=i, fn=fn: fn(i) for i in range(n)])
            row[f"{name}_ms"], row[f"{name}_tbps"] = ms, moved / ms / 1e9
        except Exception as e:  # (another FlashMLA's API, a GPU it was not built for: the rest still run)
            row[name] = f"{type(e).__name__}: {str(e)[:500]}"
    if isinstance(row.get("flashmla_ms"), float):
        row["flashmla_speedup_over_triton"] = row["triton_ms"] / row["flashmla_ms"]
    return row


def bench_flashmla_sparse(fm, batch: int, context: int, topk: int = 2048, heads: int = 128, C: int = 512,
                          R: int = 64) -> dict:  # fmt: skip
    """V3.2's decode over FP8 rows (kv_cache.quantize_latent_rows: 512 e4m3 values, 4 fp32 scales,
    64 bf16 rope values = 656 bytes, FlashMLA's V3.2 FP8 layout), each sequence attending to `topk`
    rows of its context: FlashMLA's sparse FP8 decode (legacy side: SM90) against our Triton kernel
    over the same rows (`rows=`) and the torch path (gather, dequantise, two bmm). Each row's
    difference from the torch path; FlashMLA also over our V3.2 cache's 800-byte rows (indexer key
    after the 656) viewed 656 wide, which needs it to take a strided cache."""
    from services.model.kernels import torch_ops, triton_mla
    from services.model.kv_cache import fp8_row_bytes, quantize_latent_rows

    blocks, _, n, cache, tables, lens, qs, _ = mla_decode_inputs(batch, context, heads, C, R, None)
    flat = cache.view(-1, C + R)
    fp8 = quantize_latent_rows(flat[:, :C], flat[:, C:]).view(*cache.shape[:3], -1)  # [blocks, 64, 1, 656]
    wide = torch.zeros(*fp8.shape[:3], fp8_row_bytes(C, R, 128), dtype=torch.uint8, device="cuda")
    wide[..., : fp8.shape[-1]] = fp8  # V3.2's rows: the indexer key (zeros here) after the latent
    del flat, cache
    g = torch.Generator(device="cuda").manual_seed(1)
    picks = torch.stack([torch.randperm(context, device="cuda", generator=g)[:topk] for _ in range(batch)])
    rows = tables[:, :, :blocks].long().gather(2, (picks // 64)[None].expand(n, -1, -1)) * 64 + picks % 64
    count = torch.full((batch,), topk, dtype=torch.int32, device="cuda")
    scale = 0.1352338
    moved = batch * topk * fp8.shape[-1] + batch * heads * (2 * C + R) * 2
    row = {"batch": batch, "context": context, "topk": topk, "heads": heads, "row_bytes": fp8.shape[-1],
           "bytes": moved, "copies": n}  # fmt: skip
    ref = torch_ops.sparse_decode(qs[0], fp8, rows[0], count, C, scale).float()
    paths = {
        "triton": lambda i: triton_mla.mla_decode(qs[i], fp8, None, count, C, scale, rows=rows[i]),
        "triton_v32_rows": lambda i: triton_mla.mla_decode(qs[i], wide, None, count, C, scale, rows=rows[i]),
        "torch": lambda i: torch_ops.sparse_decode(qs[i], fp8, rows[i], count, C, scale),
    }
    if hasattr(fm, "has_legacy"):
        indices = rows.int()[:, :, None, :]  # [copies, B, s_q = 1, topk]: flat cache rows

        def flash(cache_):
            sched = fm.get_mla_metadata()[0]
            return lambda i: fm.flash_mla_with_kvcache(
                qs[i][:, None], cache_, None, None, C, sched, None, softmax_scale=scale, causal=False,
                is_fp8_kvcache=True, indices=indices[i], use_legacy=True,
            )[0][:, 0]  # fmt: skip

        paths = {"flashmla": flash(fp8.view(torch.float8_e4m3fn)),
                 "flashmla_v32_rows": flash(wide.view(torch.float8_e4m3fn)[..., : fp8.shape[-1]]), **paths}  # fmt: skip
    else:
        row["flashmla"] = "this FlashMLA has no sparse decode API this benchmark knows (sgl-flash-mla's)"
    for name, fn in paths.items():
        try:
            row[f"{name}_max_abs_diff_vs_torch"] = (fn(0).float() - ref).abs().max().item()
            ms = graphed_ms([lambda i=i, fn=fn: fn(i) for i in range(n)])
            row[f"{name}_ms"], row[f"{name}_tbps"] = ms, moved / ms / 1e9
        except Exception as e:
            row[name] = f"{type(e).__name__}: {str(e)[:500]}"
    if isinstance(row.get("flashmla_ms"), float):
        row["flashmla_speedup_over_triton"] = row["triton_ms"] / row["flashmla_ms"]
    return row


def bench_flashmla(context: int, save=lambda partial: None) -> dict:
    """The FlashMLA section: what loaded (flashmla_load), then, if it did, V3's dense bf16 decode
    and V3.2's FP8 sparse decode at batch 1 / 64 / 8 against our Triton kernel and torch;
    `save(partial)` after each case (a step cut short keeps what it measured)."""
    fm, info = flashmla_load()
    out: dict = {"load": info, "dense_bf16": [], "sparse_fp8_v32": []}
    save(out)
    if fm is None:
        return out
    for b in (1, 64, 8):
        for name, run in (("dense_bf16", bench_flashmla_dense), ("sparse_fp8_v32", bench_flashmla_sparse)):
            try:
                out[name].append(run(fm, b, context))
            except Exception as e:  # (the next case still runs)
                out[name].append({"batch": b, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            print(name, json.dumps(out[name][-1]), flush=True)
            save(out)
            torch.cuda.empty_cache()
    return out


FP8_SWEEP_TILES = [
    (16, 16, 4, 2),
    (16, 32, 4, 2),
    (16, 32, 8, 2),
    (32, 32, 8, 2),
    (64, 32, 8, 2),
    (64, 64, 8, 2),
]


def bench_mla_fp8(batch: int, context: int, heads: int = 128, C: int = 512, R: int = 64) -> dict:
    """#40's FP8 latent cache on the GPU: the Triton kernel over FP8 rows (656 bytes each at V3's
    dims, read in place) against the same kernel over bf16 rows (1,152 bytes) and the torch path
    (the context gathered and dequantised, then two bmm), at one V3 decode shape; the default and
    other tile shapes over FP8 rows (FP8_SWEEP_TILES); the result against the bf16 kernel on the dequantised rows."""
    from services.model.kernels import triton_mla
    from services.model.kv_cache import dequantize_latent_rows, fp8_row_bytes, quantize_latent_rows

    blocks, _, n, cache, tables, lens, qs, moved = mla_decode_inputs(batch, context, heads, C, R, None)
    flat = cache.view(-1, C + R)
    fp8 = quantize_latent_rows(flat[:, :C], flat[:, C:]).view(*cache.shape[:3], -1)
    dense = dequantize_latent_rows(fp8, C, R, torch.bfloat16)  # what the FP8 rows hold, in bf16
    scale = 0.1352338
    row_bytes = fp8_row_bytes(C, R)
    fp8_moved = moved - batch * blocks * 64 * ((C + R) * 2 - row_bytes)
    row = {"batch": batch, "context": context, "heads": heads, "fp8_row_bytes": row_bytes,
           "bf16_row_bytes": (C + R) * 2, "copies": n}  # fmt: skip

    def torch_fp8(i):
        ctx = dequantize_latent_rows(
            fp8[tables[i, :, :blocks].long()].view(batch, -1, row_bytes), C, R, qs.dtype
        )
        probs = (torch.bmm(qs[i], ctx.transpose(1, 2)).float() * scale).softmax(-1).to(qs.dtype)
        return torch.bmm(probs, ctx[..., :C])

    paths = {
        "triton_fp8": lambda i: triton_mla.mla_decode(qs[i], fp8, tables[i], lens, C, scale),
        "triton_bf16": lambda i: triton_mla.mla_decode(qs[i], cache, tables[i], lens, C, scale),
        "torch_fp8": torch_fp8,
    }
    for tiles in FP8_SWEEP_TILES:  # (block_h, block_n, num_warps, num_stages)
        paths["triton_fp8_tiles_" + "_".join(map(str, tiles))] = lambda i, t=tiles: triton_mla.mla_decode(
            qs[i], fp8, tables[i], lens, C, scale, tiles=triton_mla.DecodeTiles(*t)
        )
    got = paths["triton_fp8"](0).float()
    same = triton_mla.mla_decode(qs[0], dense, tables[0], lens, C, scale).float()
    row["fp8_vs_bf16_kernel_on_dequantized_max_abs_diff"] = (got - same).abs().max().item()
    row["fp8_vs_bf16_rows_max_abs_diff"] = (got - paths["triton_bf16"](0).float()).abs().max().item()
    for name, fn in paths.items():
        try:
            ms = graphed_ms([lambda i=i, fn=fn: fn(i) for i in range(n)])
        except Exception as e:  # (a tile shape that does not fit: the others still run)
            row[f"{name}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        row[f"{name}_ms"] = ms
        row[f"{name}_tbps"] = (moved if name == "triton_bf16" else fp8_moved) / ms / 1e9
    if isinstance(row["triton_fp8_ms"], float):
        row["fp8_speedup_over_bf16"] = row["triton_bf16_ms"] / row["triton_fp8_ms"]
        row["fp8_speedup_over_torch_fp8"] = row["torch_fp8_ms"] / row["triton_fp8_ms"]
    return row


SWEEP_TILES = [  # (block_h, block_n, num_warps, num_stages)
    (16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
    (32, 32, 4, 3), (64, 16, 4, 2), (64, 32, 4, 2), (64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1),
    (64, 64, 8, 2), (64, 16, 8, 3), (128, 16, 8, 2), (128, 32, 8, 1),
]  # fmt: skip


def bench_mla_sweep(batch: int, context: int, width: int | None = None, heads: int = 128, C: int = 512,
                    R: int = 64) -> list[dict]:  # fmt: skip
    """triton_mla.mla_decode's stage-1 tile shapes (SWEEP_TILES) at one V3 decode shape: each
    one's graphed milliseconds and bytes per second (as bench_mla) and its largest difference from
    the default tiles' output; a shape that does not compile or launch is recorded with its error."""
    from services.model.kernels import triton_mla

    _, width, n, cache, tables, lens, qs, moved = mla_decode_inputs(batch, context, heads, C, R, width)
    ref = triton_mla.mla_decode(qs[0], cache, tables[0], lens, C, 0.1352338).float()
    rows = []
    for h, bn, warps, stages in SWEEP_TILES:
        tiles = triton_mla.DecodeTiles(h, bn, warps, stages)
        row = {"batch": batch, "context": context, "table_blocks": width, "block_h": h, "block_n": bn,
               "num_warps": warps, "num_stages": stages}  # fmt: skip
        try:
            got = triton_mla.mla_decode(qs[0], cache, tables[0], lens, C, 0.1352338, tiles=tiles)
            row["max_abs_diff_vs_default"] = (got.float() - ref).abs().max().item()
            calls = [lambda i=i, t=tiles: triton_mla.mla_decode(qs[i], cache, tables[i], lens, C, 0.1352338, tiles=t)
                     for i in range(n)]  # fmt: skip
            ms = graphed_ms(calls)
            row["ms"], row["tbps"] = ms, moved / ms / 1e9
        except Exception as e:  # out of shared memory or registers: the next shape still runs
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_latent(tokens: int, heads: int = 128, C: int = 512, R: int = 64, D: int = 128) -> dict:
    """An MLA layer's per-token work at V3's shapes (latent RMSNorm, rope of k_pe and of the
    heads' q_pe, the cache write): triton_mla.latent_to_cache against the ops of the unfused path
    (torch_ops.latent_to_cache with the Triton RMSNorm, as the engine composes it where the
    latent_to_cache family is torch's: the rope's torch ops, cat and index write), both
    replayed from CUDA graphs."""
    from services.model.kernels import torch_ops, triton_mla, triton_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(tokens, C + R, device="cuda", generator=g).bfloat16()
    q = torch.randn(tokens, heads, D + R, device="cuda", generator=g).bfloat16()
    norm = torch.rand(C, device="cuda", generator=g).bfloat16()
    angles = torch.rand(tokens, R // 2, device="cuda", generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cache = torch.zeros(max(4, tokens), 64, 1, C + R, device="cuda").bfloat16()
    slots = torch.randperm(cache.shape[0] * 64, device="cuda", generator=g)[:tokens]

    def unfused():  # (rope: torch_ops.rope_interleaved)
        return torch_ops.latent_to_cache(
            kv, q[..., D:], norm, cos, sin, slots, cache, 1e-6, norm=triton_norm.rms_norm
        )

    def fused():
        return triton_mla.latent_to_cache(kv, q[..., D:], norm, cos, sin, slots, cache, True, 1e-6)

    q_pe = unfused()
    want = cache.view(-1, C + R)[slots].clone()
    row = {"tokens": tokens, "heads": heads, "q_pe_equal": torch.equal(fused(), q_pe)}
    row["cache_rows_max_abs_diff"] = (cache.view(-1, C + R)[slots].float() - want.float()).abs().max().item()
    row["fused_ms"], row["unfused_ms"] = graphed_ms([fused]), graphed_ms([unfused])
    return row


def moe_weights(slots: int, H: int = 7168, I: int = 2048) -> dict:
    """One expert worker's `slots` experts at V3's shapes: bf16 w13 [S, 2I, H] and w2 [S, H, I],
    and the same quantised to block FP8 (128 x 128) with their scales, all on the GPU."""
    from services.model.fp8 import quantize_fp8_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    w = {
        "w13": (torch.randn(slots, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16(),
        "w2": (torch.randn(slots, H, I, device="cuda", generator=g) * 0.02).bfloat16(),
    }
    for name in ("w13", "w2"):
        q, scale = zip(*(quantize_fp8_blocks(e, (128, 128)) for e in w[name]), strict=True)
        w[f"{name}_fp8"], w[f"{name}_scale"] = torch.stack(q), torch.stack(scale)
    return w


def bench_moe(tokens: int, w: dict, top_k: int = 8) -> dict:
    from services.model.kernels import torch_ops, triton_moe

    w13, w2 = w["w13"], w["w2"]
    slots, I2, H = w13.shape
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    slot = torch.rand(tokens, slots, device="cuda", generator=g).topk(min(top_k, slots), -1).indices
    weight = torch.rand(slot.shape, device="cuda", generator=g)
    row = {"tokens": tokens, "slots": slots, "hidden": H, "intermediate": I2 // 2, "top_k": slot.shape[1]}
    busy = slot.unique().numel()
    moved = busy * 3 * H * (I2 // 2) * 2  # the busy experts' bf16 weights: the floor at decode sizes
    # (8 busy experts at least: 704 MB per call, far more than twice an H100's L2: no copies needed)
    fused = lambda: triton_moe.fused_moe(x, slot, weight, w13, w2)  # noqa: E731
    fp8 = lambda: triton_moe.fused_moe(x, slot, weight, w["w13_fp8"], w["w2_fp8"],  # noqa: E731
                                       w13_scale=w["w13_scale"], w2_scale=w["w2_scale"])  # fmt: skip
    # grouped_mm's own work: the (token, choice) pairs sorted by expert beforehand
    pair = torch.argsort(slot.reshape(-1), stable=True)
    xs = x[pair // slot.shape[1]]
    offs = torch.cumsum(torch.bincount(slot.reshape(-1), minlength=slots), 0).to(torch.int32)
    grouped = lambda: torch_ops._expert_mlp_grouped_mm(xs, offs, w13, w2)  # noqa: E731
    ref = torch_ops.expert_ffn(x, slot, weight, w13, w2)  # the torch path, as the engine's
    row["max_abs_diff_vs_torch"] = (fused().float() - ref.float()).abs().max().item()
    row["fp8_max_abs_diff_vs_torch"] = (fp8().float() - ref.float()).abs().max().item()
    row["torch_layer_eager_ms"] = timed_ms(lambda: torch_ops.expert_ffn(x, slot, weight, w13, w2))
    for name, fn, nbytes in (("triton_bf16", fused, moved), ("triton_fp8", fp8, moved // 2),
                             ("grouped_mm_bf16", grouped, moved)):  # fmt: skip
        try:
            ms = graphed_ms([fn])
            row[f"{name}_ms"], row[f"{name}_weight_tbps"] = ms, nbytes / ms / 1e9
        except Exception as e:  # (grouped_mm: bf16 on some GPUs only)
            row[name] = f"{type(e).__name__}: {e}"
    return row


V3_LINEARS = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "o": (7168, 16384)}  # [N, K]


def linear_weights(name: str) -> dict:
    """A V3 MLA linear's bf16 weight [N, K] and its block-FP8 quantisation, `copies` of each."""
    from services.model.fp8 import quantize_fp8_blocks

    N, K = V3_LINEARS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    q, scale = quantize_fp8_blocks(w, (128, 128))
    n = copies(N * K)
    return {"name": name, "w": [w] + [w.clone() for _ in range(n - 1)],
            "fp8": [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(n - 1)]}  # fmt: skip


def bench_fp8_linear(tokens: int, lin: dict) -> dict:
    """A DeepSeek-V3 MLA linear kept FP8 (triton_linear.fp8_linear, bf16 activations) against
    cuBLAS on the bf16 weight; bandwidth of reading the weight (the floor at decode sizes)."""
    from services.model.kernels import triton_linear

    ws, fp8s = lin["w"], lin["fp8"]
    N, K = ws[0].shape
    x = torch.randn(
        tokens, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)
    ).bfloat16()
    row = {"linear": lin["name"], "tokens": tokens, "out": N, "in": K, "copies": len(ws)}
    got = triton_linear.fp8_linear(x, *fp8s[0], (128, 128))
    row["max_abs_diff_vs_bf16"] = (
        (got.float() - torch.nn.functional.linear(x, ws[0]).float()).abs().max().item()
    )
    triton_calls = [lambda q=q, s=s: triton_linear.fp8_linear(x, q, s, (128, 128)) for q, s in fp8s]
    cublas_calls = [lambda w=w: x @ w.T for w in ws]
    for label, calls, nbytes in (
        ("triton_fp8", triton_calls, N * K),
        ("cublas_bf16", cublas_calls, 2 * N * K),
    ):
        ms = graphed_ms(calls)
        row[f"{label}_ms"], row[f"{label}_weight_tbps"] = ms, nbytes / ms / 1e9
    return row


def bench_norm(tokens: int, H: int = 7168) -> dict:
    from services.model.kernels import triton_norm

    n = copies(tokens * H * 2 * 2)
    xs = torch.randn(n, tokens, H, device="cuda").bfloat16()
    w = torch.randn(H, device="cuda").bfloat16()

    def torch_path(x):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    return {"tokens": tokens, "copies": n,
            "triton_ms": graphed_ms([lambda x=x: triton_norm.rms_norm(x, w, 1e-6) for x in xs]),
            "torch_ms": graphed_ms([lambda x=x: torch_path(x) for x in xs])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=32, help="experts held by one expert worker")
    ap.add_argument("--sections", default=None, help="comma-separated: only these sections "
                    "(mla_decode, mla_fp8, mla_sweep, fused_moe, rms_norm, mla_latent, fp8_linear, flashmla)")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        if args.out and args.sections and "flashmla" in args.sections.split(","):  # a record of why
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": None, "error": "no CUDA device", "flashmla": {
                "load": flashmla_load()[1]}}, indent=2) + "\n")  # fmt: skip
        sys.exit("bench_kernels needs a CUDA device (and triton: pip install -e '.[gpu]')")
    name = torch.cuda.get_device_name()
    out = args.out or Path("benchmarks/results") / f"kernels_{name.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    result = {"device": name, "torch": torch.__version__, "l2_bytes": props.L2_cache_size,
              "copy_tbps": copy_bandwidth_tbps(), "nominal_tbps": nominal_tbps()}  # fmt: skip
    try:
        result["kernels"] = chosen_kernels()
    except Exception as e:  # (a record only: the sections still run)
        result["kernels"] = {"error": f"{type(e).__name__}: {e}"}

    def moe():
        w = moe_weights(args.slots)
        return [bench_moe(t, w) for t in (1, 8, 64, 512)]

    sections = {
        "mla_decode": lambda: (
            [bench_mla(b, args.context) for b in (1, 8, 64)]
            + [bench_mla(b, args.context // 4, width=512) for b in (1, 64)]
        ),  # a graphed step's wide table
        "mla_sweep": lambda: [
            row
            for b, ctx, w in ((64, 4096, None), (8, 4096, None), (64, 1024, 512), (1, 4096, None))
            for row in bench_mla_sweep(b, ctx, w)
        ],  # fmt: skip
        "mla_fp8": lambda: [bench_mla_fp8(b, args.context) for b in (1, 8, 64)],
        "fused_moe": moe,
        "rms_norm": lambda: [bench_norm(t) for t in (1, 64, 4096)],
        "mla_latent": lambda: [bench_latent(t) for t in (1, 64)],
        "fp8_linear": lambda: [
            bench_fp8_linear(t, lin) for lin in map(linear_weights, V3_LINEARS) for t in (1, 64, 512)
        ],  # fmt: skip
        "flashmla": lambda: bench_flashmla(
            args.context,
            lambda partial: out.write_text(json.dumps({**result, "flashmla": partial}, indent=2) + "\n"),
        ),
    }
    chosen = (
        args.sections.split(",")
        if args.sections
        else [k for k in sections if k not in ("mla_sweep", "flashmla")]
    )
    for section, run in sections.items():
        if section not in chosen:
            continue
        try:
            result[section] = run()
        except Exception as e:  # the next section still runs
            result[section] = {"error": f"{type(e).__name__}: {e}"}
        if section == "mla_decode" and isinstance(result[section], list):
            for row in result[section]:
                row["triton_vs_copy"] = row["triton_tbps"] / result["copy_tbps"]
                if result["nominal_tbps"]:
                    row["triton_vs_nominal"] = row["triton_tbps"] / result["nominal_tbps"]
        torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(section, json.dumps(result[section], indent=2), flush=True)


if __name__ == "__main__":
    main()
