"""The `moe-cluster` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def default_model_dir(preset: str = "tiny") -> Path:
    """The generated preset checkpoint in the user cache (created on first use)."""
    root = Path(os.environ.get("MOE_CLUSTER_CACHE", Path.home() / ".cache" / "moe-cluster"))
    path = root / f"preset-{preset}"
    if not (path / "config.json").is_file():
        from services.model.presets import init_model

        print(f"generating the {preset!r} preset checkpoint in {path} ...", file=sys.stderr)
        init_model(path, preset)
    return path


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids wants comma-separated integers, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-token-ids is empty")
    return ids


def cmd_init_model(args) -> int:
    from services.model.presets import init_model

    path = init_model(args.dir, args.preset, seed=args.seed, fp8=args.fp8)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def cmd_generate(args) -> int:
    from services.model.engine import EngineConfig, LocalEngine
    from services.model.sampling import SamplingParams
    from services.model.scheduler import RequestError

    model = args.model or default_model_dir()
    engine = LocalEngine(EngineConfig(model=str(model), dtype=args.dtype, num_threads=args.threads))
    prompts: list[list[int]] = list(args.prompt_token_ids or [])
    text_mode = bool(args.prompt)
    if text_mode:
        if engine.tokenizer is None:
            print("error: this checkpoint has no tokenizer; pass --prompt-token-ids", file=sys.stderr)
            return 2
        prompts += [engine.tokenizer.encode(p) for p in args.prompt]
    if not prompts:
        print("error: give --prompt-token-ids or --prompt", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        results = engine.generate(prompts, params)
    except (RequestError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        if args.json:
            text = r.text if text_mode else ""
            print(json.dumps({"token_ids": r.token_ids, "text": text, "finish_reason": r.finish_reason}))
        else:
            print(r.text if text_mode else " ".join(map(str, r.token_ids)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-cluster", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("MOE_CLUSTER_LOG", "WARNING"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-model", help="write a random-weight DeepSeek-V3 checkpoint")
    s.add_argument("dir")
    s.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--fp8", action="store_true", help="FP8 e4m3 128x128 block-quantised weights")
    s.set_defaults(fn=cmd_init_model)

    s = sub.add_parser("generate", help="run prompts through the single-process LocalEngine")
    s.add_argument("--model", help="checkpoint directory (default: the generated tiny preset)")
    s.add_argument("--prompt-token-ids", type=_token_ids, action="append", metavar="1,2,3")
    s.add_argument("--prompt", action="append", metavar="TEXT")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    s.set_defaults(fn=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
