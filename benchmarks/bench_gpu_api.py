"""#57's API checks on the real cluster on one GPU: greedy tokens over the OpenAI API against
LocalEngine's, per transport, and an expert worker SIGKILLed under 16 streams.

The whole cluster (Ray, embedded Redis, the balancer, the Ray Serve router) on one machine: 1
attention worker and 2 expert workers sharing the GPU (attention_gpus 0.5, expert_gpus 0.25: each
process's CUDA memory capped at its share, services/gpus.py), `--dtype` on `--device`. First
LocalEngine's greedy tokens for the prompts, on the same device in the same dtype (then freed);
then per transport of `--transports` (cuda-ipc: rows on the device; shm: rows through host memory)
a cluster is started and `--requests` concurrent greedy streaming completions (the official
`openai` client, tests/faults/scenario.py) are read and compared with LocalEngine's: without a
fault, then with one expert worker SIGKILLed once every stream has tokens (`--kill-transports`).
The JSON is written after every run, so a step cut short keeps what it measured.

    python -m benchmarks.bench_gpu_api --device cuda --dtype bfloat16 --out /tmp/api_gpu.json
    python -m benchmarks.bench_gpu_api --device cpu --dtype float32 --preset tiny --transports shm \\
        --requests 4 --max-tokens 16 --out /tmp/api_cpu.json   # the CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path

import torch

from services.net import free_port
from services.presets import init_model
from tests.faults import scenario

ATTENTION_GPUS, EXPERT_GPUS = 0.5, 0.25  # one GPU: 1 attention worker + 2 expert workers


def local_engine_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int, device: str, dtype: str):
    """LocalEngine's greedy tokens (EOS ignored) on `device` in `dtype`, and its seconds; the engine
    is freed before the cluster starts (scenario.local_tokens is this on the CPU in float32)."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams

    t0 = time.monotonic()
    engine = LocalEngine(
        EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_num_seqs=max(32, len(prompts)))
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    kernels = engine.stats().get("kernels")
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return tokens, kernels, time.monotonic() - t0


