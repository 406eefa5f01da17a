"""LocalEngine vs transformers `generate` (and llama.cpp, given a build) on one checkpoint,
same machine, same run.

Decode tokens/s at batch 1, 8, 32 (greedy, 64 new tokens): decode time = time(64 new tokens)
- time(1 new token) for every engine, so prefill is excluded the same way. Also the achieved
weight-read bandwidth at batch 1 (bytes of the weights a decode step must read / step time)
against a measured memory-copy bandwidth of this machine.

Two transformers baselines, side by side, and LocalEngine's ratio to each:
- eager: `generate` with its default dynamic cache, the forward run eagerly;
- static_compiled: `generate(..., cache_implementation="static")` with the model's forward
  compiled (`torch.compile(mode="reduce-overhead")`: CUDA graphs on a GPU), transformers' own
  fast decode path. `--hf-static auto` (default) runs it on CUDA only (on a CPU there are no
  CUDA graphs to gain and inductor's compile takes minutes); `on` forces it, `off` skips it. A
  failure to compile is recorded in the JSON (`transformers_static_compiled_error`), not fatal.

With `--llama-bench PATH/llama-batched-bench --gguf MODEL.gguf` (the same checkpoint converted
by llama.cpp's convert_hf_to_gguf.py, see docs/benchmarks.md), each row also gets llama.cpp's
decode tokens/s (`S_TG`, same threads, f32 KV cache, flash attention off). Never run in CI.

    python -m benchmarks.bench_local_engine [--model DIR] [--llama-bench BIN --gguf FILE]
                                            [--device cuda --dtype bfloat16] [--weight-dtype bfloat16]
                                            [--keep-fp8-experts --reference-model DIR]
                                            [--out benchmarks/results/local_engine.json]

`--keep-fp8-experts` (an FP8 checkpoint): LocalEngine holds the routed experts in FP8; transformers
then loads `--reference-model` (the same model in fp32: transformers runs FP8 checkpoints on GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig
from services.presets import init_model

NEW_TOKENS = 64


def prompts(batch: int, vocab: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [[0] + torch.randint(4, vocab, (prompt_len - 1,), generator=g).tolist() for _ in range(batch)]


def time_ours(engine: LocalEngine, batch: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    engine.generate(batch, params)
    return time.perf_counter() - t


@torch.no_grad()
def time_hf(model, batch: list[list[int]], new_tokens: int, static: bool = False) -> float:
    """Seconds of one greedy `generate` of `new_tokens`; static: with a static cache (the caller
    has compiled the forward: `compiled_forward`)."""
    ids = torch.tensor(batch, device=model.device)
    extra = {}
    if static:
        extra["cache_implementation"] = "static"
        if hasattr(model.generation_config, "disable_compile"):
            extra["disable_compile"] = True  # (the forward is compiled already: not its __call__ again)
    t = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


@contextlib.contextmanager
def compiled_forward(model, compiled):
    """`model.forward` is `compiled` inside (the eager baseline keeps the plain one outside)."""
    model.forward = compiled
    try:
        yield
    finally:
        del model.forward  # (the instance attribute: the class's forward again)


def compile_forward(model):
    """The model's forward compiled as transformers documents for a static cache: mode
    "reduce-overhead" (CUDA graphs). Every (batch, prompt length) and the decode step are shapes of
    their own: room for them all before dynamo gives up and runs eagerly."""
    import torch._dynamo.config as dynamo_config

    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(64, getattr(dynamo_config, limit)))
    return torch.compile(model.forward, mode="reduce-overhead")


def decode_tps(fn, batch, repeats: int, warmup: tuple[int, ...] = (2,)) -> float:
    for n in warmup:  # warm up (a compiled path: every shape it will meet, the longest cache first)
        fn(batch, n)
    t1 = min(fn(batch, 1) for _ in range(repeats))
    t64 = min(fn(batch, NEW_TOKENS) for _ in range(repeats))
    return len(batch) * (NEW_TOKENS - 1) / (t64 - t1)


def llama_cpp_tps(
    binary: str, gguf: str, batches: list[int], prompt_len: int, threads: int, extra: list[str] = ()
) -> dict[int, float]:
    """llama.cpp's decode tokens/s per batch size from one `llama-batched-bench` run. The model is
    read into memory at load (`-lm none`): memory-mapped, the experts' pages are faulted in by the
    first decode steps that route to them, from disk once our engine's run has pushed the file out
    of the page cache (one such run measured 121 tok/s at batch 1 where llama.cpp does ~218)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-npp", str(prompt_len),
           "-ntg", str(NEW_TOKENS), "-npl", ",".join(map(str, batches)), "-fa", "off", "-ctk", "f32",
           "-ctv", "f32", "-lm", "none", "-c", str(max(batches) * (prompt_len + NEW_TOKENS) + 64), *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2]):
            rows[int(cells[2])] = float(cells[7])
    return rows


