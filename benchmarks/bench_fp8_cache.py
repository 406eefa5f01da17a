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
- accuracy on a trained model (`--trained-steps N`: the small preset trained N steps on this
  repository's text by benchmarks/train_small.py, into `--trained-dir` when given; or
  `--trained-dir` alone: reuse that checkpoint), greedy after a README line: the rows above, and
  issue #40's comparison with bf16 weights in both engines, the FP8 cache against "auto" rows
  (fp32 on CPU), and in a bf16 engine (`dtype="bfloat16"`), the FP8 cache against bf16 rows;
  the same along `positions` tokens of held-out text (the greedy output is a loop of a few
  tokens: an easy path): the text train_small saved beside the checkpoint when it trained
  (`held_out.json`, checked against its sha256; a checkpoint without it is refused), and the
  README line it saved in training.json, never re-chosen from the checkout as it is now; the
  training's settings, losses and wall time come with it;
- decode: step time at batch 8 over ~1,000-token contexts, fp32 rows against FP8 rows (the C++
  kernel dequantizes each row as it reads it).

    python -m benchmarks.bench_fp8_cache [--positions 1000] [--out benchmarks/results/fp8_cache.json]
                                         [--trained-steps 250] [--trained-dir build/small-trained]
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


def accuracy(
    model_dir: str,
    positions: int,
    prompt: list[int] | None = None,
    reference: dict | None = None,
    rows: dict[str, dict] | None = None,
) -> dict:
    """Teacher-forced along the reference engine's greedy output of `positions` tokens after
    `prompt` (default ids 0, 5, 6, 7): `agreement` over those tokens. `reference`: the reference
    engine's own EngineConfig kwargs (default none: fp32 weights and cache)."""
    reference = reference or {}
    prompt = prompt or [0, 5, 6, 7]
    out = LocalEngine(EngineConfig(model=model_dir, **reference)).generate(
        [prompt], SamplingParams(max_tokens=positions, temperature=0.0, ignore_eos=True)
    )[0]
    return agreement(model_dir, prompt + out.token_ids, len(prompt), reference, rows)


def agreement(
    model_dir: str,
    ids: list[int],
    start: int,
    reference: dict | None = None,
    rows: dict[str, dict] | None = None,
) -> dict:
    """Teacher-forced along `ids` (prompt logprobs, so one early difference does not derail the
    rest), positions `start` on: per row of `rows` (name: EngineConfig kwargs over `reference`'s;
    default the FP8 cache and bf16 weights) how often its top-1 is the reference engine's, and the
    largest and mean |logprob difference| of the tokens in `ids`."""
    reference = reference or {}
    rows = rows or {"fp8_cache": {"kv_cache_dtype": "fp8"}, "bf16_weights": {"weight_dtype": "bfloat16"}}
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)

    def scores(engine):
        return engine.generate([ids], scored)[0].prompt_logprobs[start:]

    base = scores(LocalEngine(EngineConfig(model=model_dir, **reference)))
    result = {"positions": len(base)}
    for name, extra in rows.items():
        got = scores(LocalEngine(EngineConfig(model=model_dir, **{**reference, **extra})))
        diffs = [abs(a.token_logprob - b.token_logprob) for a, b in zip(base, got, strict=True)]
        result[name] = {
            "top1_agreement": sum(a.top[0][0] == b.top[0][0] for a, b in zip(base, got, strict=True))
            / len(base),
            "max_abs_logprob_diff": max(diffs),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs),
        }
    return result


def trained_accuracy(trained_dir: Path, positions: int) -> dict:
    """The accuracy rows on the trained small preset (benchmarks/train_small.py), greedy after a
    README line: (a) as the random rows (FP8 cache and bf16 weights against the fp32 engine);
    (b) issue #40's comparison, bf16 weights in both engines, the FP8 cache against
    kv_cache_dtype "auto" (on CPU under dtype float32 those rows are fp32, not bf16); (c) a
    bf16 engine (dtype bfloat16: bf16 weights, activations and cache rows), the FP8 cache
    against its bf16 rows; then (a) and (c) along the held-out text (the corpus's last 5 % when
    it trained: train_small pinned it in held_out.json; refused if missing)."""
    from benchmarks.train_small import encode, load_held_out

    held = load_held_out(trained_dir)  # (before any engine runs: a checkpoint without it fails fast)
    held_out = held["token_ids"][: positions + 1]
    training = json.loads((trained_dir / "training.json").read_text())
    text = training["round_trip"]["prompt"]  # the README line as it was when it trained
    prompt = encode(trained_dir, text)
    model = str(trained_dir)
    fp8 = {"fp8_cache": {"kv_cache_dtype": "fp8"}}
    return {
        "training": training,
        "prompt": text,
        "held_out_text_sha256": held["sha256"],
        "held_out_positions_scored": len(held_out) - 1,
        "vs_fp32_engine": accuracy(model, positions, prompt),
        "bf16_weights_fp8_vs_auto_cache": accuracy(
            model, positions, prompt, {"weight_dtype": "bfloat16"}, fp8
        ),
        "bf16_engine_fp8_vs_bf16_cache": accuracy(model, positions, prompt, {"dtype": "bfloat16"}, fp8),
        # along text it did not train on (its greedy output above is a loop of a few tokens)
        "held_out_text": {
            "vs_fp32_engine": agreement(model, held_out, 1),
            "bf16_engine_fp8_vs_bf16_cache": agreement(model, held_out, 1, {"dtype": "bfloat16"}, fp8),
        },
    }


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
    ap.add_argument("--trained-steps", type=int, default=0, help="train the small preset (0: skip)")
    ap.add_argument("--trained-dir", help="a train_small checkpoint to reuse, or where to train one")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    trained = args.trained_dir and Path(args.trained_dir)
    if args.trained_steps:  # first: the slowest part, and it checks the checkpoint round-trips
        from benchmarks.train_small import train_small

        trained = train_small(trained or tmp / "trained", steps=args.trained_steps)
    if trained:  # a checkpoint without its pinned held-out text is refused now, not after the rest
        from benchmarks.train_small import load_held_out

        load_held_out(trained)
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
    if trained:
        result["accuracy_teacher_forced"]["trained_small_preset"] = trained_accuracy(trained, args.positions)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