def compare(outcome: scenario.Outcome, expected: list[list[int]]) -> dict:
    """What a client got against LocalEngine's tokens: lost, finished, identical, and for each
    request that differs the first position where it does."""
    first_diff = {}
    for i, (got, want) in enumerate(zip(outcome.tokens, expected, strict=True)):
        if got != want:
            at = next(
                (j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            first_diff[str(i)] = {"at": at, "got_len": len(got), "want_len": len(want)}
    return {
        "requests": len(expected),
        "lost": outcome.lost,
        "finished_length": sum(f == "length" for f in outcome.finish_reasons),
        "identical": len(expected) - len(first_diff),
        "first_difference": first_diff,
        "run_s": round(outcome.seconds, 2),
        "errors": sorted({e for e in outcome.errors if e})[:3],
    }


def transports_in_use(namespace: str) -> list[str]:
    """The data planes the attention workers' pairs run on (their stats)."""
    import ray

    from services.settings import BALANCER_NAME

    status = ray.get(ray.get_actor(BALANCER_NAME, namespace=namespace).status.remote(), timeout=30)
    workers = [ray.get_actor(n, namespace=namespace) for n in status["attention_workers"]]
    seen = set()
    for stats in ray.get([w.stats.remote() for w in workers], timeout=30):
        seen |= set(stats.get("dispatch", {}).get("transport", {}).values())
    return sorted(seen)


def run_transport(args, model_dir: Path, transport: str, expected: list[list[int]], row: dict, save) -> None:
    """One cluster on `transport`: the streams without a fault, then (if asked) with an expert
    worker SIGKILLed; what it measured into `row`, `save()` after each run."""
    from services.cluster import Cluster, ClusterConfig

    on_gpu = args.device.startswith("cuda")
    cfg = ClusterConfig(
        model=str(model_dir), served_model_name="tiny",  # (scenario's requests name the model "tiny")
        port=free_port(), attention_workers=1, expert_workers=2, dtype=args.dtype,
        attention_gpus=ATTENTION_GPUS if on_gpu else 0.0, expert_gpus=EXPERT_GPUS if on_gpu else 0.0,
        expert_transport=transport, balancer_period_s=0, max_num_seqs=32, num_cpus=args.num_cpus,
    )  # fmt: skip
    t0 = time.monotonic()
    cluster = Cluster.start(cfg)
    row["cluster_start_s"] = round(time.monotonic() - t0, 1)
    ns = cfg.namespace
    try:
        outcome = scenario.run(cluster.url, "none", None, requests=args.requests, max_tokens=args.max_tokens,
                               timeout_s=args.timeout_s)  # fmt: skip
        row["no_fault"] = compare(outcome, expected)
        row["transports_in_use"] = transports_in_use(ns)  # (the pairs' data planes, as they served)
        print(transport, "no fault", json.dumps(row["no_fault"]), flush=True)
        save()
        if transport in args.kill_transports.split(","):
            fault = scenario.kill(lambda: scenario.expert_worker_pid(ns, 1))
            outcome = scenario.run(cluster.url, "expert worker", fault, requests=args.requests,
                                   max_tokens=args.max_tokens, timeout_s=args.timeout_s)  # fmt: skip
            killed = compare(outcome, expected)
            killed["killed_pid"] = outcome.fault_result
            killed["seconds_until_tokens_flow_again"] = round(outcome.stall_s(), 3)
            row["expert_worker_sigkill"] = killed
            print(transport, "expert worker killed", json.dumps(killed), flush=True)
            save()
            try:
                status = scenario.wait_healed(ns, expert_workers=2, timeout_s=args.heal_timeout_s)
                dead = [d for d in status["dead_workers"] if d["detected_at"] >= outcome.killed_at]
                killed["expert_heal_s"] = (
                    round(dead[0]["healed_s"], 3) if dead and dead[0]["healed_s"] else None
                )
                killed["cluster_whole_again_s"] = round(time.time() - outcome.killed_at, 2)
            except Exception as e:  # (a record: the next transport still runs)
                killed["cluster_whole_again_s"] = f"{type(e).__name__}: {str(e)[:300]}"
            save()
    finally:
        t1 = time.monotonic()
        cluster.stop()
        row["cluster_stop_s"] = round(time.monotonic() - t1, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="small", help="the model drawn (small; tiny for a quick dry run)")
    ap.add_argument("--transports", default="cuda-ipc,shm")
    ap.add_argument("--kill-transports", default="cuda-ipc,shm", help="where an expert worker is SIGKILLed")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-cpus", type=int, default=None, help="Ray's logical CPUs (default: max(4, cores))")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per stream")
    ap.add_argument("--heal-timeout-s", type=float, default=60.0)
    ap.add_argument("--out", default="benchmarks/results/api_gpu.json")
    args = ap.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    on_gpu = args.device.startswith("cuda")
    result: dict = {
        "benchmark": "gpu_api",
        "device": torch.cuda.get_device_name() if on_gpu and torch.cuda.is_available() else args.device,
        "dtype": args.dtype,
        "host": {"cores": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__},
        "setup": {
            "preset": args.preset,
            "attention_workers": 1,
            "expert_workers": 2,
            "attention_gpus": ATTENTION_GPUS if on_gpu else 0.0,
            "expert_gpus": EXPERT_GPUS if on_gpu else 0.0,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "client": "openai (official), streaming completions, temperature 0, ignore_eos",
            "fault": "SIGKILL of expert worker 1 once every stream has 8 tokens",
        },
        "target": {"lost": 0, "identical": args.requests},
        "transports": {},
    }

    def save():
        out.write_text(json.dumps(result, indent=2) + "\n")

    t0 = time.monotonic()
    model_dir = init_model(Path(tempfile.mkdtemp(prefix="bench-gpu-api-")) / args.preset, args.preset, seed=0)
    result["setup"]["model_init_s"] = round(time.monotonic() - t0, 1)
    prompts = scenario.prompts(args.requests)
    expected, kernels, seconds = local_engine_tokens(
        model_dir, prompts, args.max_tokens, args.device, args.dtype
    )
    result["local_engine"] = {"seconds": round(seconds, 1), "kernels": kernels}
    save()
    for transport in args.transports.split(","):
        row = result["transports"][transport] = {}
        try:
            run_transport(args, model_dir, transport, expected, row, save)
        except Exception as e:  # the next transport still runs
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
            print(transport, "failed:", traceback.format_exc(), flush=True)
        save()
    summary = {}
    for transport, row in result["transports"].items():
        for run in ("no_fault", "expert_worker_sigkill"):
            if isinstance(row.get(run), dict):
                r = row[run]
                summary[f"{transport}_{run}"] = {
                    "lost": r["lost"],
                    "identical": f"{r['identical']}/{r['requests']}",
                }
        if "error" in row:
            summary[f"{transport}_error"] = row["error"][:200]
    result["summary"] = summary
    save()
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