def active_bytes_per_token(
    cfg: ModelConfig, dtype_bytes: int = 4, weight_bytes: int | None = None, routed_bytes: float | None = None
) -> int:
    """Weight bytes one decode token must read: attention side + shared + top-k routed experts.
    weight_bytes: the bytes of a linear / expert weight when narrower (EngineConfig.weight_dtype;
    kv_b and the router stay at dtype_bytes); routed_bytes: of a routed expert's weight (FP8
    kept: 1, plus its share of the block scales)."""
    H, N = cfg.hidden_size, cfg.num_attention_heads
    D, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    wb = weight_bytes or dtype_bytes
    q = (H * cfg.q_lora_rank + cfg.q_lora_rank * N * (D + R)) if cfg.q_lora_rank else H * N * (D + R)
    attn = (q + H * (C + R) + N * V * H) * wb + N * (D + V) * C * dtype_bytes
    expert = 3 * H * cfg.moe_intermediate_size
    total = cfg.num_hidden_layers * attn + H * cfg.vocab_size * wb  # + LM head (embedding is a row gather)
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            routed = cfg.num_experts_per_tok * expert * (routed_bytes or wb)
            total += routed + cfg.n_shared_experts * expert * wb + cfg.n_routed_experts * H * 4
        else:
            total += 3 * H * cfg.intermediate_size * wb
    return total


