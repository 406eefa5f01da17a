"""The ways LocalEngine can hold an FP8 checkpoint's weights, timed side by side in one process.

Five engines on the same checkpoint: fp32 (FP8 dequantised at load), bf16 weights
(`weight_dtype`), FP8 experts kept FP8 (`keep_fp8_experts`), FP8 experts with bf16 linears, and
FP8 experts with FP8 linears (`keep_fp8_linears`).
For each batch size every engine gets the same prompts, then blocks of 8 decode steps alternate
between the engines (6 blocks each, median step time), so all four see the same box at the same
minutes: separate runs on a shared 2-core machine move +-15 % between minutes, more than the
differences measured here. CPU only; never run in CI.

    python -m benchmarks.bench_weight_formats --model FP8_DIR [--batches 1,8,32]
                                              [--out benchmarks/results/weight_formats.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams

from .bench_local_engine import prompts

FORMATS = {
    "fp32 (dequantised at load)": {},
    "bf16 weights": {"weight_dtype": "bfloat16"},
    "FP8 experts kept": {"keep_fp8_experts": True},
    "FP8 experts + bf16 linears": {"keep_fp8_experts": True, "weight_dtype": "bfloat16"},
    "FP8 experts + FP8 linears": {"keep_fp8_experts": True, "keep_fp8_linears": True},
}


def step_times(engines: dict[str, LocalEngine], batch: int, vocab: int, blocks: int = 6, steps: int = 8):
    """Median seconds per decode step of each engine at `batch`, blocks of `steps` alternating."""
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    ids = {name: [e.add_request(p, params) for p in prompts(batch, vocab, 16)] for name, e in engines.items()}
    for e in engines.values():
        for _ in range(3):  # prefill and warm up
            e.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(blocks):
        for name, e in engines.items():
            e.step()  # (the first step after a switch pays for the other engine's cache traffic)
            for _ in range(steps):
                t = time.perf_counter()
                e.step()
                times[name].append(time.perf_counter() - t)
    for name, e in engines.items():
        for i in ids[name]:
            e.abort(i)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an FP8 block-quantised checkpoint")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/weight_formats.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {name: LocalEngine(EngineConfig(model=args.model, **cfg)) for name, cfg in FORMATS.items()}
    vocab = next(iter(engines.values())).cfg.vocab_size
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, s in step_times(engines, batch, vocab).items():
            mib = engines[name].experts.packed.nbytes() / 2**20
            attn_mib = engines[name].model.nbytes() / 2**20  # attention side: linears, kv_b, embeddings, head
            rows.append({"format": name, "batch": batch, "ms_per_step": s * 1e3, "tok_s": batch / s,
                         "expert_MiB": mib, "attention_MiB": attn_mib})  # fmt: skip
            print(f"batch {batch:3d}  {name:28s} {s * 1e3:7.2f} ms/step  {batch / s:8.1f} tok/s  experts {mib:6.1f} MiB"
                  f"  attention {attn_mib:6.1f} MiB", flush=True)  # fmt: skip
    result = {"benchmark": "weight_formats", "model": args.model, "threads": args.threads,
              "statistic": "median step over 6 alternating blocks of 8 decode steps", "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
