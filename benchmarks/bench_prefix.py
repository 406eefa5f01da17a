"""Prefix caching: time to first token of a hit vs a miss, throughput with a shared prefix on vs
off, and the hit rate prefix-affinity routing keeps with two attention workers.

1. TTFT: a `--system-tokens` (1,536) shared system prompt + a 16-token question, LocalEngine on
   the `small` preset: the first request misses, the next ones hit (median of `--repeats`); also
   the same requests with caching off.
2. Throughput: 32 requests sharing a 1,024-token prefix (+16 own tokens, 16 new tokens each),
   submitted together; wall time with caching on vs off.
3. Affinity: 7 system prompts x 6 questions, interleaved, over two engines (two attention
   workers' caches, in this process) routed by the router's `PrefixAffinity`, vs least-loaded
   round robin, vs one engine: the fraction of prompt tokens served from a cache.

    python -m benchmarks.bench_prefix [--out benchmarks/results/prefix.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.engine.engine import Engine, EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.presets import init_model
from services.router.affinity import PrefixAffinity


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def ttft(engine: Engine, prompt: list[int]) -> float:
    """Seconds from submission to the first token (the request's prefill)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        if any(o.request_id == rid for o in engine.step().outputs):
            return time.perf_counter() - t0


def measure_ttft(model: str, system_tokens: int, repeats: int, vocab: int) -> dict:
    system = [0] + tokens(system_tokens - 1, 1, vocab)
    questions = [tokens(16, 100 + i, vocab) for i in range(repeats + 1)]
    out = {}
    for caching in (True, False):
        engine = LocalEngine(EngineConfig(model=model, prefix_caching=caching, max_num_batched_tokens=4096))
        miss = ttft(engine, system + questions[0])
        rest = [ttft(engine, system + q) for q in questions[1:]]
        out["on" if caching else "off"] = {"first_s": miss, "next_median_s": statistics.median(rest)}
    out["hit_over_miss"] = out["on"]["next_median_s"] / out["off"]["next_median_s"]
    out["target_hit<=0.2x_miss"] = out["hit_over_miss"] <= 0.2
    return out


def measure_throughput(model: str, vocab: int, requests: int = 32) -> dict:
    prefix = [0] + tokens(1023, 2, vocab)
    prompts = [prefix + tokens(16, 200 + i, vocab) for i in range(requests)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = {}
    for caching in (True, False):
        engine = LocalEngine(EngineConfig(model=model, prefix_caching=caching))
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        out["on_s" if caching else "off_s"] = time.perf_counter() - t0
    out["speedup"] = out["off_s"] / out["on_s"]
    out["target>=2x"] = out["speedup"] >= 2.0
    return out


def measure_affinity(model: str, vocab: int) -> dict:
    systems = [[0] + tokens(255, 300 + s, vocab) for s in range(7)]
    stream = [systems[s] + tokens(8, 400 + 10 * s + q, vocab) for q in range(6) for s in range(7)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def hit_rate(engines: list[Engine], route) -> float:
        for prompt in stream:
            engines[route(prompt)].generate([prompt], params)
        stats = [e.stats()["prefix_cache"] for e in engines]
        return sum(s["hit_tokens"] for s in stats) / sum(s["queried_tokens"] for s in stats)

    def engines(n):
        return [LocalEngine(EngineConfig(model=model, max_num_seqs=8)) for _ in range(n)]

    affinity, rr = PrefixAffinity(), itertools.count()

    def by_affinity(prompt):
        name = affinity.choose(prompt, {"0": 0, "1": 0}) or str(next(rr) % 2)
        affinity.record(prompt, name)
        return int(name)

    one = hit_rate(engines(1), lambda p: 0)
    two_affinity = hit_rate(engines(2), by_affinity)
    two_rr = hit_rate(engines(2), lambda p: next(rr) % 2)
    return {"one_worker": one, "two_affinity": two_affinity, "two_round_robin": two_rr,
            "target_affinity_within_10%_of_one": two_affinity >= 0.9 * one}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: generate the small preset)")
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/prefix.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(init_model(Path(tempfile.mkdtemp()) / "small", "small"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    result = {
        "benchmark": "prefix_caching",
        "model": "small preset" if not args.model else model,
        "threads": args.threads,
        "ttft": measure_ttft(model, args.system_tokens, args.repeats, vocab),
        "throughput_32_requests_1k_prefix": measure_throughput(model, vocab),
        "affinity_hit_rate": measure_affinity(model, vocab),
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