def memcpy_bandwidth(device: str = "cpu") -> float:
    """Bytes read + written per second by one 256 MB copy on `device` (a GPU's HBM on cuda)."""
    a = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    b.copy_(a)
    sync()
    best = min(_timed(lambda: (b.copy_(a), sync())) for _ in range(10))
    return 2 * a.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint dir (default: generate the small preset)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-lens", default="16,512", help="prompt lengths to run every batch size at")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (both engines)")
    ap.add_argument(
        "--weight-dtype", help="bfloat16: LocalEngine holds its weights in bf16 (transformers: --dtype)"
    )
    ap.add_argument("--keep-fp8-experts", action="store_true", help="LocalEngine: FP8 experts held in FP8")
    ap.add_argument("--reference-model", help="the checkpoint transformers loads (default: --model)")
    ap.add_argument(
        "--hf-static",
        choices=("auto", "on", "off"),
        default="auto",
        help="the transformers static-cache + torch.compile baseline (auto: on CUDA only)",
    )
    ap.add_argument("--out", default="benchmarks/results/local_engine.json")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-batched-bench binary (adds a llama.cpp column)")
    ap.add_argument("--gguf", help="the same checkpoint as llama.cpp f32 GGUF (with --llama-bench)")
    ap.add_argument("--llama-args", default="", help="more llama-batched-bench flags, e.g. '-nr' (no repack)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else init_model(Path(tempfile.mkdtemp()) / "small", "small")
    cfg = ModelConfig.from_dir(model_dir)

    import transformers
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    reference = Path(args.reference_model) if args.reference_model else model_dir
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=dtype).eval().to(args.device)  # sdpa
    static = args.hf_static == "on" or (args.hf_static == "auto" and args.device.startswith("cuda"))
    compiled = compile_forward(hf) if static else None
    static_error = None
    engine = LocalEngine(
        EngineConfig(
            model=str(model_dir),
            max_num_seqs=64,
            device=args.device,
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            keep_fp8_experts=args.keep_fp8_experts,
        )  # fmt: skip
    )
    rows = []
    batches = [int(x) for x in args.batches.split(",")]
    for prompt_len in [int(x) for x in args.prompt_lens.split(",")]:
        llama = {}
        if args.llama_bench:
            llama = llama_cpp_tps(
                args.llama_bench, args.gguf, batches, prompt_len, args.threads, args.llama_args.split()
            )
        for b in batches:
            batch = prompts(b, cfg.vocab_size, prompt_len)
            ours = decode_tps(lambda p, n: time_ours(engine, p, n), batch, args.repeats)
            ref = decode_tps(lambda p, n: time_hf(hf, p, n), batch, args.repeats)
            row = {"prompt_len": prompt_len, "batch": b, "local_engine_tok_s": ours,
                   "transformers_eager_tok_s": ref, "speedup_vs_eager": ours / ref,
                   "transformers_static_compiled_tok_s": None, "speedup_vs_static_compiled": None}  # fmt: skip
            if static and static_error is None:
                try:
                    with compiled_forward(hf, compiled):
                        ref_static = decode_tps(lambda p, n: time_hf(hf, p, n, static=True), batch,
                                                args.repeats, warmup=(NEW_TOKENS, 1, 2))  # fmt: skip
                    row |= {"transformers_static_compiled_tok_s": ref_static,
                            "speedup_vs_static_compiled": ours / ref_static}  # fmt: skip
                except Exception as e:  # (recorded; the eager rows stand)
                    static_error = f"{type(e).__name__}: {e}"[:2000]
                    print(f"transformers static cache + compile failed: {static_error}", flush=True)
            if b in llama:
                row |= {"llama_cpp_tok_s": llama[b], "vs_llama_cpp": ours / llama[b]}
            rows.append(row)
            static_text = ""
            if row["transformers_static_compiled_tok_s"]:
                static_text = (f"  transformers static+compiled {row['transformers_static_compiled_tok_s']:8.1f} tok/s"
                               f"  x{row['speedup_vs_static_compiled']:.2f}")  # fmt: skip
            print(f"prompt {prompt_len:4d} batch {b:3d}: LocalEngine {ours:8.1f} tok/s  transformers eager {ref:8.1f} "
                  f"tok/s  x{ours / ref:.2f}" + static_text
                  + (f"  llama.cpp {llama[b]:8.1f} tok/s" if b in llama else ""), flush=True)  # fmt: skip

    step_s = 1.0 / rows[0]["local_engine_tok_s"] if rows[0]["batch"] == 1 else None  # shortest prompt
    weight_bytes = getattr(torch, args.weight_dtype).itemsize if args.weight_dtype else None
    routed_bytes = None
    if args.keep_fp8_experts:
        bn, bk = cfg.fp8_block_size
        routed_bytes = 1 + 4 / (bn * bk)  # FP8 plus one fp32 scale per block
    active = active_bytes_per_token(cfg, dtype.itemsize, weight_bytes, routed_bytes)
    bw = memcpy_bandwidth(args.device)
    result = {
        "benchmark": "local_engine_vs_transformers",
        "model": "small preset" if not args.model else str(model_dir),
        "dtype": args.dtype,
        "weight_dtype": args.weight_dtype or args.dtype,
        "keep_fp8_experts": args.keep_fp8_experts,
        "reference_model": str(reference) if args.reference_model else None,
        "llama_cpp_gguf": Path(args.gguf).name if args.llama_bench else None,
        "llama_cpp_args": args.llama_args or None,
        "cuda_graphs": engine.graphs is not None,
        "transformers_baselines": {
            "eager": "generate, default (dynamic) cache, eager forward",
            "static_compiled": (
                'generate(cache_implementation="static"), forward torch.compile(mode="reduce-overhead")'
                if static
                else None
            ),
        },
        "transformers_static_compiled_error": static_error,
        "new_tokens": NEW_TOKENS,
        "prompt_lens": args.prompt_lens,
        "threads": args.threads,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
        "batch1_weight_read": {
            "active_bytes_per_token": active,
            "achieved_GB_s": active / step_s / 1e9 if step_s else None,
            "memcpy_GB_s": bw / 1e9,
            "fraction_of_memcpy": (active / step_s) / bw if step_s else None,
        },
    }

    def speedup(b: int, baseline: str = "eager") -> float | None:  # at the shortest prompt
        return next((r[f"speedup_vs_{baseline}"] for r in rows if r["batch"] == b), None)

    def vs_llama(b: int) -> float | None:
        return next((r.get("vs_llama_cpp") for r in rows if r["batch"] == b), None)

    result["targets"] = {  # issue #21, at the shortest prompt
        "batch32_vs_transformers_eager>=2.5": None if speedup(32) is None else speedup(32) >= 2.5,
        "batch32_vs_transformers_static_compiled>=2.5": None
        if speedup(32, "static_compiled") is None
        else speedup(32, "static_compiled") >= 2.5,
        "batch32_vs_llama_cpp>=1.0": None if vs_llama(32) is None else vs_llama(32) >= 1.0,
        "batch1_vs_llama_cpp>=0.6": None if vs_llama(1) is None else vs_llama(1) >= 0.6,
        "batch1_fraction_of_memcpy>=0.5": None if not step_s else active / step_s / bw >= 0.5,
    }
    print(json.dumps(result["batch1_weight_read"], indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
