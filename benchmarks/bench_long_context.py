"""Prefill of long prompts on LocalEngine: time, and peak memory beyond the latent cache.

`small` preset (8 heads), one prompt of each length (2K, 16K, 32K tokens by default), greedy, one
new token, each length in a fresh process (`--threads` torch threads). Peak memory growth is the
process's peak resident memory during the request (VmHWM, reset before it through
/proc/self/clear_refs) minus its resident memory before it, less the latent-cache rows the
prompt fills (they are the cache itself, not scratch): what the prefill needs on top of holding
the prompt. Prefill attention is tiled (model.prefill_attention): its scratch does not grow with
the context.

With `--sparse`: DeepSeek-V3.2's gathered sparse attention (`tiny-v32`, top-16 of the context)
and DeepSeek-V4's (`tiny-v4`: a window of 8, CSA entries every 4 tokens of which its indexer keeps
4, HCA entries every 16) against dense MLA on the same tiny dims (`tiny`): prefill time and decode
step time at contexts of 2K / 8K / 32K (`--sparse-lengths`), each in a fresh process; the sparse
decode step should stay nearly flat once the context exceeds top-k (only the indexer's one dot
per entry and index head grows, and V4's HCA entries, one per 16 tokens here), the dense one
grows with the context; `tiny-v4:fp8` is tiny-v4 on the FP8 cache (`--kv-cache-dtype fp8`).
`--lengths "" --sparse [--sparse-presets tiny-v4,tiny-v4:fp8]` measures only these, into the
existing file.

With `--model DIR --llama-bench BIN --gguf FILE` (the same checkpoint as an f32 GGUF, built as
docs/benchmarks.md says): llama.cpp's prefill of the same lengths beside ours (llama-batched-bench,
one run with flash attention off and one with it on).

    python -m benchmarks.bench_long_context [--lengths 2048,16384,32768] [--sparse] [--out benchmarks/results/long_context.json]
    python -m benchmarks.bench_long_context --lengths "" --sparse   # the sparse rows only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

PRESET = "small"


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _one(model_dir: str, length: int, threads: int, chunk: int) -> dict:
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams
    from services.model.kv_cache import BLOCK_SIZE

    torch.set_num_threads(threads)
    blocks = -(-(length + 8) // BLOCK_SIZE) + 1
    engine = LocalEngine(EngineConfig(model=model_dir, max_num_seqs=1, max_model_len=length + 8, num_kv_blocks=blocks,
                                      max_num_batched_tokens=chunk, prefix_caching=False))  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[0] + [5] * 63], params)  # warm-up (kernels, allocator)
    cache = engine.cache.nbytes if hasattr(engine.cache, "nbytes") else 0
    prompt = [0] + torch.randint(
        4, engine.cfg.vocab_size, (length - 1,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    Path("/proc/self/clear_refs").write_text("5")  # (resets VmHWM to the current VmRSS)
    before = _rss("VmRSS")
    t0 = time.perf_counter()
    engine.generate([prompt], params)
    seconds = time.perf_counter() - t0
    peak = _rss("VmHWM")
    W = engine.cfg.kv_lora_rank + engine.cfg.qk_rope_head_dim
    rows = length * W * 4 * engine.cfg.num_hidden_layers  # the prompt's latent-cache rows (fp32)
    return {"prompt_tokens": length, "prefill_s": seconds, "tokens_per_s": length / seconds,
            "peak_growth_bytes": peak - before, "latent_rows_bytes": rows,
            "peak_growth_beyond_cache_bytes": max(0, peak - before - rows), "latent_cache_bytes": cache}  # fmt: skip


def _decode(model_dir: str, length: int, threads: int, kv_cache_dtype: str = "auto", steps: int = 16) -> dict:
    """Prefill one `length`-token prompt, then time `steps` decode steps."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = LocalEngine(EngineConfig(model=model_dir, max_num_seqs=1, max_model_len=length + steps + 8,
                                      kv_cache_gib=4.0, prefix_caching=False, kv_cache_dtype=kv_cache_dtype))  # fmt: skip
    prompt = [0] + torch.randint(
        4, engine.cfg.vocab_size, (length - 1,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed < length:
        engine.step()  # the prefill (and its first token)
    prefill = time.perf_counter() - t0
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return {"context": length, "prefill_s": prefill, "decode_step_s": (time.perf_counter() - t0) / steps}


SPARSE_PRESETS = "tiny-v32,tiny-v4,tiny-v4:fp8,tiny"  # preset[:kv_cache_dtype]


def sparse_rows(lengths: list[int], threads: int, presets: str = SPARSE_PRESETS) -> dict:
    tmp = Path(tempfile.mkdtemp())
    from services.presets import init_model

    out = {}
    ctx = multiprocessing.get_context("spawn")
    for name in presets.split(","):
        preset, _, kv_cache_dtype = name.partition(":")
        # (tiny-v4's config says 4096 positions: the timing runs longer contexts on the same weights)
        model_dir = tmp / preset
        if not model_dir.exists():
            init_model(model_dir, preset, overrides={"max_position_embeddings": 65536})
        rows = []
        for length in lengths:
            with ctx.Pool(1) as pool:
                rows.append(pool.apply(_decode, (str(model_dir), length, threads, kv_cache_dtype or "auto")))
            print(name, json.dumps(rows[-1]), flush=True)
        for row in rows:
            row["decode_step_over_first"] = row["decode_step_s"] / rows[0]["decode_step_s"]
        out[name] = rows
    return out


def llama_cpp_prefill_s(
    binary: str, gguf: str, lengths: list[int], threads: int, fa: str
) -> dict[int, float]:
    """llama.cpp's prompt-processing seconds per prompt length, one llama-batched-bench run (f32
    KV cache, the model read into memory, `-fa` as given)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-npp", ",".join(map(str, lengths)),
           "-ntg", "1", "-npl", "1", "-fa", fa, "-ctk", "f32", "-ctv", "f32", "-lm", "none",
           "-c", str(max(lengths) + 16)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    seconds = {}
    for line in out.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and re.fullmatch(r"\d+", cells[0]):
            seconds[int(cells[0])] = float(cells[4])
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,16384,32768")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument(
        "--sparse", action="store_true", help="also V3.2 / V4 sparse vs dense MLA decode (tiny dims)"
    )
    ap.add_argument("--sparse-lengths", default="2048,8192,32768")
    ap.add_argument("--sparse-presets", default=SPARSE_PRESETS, help="preset[:kv_cache_dtype],...")
    ap.add_argument("--out", default="benchmarks/results/long_context.json")
    ap.add_argument("--model", help="checkpoint dir (default: generate the small preset)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-batched-bench binary (adds its prefill times)")
    ap.add_argument("--gguf", help="the same checkpoint as llama.cpp f32 GGUF (with --llama-bench)")
    args = ap.parse_args()
    from services.presets import init_model

    if not args.lengths:  # (`--lengths "" --sparse`: only the sparse rows, into the existing file)
        result = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
        result.pop("sparse_v32_vs_dense", None)
        result["sparse_vs_dense"] = {  # (the presets measured replace theirs, the others stay)
            **result.get("sparse_vs_dense", {}),
            **sparse_rows(
                [int(x) for x in args.sparse_lengths.split(",")], args.threads, args.sparse_presets
            ),
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return
    model_dir = args.model or str(init_model(Path(tempfile.mkdtemp()) / PRESET, PRESET))
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for length in (int(x) for x in args.lengths.split(",")):
        with ctx.Pool(1) as pool:  # (a fresh process per length: its own peak)
            row = pool.apply(_one, (model_dir, length, args.threads, args.chunk))
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    for row in rows:
        row["prefill_s_over_first"] = row["prefill_s"] / base["prefill_s"]
    if args.llama_bench:
        for fa in ("off", "on"):
            seconds = llama_cpp_prefill_s(args.llama_bench, args.gguf, [r["prompt_tokens"] for r in rows],
                                          args.threads, fa)  # fmt: skip
            for row in rows:
                row[f"llama_cpp_fa_{fa}_prefill_s"] = seconds[row["prompt_tokens"]]
                row[f"prefill_s_over_llama_cpp_fa_{fa}"] = row["prefill_s"] / seconds[row["prompt_tokens"]]
    result = {
        "benchmark": "long-prompt prefill, LocalEngine",
        "model": args.model or f"{PRESET} preset",
        "llama_cpp": None
        if not args.llama_bench
        else {
            "gguf": args.gguf,
            "flags": "-t/-tb threads -ntg 1 -npl 1 -ctk f32 -ctv f32 -lm none, -fa off and on",
        },
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "threads": args.threads,
        "prefill_chunk_tokens": args.chunk,
        "target": "peak_growth_beyond_cache_bytes <= 256 MB at every length",
        "target_met": all(r["peak_growth_beyond_cache_bytes"] <= 256 << 20 for r in rows),
        "rows": rows,
    }
    if args.sparse:
        result["sparse_vs_dense"] = sparse_rows(
            [int(x) for x in args.sparse_lengths.split(",")], args.threads, args.sparse_presets
        )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
