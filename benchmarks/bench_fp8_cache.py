"""The FP8 latent cache (`kv_cache_dtype="fp8"`) against full-precision rows: capacity, accuracy,
decode speed.

- capacity: cache tokens per GiB for DeepSeek-V3's dims and the small preset, fp32 / bf16 / FP8 rows;
- accuracy: teacher-forced along the fp32-cache engine's greedy output of `--positions` tokens
  (prompt logprobs of prompt + output on each engine, so one early difference does not derail the
  rest): how often the FP8 cache's top-1 is the same, and the largest logprob difference of the
  chosen tokens. As a yardstick for the same model, the same numbers for bf16 weights (fp32
  cache): a random model's next-token distribution is flat, so any rounding flips many top-1s;
  the oracle checkpoint (tests/hf_oracle.py, an lm_head scaled for well-separated choices) is
  the case closer to a trained model;
- decode: step time at batch 8 over ~1,000-token contexts, fp32 rows against FP8 rows (the C++
  kernel dequantizes each row as it reads it).

    python -m benchmarks.bench_fp8_cache [--positions 1000] [--out benchmarks/results/fp8_cache.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig
from services.model.kv_cache import fp8_row_bytes
from services.presets import PRESETS, init_model

REPO = Path(__file__).resolve().parent.parent


def capacity() -> dict:
    out = {}
    for name, (layers, C, R) in {"deepseek-v3": (61, 512, 64), "small": (9, 128, 16)}.items():
        per_token = {
            "fp32": layers * (C + R) * 4,
            "bf16": layers * (C + R) * 2,
            "fp8": layers * fp8_row_bytes(C, R),
        }
        out[name] = {
            "bytes_per_token": per_token,
            "tokens_per_gib": {k: 2**30 // v for k, v in per_token.items()},
            "fp8_over_fp32": per_token["fp32"] / per_token["fp8"],
            "fp8_over_bf16": per_token["bf16"] / per_token["fp8"],
        }
    return out


def accuracy(model_dir: str, positions: int) -> dict:
    reference = LocalEngine(EngineConfig(model=model_dir))
    prompt = [0, 5, 6, 7]
    out = reference.generate(
        [prompt], SamplingParams(max_tokens=positions, temperature=0.0, ignore_eos=True)
    )[0]
    ids = prompt + out.token_ids
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)

    def scores(engine):
        return engine.generate([ids], scored)[0].prompt_logprobs[len(prompt) :]

    base = scores(reference)
    rows = {}
    for name, extra in {
        "fp8_cache": {"kv_cache_dtype": "fp8"},
        "bf16_weights": {"weight_dtype": "bfloat16"},
    }.items():
        got = scores(LocalEngine(EngineConfig(model=model_dir, **extra)))
        diffs = [abs(a.token_logprob - b.token_logprob) for a, b in zip(base, got, strict=True)]
        rows[name] = {
            "top1_agreement": sum(a.top[0][0] == b.top[0][0] for a, b in zip(base, got, strict=True))
            / len(base),
            "max_abs_logprob_diff": max(diffs),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs),
        }
    return {"positions": len(base), **rows}


def decode_speed(model_dir: str, steps: int = 32) -> dict:
    out = {}
    prompts = [
        [0] + torch.randint(4, 300, (1000,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(8)
    ]
    for name, extra in {"fp32_rows": {}, "fp8_rows": {"kv_cache_dtype": "fp8"}}.items():
        engine = LocalEngine(EngineConfig(model=model_dir, max_num_seqs=8, prefix_caching=False, **extra))
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
        while any(len(s.output_ids) < 4 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill and a few decode steps
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out[name] = {"decode_step_s": (time.perf_counter() - t0) / steps}
    out["fp8_over_fp32_step_time"] = out["fp8_rows"]["decode_step_s"] / out["fp32_rows"]["decode_step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=1000)
    ap.add_argument("--out", default="benchmarks/results/fp8_cache.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    small = str(init_model(tmp / "small", "small"))
    sys.path.insert(0, str(REPO))
    from tests.hf_oracle import V3_YARN, make_hf_checkpoint  # (transformers: a dev dependency)

    oracle = str(
        make_hf_checkpoint(tmp / "oracle", rope_parameters=V3_YARN, kv_lora_rank=128, vocab_size=320)
    )
    cfg = ModelConfig.from_hf(PRESETS["small"])
    result = {
        "benchmark": "FP8 latent cache vs full-precision rows",
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "capacity": capacity(),
        "accuracy_teacher_forced": {
            "small_preset": accuracy(small, args.positions),
            "oracle_checkpoint": accuracy(oracle, min(args.positions, 300)),
        },  # fmt: skip
        "decode_batch8_ctx1000_small": decode_speed(small),
        "small_preset_rows": {"C": cfg.kv_lora_rank, "R": cfg.qk_rope_head_dim},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
